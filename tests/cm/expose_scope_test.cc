// Issue 27: no connection can touch memory that was not given to it. A
// server's Worker holds several connections in one protection domain; a
// peer of one of them attacks as a client would: with a token exposed to
// another connection, with keys guessed from the ones it sees (its own
// exposures and landing grants), with a token after revocation or after
// its connection closed, and with an RDMA WRITE aimed at another
// connection's landing grant. Each attack fails on the attacker's own
// connection; the victim's connection keeps working and its bytes are
// intact.
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "cm/connection_test_peer.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/key_attacks.h"
#include "tests/cm/test_util.h"

namespace coverbs::cm {
namespace {

using internal::ConnectionTestPeer;

using ::coverbs::testing::Mix;
using ::coverbs::testing::Refused;
using ::coverbs::testing::Unmix;

// What a peer would try next from the keys it has seen: neighbours, and
// the keys the former schedule would have handed out around each.
std::set<uint32_t> Guesses(const std::vector<uint32_t>& seen) {
  std::set<uint32_t> g;
  for (uint32_t k : seen) {
    for (uint32_t d = 1; d <= 32; ++d) {
      g.insert(k + d);
      g.insert(k - d);
      g.insert(k + (d << 8));  // verbs-style: next index, same key byte
      g.insert(Mix(Unmix(k) + d));
      g.insert(Mix(Unmix(k) - d));
    }
  }
  for (uint32_t k : seen) g.erase(k);
  return g;
}

class ExposeScopeTest : public CmTest {
 public:
  bool Windows() const { return device_->caps().memory_windows; }
  std::string NoWindows() const {
    return device_->caps().device_name +
           " has no memory windows: Expose refuses to scope a key "
           "(WithoutWindowsExposeSaysWhy)";
  }

  // Two connections to the same server Worker: `victim` and `attacker`.
  // Declared so that the connections (and their exposures) go first.
  struct Setup {
    std::vector<std::byte> region;
    transport::MemoryRegion mr;
    transport::RemoteRegion token;  // exposed to the victim's connection
    Pair victim;
    Pair attacker;
  };

  // The server's region is registered for local access only: only
  // exposures reach it.
  Task<absl::Status> Prepare(Setup* s) {
    auto v = co_await MakePair();
    if (!v.ok()) co_return v.status();
    auto a = co_await MakePair();
    if (!a.ok()) co_return a.status();
    s->victim = *std::move(v);
    s->attacker = *std::move(a);
    s->region = Pattern(8192, 3);
    auto mr = server_ctx_->pd().Register(s->region.data(), s->region.size(),
                                         IBV_ACCESS_LOCAL_WRITE);
    if (!mr.ok()) co_return mr.status();
    s->mr = *std::move(mr);
    auto tok = s->victim.server->Expose(
        s->mr, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
    if (!tok.ok()) co_return tok.status();
    s->token = *tok;
    co_return absl::OkStatus();
  }

  // The victim's connection still carries messages and its token still
  // reads the region's bytes.
  static Task<void> VictimIntact(Setup& s) {
    std::vector<std::byte> back(s.region.size());
    CO_ASSERT_OK(co_await s.victim.client->Read(std::span(back), s.token));
    EXPECT_TRUE(Same(back, s.region));
    auto msg = Pattern(300, 9);
    CO_ASSERT_OK(co_await s.victim.client->Send(msg));
    auto m = co_await s.victim.server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_TRUE(Same(m->data(), msg));
  }
};

TEST_P(ExposeScopeTest, TokenOfAnotherConnectionIsRefused) {
  if (!Windows()) GTEST_SKIP() << NoWindows();
  Run([](ExposeScopeTest* t) -> Task<void> {
    Setup s;
    CO_ASSERT_OK(co_await t->Prepare(&s));
    const std::vector<std::byte> snapshot = s.region;
    std::vector<std::byte> loot(4096, std::byte{0});
    auto r = co_await s.attacker.client->Read(std::span(loot),
                                              s.token.Slice(0, 4096));
    EXPECT_TRUE(Refused(r, "RDMA READ on ")) << r;
    EXPECT_TRUE(Same(loot, std::vector<std::byte>(4096, std::byte{0})))
        << "a refused READ placed data";
    // A WRITE, on a fresh attacking connection (the READ ended the first).
    auto w2 = co_await t->MakePair();
    CO_ASSERT_OK(w2);
    auto junk = Pattern(4096, 0x66);
    auto w = co_await w2->client->Write(std::span<const std::byte>(junk),
                                        s.token.Slice(0, 4096));
    EXPECT_TRUE(Refused(w, "RDMA WRITE on ")) << w;
    EXPECT_TRUE(Same(s.region, snapshot)) << "another connection wrote";
    co_await VictimIntact(s);
    co_await Close(*w2);
    co_await Close(s.attacker);
    co_await Close(s.victim);
  }(this));
}

TEST_P(ExposeScopeTest, RevokedTokenIsRefused) {
  if (!Windows()) GTEST_SKIP() << NoWindows();
  Run([](ExposeScopeTest* t) -> Task<void> {
    Setup s;
    CO_ASSERT_OK(co_await t->Prepare(&s));
    std::vector<std::byte> back(4096);
    CO_ASSERT_OK(co_await s.victim.client->Read(std::span(back),
                                                s.token.Slice(0, 4096)));
    CO_ASSERT_OK(s.victim.server->Revoke(s.token));
    EXPECT_EQ(s.victim.server->Revoke(s.token).code(),
              absl::StatusCode::kNotFound);
    const std::vector<std::byte> snapshot = s.region;
    auto junk = Pattern(4096, 0x77);
    auto w = co_await s.victim.client->Write(std::span<const std::byte>(junk),
                                             s.token.Slice(0, 4096));
    EXPECT_TRUE(Refused(w, "RDMA WRITE on ")) << "after revoke: " << w;
    EXPECT_TRUE(Same(s.region, snapshot)) << "a revoked token wrote";
    // The other connection is untouched.
    auto msg = Pattern(200, 1);
    CO_ASSERT_OK(co_await s.attacker.client->Send(msg));
    auto m = co_await s.attacker.server->Recv();
    CO_ASSERT_OK(m);
    EXPECT_TRUE(Same(m->data(), msg));
    co_await Close(s.attacker);
    co_await Close(s.victim);
  }(this));
}

// Issue 37: a connection holds at most max_exposures exposures and
// max_exposed_bytes bytes; past either Expose fails with ResourceExhausted
// naming the bound (counted), the connection keeps working, and a Revoke
// makes room. ExposeOwned keeps its owner exactly until the exposure ends.
TEST_P(ExposeScopeTest, ExposuresPerConnectionAreBounded) {
  if (!Windows()) GTEST_SKIP() << NoWindows();
  Run([](ExposeScopeTest* t) -> Task<void> {
    ConnectionOptions o;
    o.max_exposures = 4;
    o.max_exposed_bytes = 10000;
    auto p = co_await t->MakePairWith(o);
    CO_ASSERT_OK(p);
    std::vector<std::byte> region = Pattern(16384, 5);
    auto mr = t->server_ctx_->pd().Register(region.data(), region.size(),
                                            IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(mr);
    std::vector<transport::RemoteRegion> tokens;
    for (int i = 0; i < 4; ++i) {
      auto tok = p->server->Expose(*mr, transport::Access::kRemoteRead,
                                   i * 1000, 1000);
      CO_ASSERT_OK(tok);
      tokens.push_back(*tok);
    }
    auto fifth = p->server->Expose(*mr, transport::Access::kRemoteRead, 0, 10);
    EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(fifth.status().message(),
                                  "ConnectionOptions::max_exposures"))
        << fifth.status();
    CO_ASSERT_OK(p->server->Revoke(tokens.back()));
    tokens.pop_back();
    // 3,000 bytes exposed: 8,000 more would pass the 10,000-byte bound.
    auto big = p->server->Expose(*mr, transport::Access::kRemoteRead, 0, 8000);
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(big.status().message(),
                                  "ConnectionOptions::max_exposed_bytes"))
        << big.status();
    Connection::Stats st = p->server->stats();
    EXPECT_EQ(st.exposures, 3u);
    EXPECT_EQ(st.exposed_bytes, 3000u);
    EXPECT_EQ(st.exposures_refused, 2u);
    EXPECT_EQ(t->server_ctx_->exposures_refused(), 2u);
    // The exposures still work, and the connection carries messages.
    std::vector<std::byte> back(1000);
    CO_ASSERT_OK(co_await p->client->Read(std::span(back), tokens[1]));
    EXPECT_TRUE(Same(back, std::span(region).subspan(1000, 1000)));
    // ExposeOwned: the owner lives as long as the exposure.
    auto owned = std::make_shared<std::vector<std::byte>>(Pattern(500, 8));
    std::weak_ptr<std::vector<std::byte>> watch = owned;
    auto omr = t->server_ctx_->pd().Register(owned->data(), owned->size(), 0);
    CO_ASSERT_OK(omr);
    struct Owner {
      std::shared_ptr<std::vector<std::byte>> bytes;
      transport::MemoryRegion mr;
    };
    auto owner = std::make_shared<Owner>(Owner{owned, *std::move(omr)});
    const transport::MemoryRegion& region_of_owner = owner->mr;
    auto otok = p->server->ExposeOwned(std::move(owner), region_of_owner,
                                       transport::Access::kRemoteRead);
    CO_ASSERT_OK(otok);
    owned.reset();
    EXPECT_FALSE(watch.expired()) << "the exposure let its owner go";
    std::vector<std::byte> obytes(500);
    CO_ASSERT_OK(co_await p->client->Read(std::span(obytes), *otok));
    EXPECT_TRUE(Same(obytes, Pattern(500, 8)));
    CO_ASSERT_OK(p->server->Revoke(*otok));
    EXPECT_TRUE(watch.expired()) << "revoked, the owner is still held";
    co_await Close(*p);
  }(this));
}

TEST_P(ExposeScopeTest, TokenAfterItsConnectionClosedIsRefused) {
  if (!Windows()) GTEST_SKIP() << NoWindows();
  Run([](ExposeScopeTest* t) -> Task<void> {
    Setup s;
    CO_ASSERT_OK(co_await t->Prepare(&s));
    co_await Close(s.victim);
    const std::vector<std::byte> snapshot = s.region;
    auto junk = Pattern(4096, 0x55);
    auto w = co_await s.attacker.client->Write(std::span<const std::byte>(junk),
                                               s.token.Slice(0, 4096));
    EXPECT_TRUE(Refused(w, "RDMA WRITE on ")) << "after close: " << w;
    EXPECT_TRUE(Same(s.region, snapshot))
        << "a closed connection's token wrote";
    // Revoking after close: the exposure already ended with the connection.
    EXPECT_EQ(s.victim.server->Revoke(s.token).code(),
              absl::StatusCode::kNotFound);
    co_await Close(s.attacker);
  }(this));
}

TEST_P(ExposeScopeTest, KeysSeenByAPeerDoNotPredictOthers) {
  if (!Windows()) GTEST_SKIP() << NoWindows();
  Run([](ExposeScopeTest* t) -> Task<void> {
    Setup s;
    CO_ASSERT_OK(co_await t->Prepare(&s));
    // The attacker sees many keys of its own: exposures to it, and the
    // landing grants its peer gives it once it sends medium messages.
    std::vector<std::byte> mine(4096);
    auto own_mr = t->server_ctx_->pd().Register(mine.data(), mine.size(),
                                                IBV_ACCESS_LOCAL_WRITE);
    CO_ASSERT_OK(own_mr);
    std::vector<uint32_t> seen;
    for (int i = 0; i < 32; ++i) {
      auto tok = s.attacker.server->Expose(*own_mr, IBV_ACCESS_REMOTE_READ);
      CO_ASSERT_OK(tok);
      seen.push_back(tok->rkey);
      co_await t->reactor_->Yield();  // the bind's completion frees its slot
    }
    auto medium = Pattern(20000, 5);
    CO_ASSERT_OK(co_await s.attacker.client->Send(medium));
    CO_ASSERT_OK(co_await s.attacker.server->Recv());
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ConnectionTestPeer::Grants(*s.attacker.client).empty() &&
           absl::Now() < deadline) {
      co_await t->reactor_->Sleep(absl::Milliseconds(1));
    }
    for (const auto& g : ConnectionTestPeer::Grants(*s.attacker.client)) {
      seen.push_back(g.rkey);
    }
    EXPECT_GT(seen.size(), 32u) << "no landing grants were seen";
    // The former schedule would have given the next keys away: one of the
    // 32 consecutive exposures' keys would follow from its predecessor.
    int predicted = 0;
    for (size_t i = 1; i < 32; ++i) {
      for (uint32_t d = 1; d <= 8; ++d) {
        if (Mix(Unmix(seen[i - 1]) + d) == seen[i]) ++predicted;
      }
    }
    EXPECT_EQ(predicted, 0) << "consecutive keys follow a public schedule";
    // No guess from them names the victim's exposure.
    std::set<uint32_t> guesses = Guesses(seen);
    EXPECT_EQ(guesses.count(s.token.rkey), 0u)
        << "the victim's rkey follows from keys the attacker saw";
    // A few of them on the wire (each failure ends its connection).
    const std::vector<std::byte> snapshot = s.region;
    int tried = 0;
    for (uint32_t guess : guesses) {
      if (tried == 3) break;
      ++tried;
      auto atk = co_await t->MakePair();
      CO_ASSERT_OK(atk);
      auto junk = Pattern(512, 0x44);
      transport::RemoteRegion aim = s.token.Slice(0, 512);
      aim.rkey = guess;
      auto w =
          co_await atk->client->Write(std::span<const std::byte>(junk), aim);
      EXPECT_TRUE(Refused(w, "RDMA WRITE on "))
          << "guess 0x" << std::hex << guess << ": " << w;
      co_await Close(*atk);
    }
    EXPECT_TRUE(Same(s.region, snapshot)) << "a guessed key wrote";
    co_await VictimIntact(s);
    co_await Close(s.attacker);
    co_await Close(s.victim);
  }(this));
}

TEST_P(ExposeScopeTest, WriteIntoAnotherConnectionsLandingGrantIsRefused) {
  if (!Windows()) {
    GTEST_SKIP() << device_->caps().device_name
                 << " has no memory windows: its landing grants are "
                    "per-message registrations, whose rkeys verbs makes "
                    "valid for every QP of the protection domain";
  }
  Run([](ExposeScopeTest* t) -> Task<void> {
    Setup s;
    CO_ASSERT_OK(co_await t->Prepare(&s));
    // The victim's client sends a medium message: its server grants
    // landing buffers to it.
    auto first = Pattern(20000, 8);
    CO_ASSERT_OK(co_await s.victim.client->Send(first));
    CO_ASSERT_OK(co_await s.victim.server->Recv());
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ConnectionTestPeer::Grants(*s.victim.client).empty() &&
           absl::Now() < deadline) {
      co_await t->reactor_->Sleep(absl::Milliseconds(1));
    }
    auto grants = ConnectionTestPeer::Grants(*s.victim.client);
    CO_ASSERT_TRUE(!grants.empty());
    // The attacker aims at the victim's next grant, address and rkey
    // exactly (the worst case: a leak, not a guess).
    auto junk = Pattern(8192, 0x99);
    internal::GrantPayload g = grants.front();
    auto w = co_await s.attacker.client->Write(std::span<const std::byte>(junk),
                                               {g.addr, junk.size(), g.rkey});
    EXPECT_TRUE(Refused(w, "RDMA WRITE on ")) << w;
    // The victim's next medium messages land in those grants, intact.
    const uint64_t landed = s.victim.server->stats().landed_received;
    for (uint8_t i = 0; i < 4; ++i) {
      auto msg = Pattern(9000 + i, 40 + i);
      CO_ASSERT_OK(co_await s.victim.client->Send(msg));
      auto m = co_await s.victim.server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(Same(m->data(), msg)) << "message " << int{i};
    }
    EXPECT_EQ(s.victim.server->stats().landed_received, landed + 4);
    co_await Close(s.attacker);
    co_await Close(s.victim);
  }(this));
}

TEST_P(ExposeScopeTest, WithoutWindowsExposeSaysWhy) {
  if (Windows()) {
    GTEST_SKIP() << device_->caps().device_name
                 << " has memory windows (the tests above scope its keys)";
  }
  Run([](ExposeScopeTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    std::vector<std::byte> region = Pattern(4096, 2);
    auto mr = t->server_ctx_->pd().Register(
        region.data(), region.size(),
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    CO_ASSERT_OK(mr);
    auto refused = p->server->Expose(*mr);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
        << refused.status();
    EXPECT_NE(refused.status().message().find(t->device_->caps().device_name),
              std::string::npos)
        << refused.status();
    EXPECT_NE(refused.status().message().find("kProtectionDomain"),
              std::string::npos)
        << refused.status();
    // The explicit opt-in: the region's own, PD-wide rkey.
    auto wide = p->server->Expose(*mr, IBV_ACCESS_REMOTE_READ, 0,
                                  transport::MemoryRegion::npos,
                                  ExposeScope::kProtectionDomain);
    CO_ASSERT_OK(wide);
    EXPECT_EQ(wide->rkey, mr->rkey());
    co_await Close(*p);
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, ExposeScopeTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
