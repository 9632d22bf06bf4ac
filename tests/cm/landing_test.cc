// Medium messages through landing buffers granted ahead of time (cm
// protocol 5, cm/landing.cc), on every available provider: the first medium
// message takes the rendezvous and the following ones land without it;
// order holds across eager, landed and rendezvous messages; running out of
// grants falls back to the rendezvous; a grant's rkey dies with its message;
// a landed header that names no grant breaks only its connection.
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cm/connection_test_peer.h"
#include "cm/page_memory.h"
#include "cm/wire.h"
#include "core/when.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/cm/test_util.h"

namespace coverbs::cm {
namespace {

using internal::ConnectionTestPeer;

// Just above what lands by default: always the rendezvous.
const size_t kAbove = ConnectionOptions().landing_buffer_size + 1;

class LandingTest : public CmTest {
 public:
  // A message of `n` bytes whose first 4 bytes are `seq`, then a pattern.
  static std::vector<std::byte> Numbered(size_t n, uint32_t seq) {
    std::vector<std::byte> v = Pattern(n, static_cast<uint8_t>(seq));
    std::memcpy(v.data(), &seq, 4);
    return v;
  }
  static bool IsNumbered(std::span<const std::byte> d, size_t n, uint32_t seq) {
    return Same(d, Numbered(n, seq));
  }

  // Sends Numbered(n, seq) from `from`, receives it on `to` and checks its
  // bytes: the message, or what failed.
  static Task<absl::StatusOr<Message>> Deliver(Connection* from, Connection* to,
                                               size_t n, uint32_t seq) {
    auto msg = Numbered(n, seq);
    absl::Status s = co_await from->Send(msg);
    if (!s.ok()) co_return s;
    absl::StatusOr<Message> m = co_await to->Recv();
    if (m.ok() && !IsNumbered(m->data(), n, seq)) {
      co_return absl::DataLossError(
          absl::StrCat("message ", seq, " of ", n, " bytes arrived altered"));
    }
    co_return m;
  }

  // After a protocol violation sent on `bad`: its receiver fails with
  // DataLoss naming `why`, while `good` still delivers.
  static Task<void> ExpectOnlyBadFails(const Pair& bad, const Pair& good,
                                       std::string why) {
    auto m = co_await bad.server->Recv();
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
    EXPECT_NE(std::string(m.status().message()).find(why), std::string::npos)
        << m.status();
    CO_ASSERT_OK(
        co_await Deliver(good.client.get(), good.server.get(), 30000, 3));
  }

  // A kLanded header as a peer would send it (a plain SEND of these bytes).
  static std::vector<std::byte> LandedHeader(uint32_t length,
                                             uint32_t grant) {
    internal::WireHeader h{};
    h.type = internal::kLanded;
    h.length = length;
    h.cookie = grant;
    std::vector<std::byte> raw(internal::kHeaderSize);
    std::memcpy(raw.data(), &h, internal::kHeaderSize);
    return raw;
  }

  // Sends one medium message (which takes the rendezvous and makes `to`
  // grant landing buffers), receives it, and waits (bounded) until `from`
  // holds `grants` of them (grants by memory window come 16 per credit
  // message).
  Task<absl::Status> WarmUp(Connection* from, Connection* to,
                            size_t grants = 1) {
    auto m = co_await Deliver(from, to, 20000, 0);
    if (!m.ok()) co_return m.status();
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (ConnectionTestPeer::Grants(*from).size() < grants) {
      if (absl::Now() > deadline) {
        co_return absl::DeadlineExceededError("no landing grants arrived");
      }
      co_await reactor_->Sleep(absl::Milliseconds(1));
    }
    co_return absl::OkStatus();
  }
};

TEST_P(LandingTest, MediumMessagesLandWithoutRendezvousAfterTheFirst) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    const size_t all = ConnectionOptions().landing_buffers;
    CO_ASSERT_OK(
        co_await t->WarmUp(p->client.get(), p->server.get(), all));
    EXPECT_EQ(p->server->stats().rendezvous_received, 1u);
    EXPECT_EQ(ConnectionTestPeer::Grants(*p->client).size(),
              ConnectionOptions().landing_buffers);
    // One at a time: every one lands (a grant is replaced as soon as its
    // message arrives).
    const size_t sizes[] = {8193, 8200, 30000, 65536};
    for (uint32_t i = 1; i <= 100; ++i) {
      size_t n = sizes[i % 4];
      CO_ASSERT_OK(co_await Deliver(p->client.get(), p->server.get(), n, i));
    }
    Connection::Stats cs = p->client->stats();
    Connection::Stats ss = p->server->stats();
    EXPECT_EQ(cs.landed_sent, 100u);
    EXPECT_EQ(ss.landed_received, 100u);
    EXPECT_EQ(ss.rendezvous_received, 1u);
    EXPECT_EQ(ss.messages_received, 101u);
    // Above landing_buffer_size: the rendezvous, as before.
    CO_ASSERT_OK(
        co_await Deliver(p->client.get(), p->server.get(), kAbove, 7));
    EXPECT_EQ(p->server->stats().rendezvous_received, 2u);
    // The other direction grants on its own.
    CO_ASSERT_OK(co_await t->WarmUp(p->server.get(), p->client.get()));
    CO_ASSERT_OK(
        co_await Deliver(p->server.get(), p->client.get(), 40000, 9));
    EXPECT_EQ(p->client->stats().landed_received, 1u);
    co_await Close(*p);
  }(this));
}

TEST_P(LandingTest, WindowGrantsKeepTheirBlocksRegistration) {
  if (!device_->caps().memory_windows) {
    GTEST_SKIP() << device_->caps().device_name
                 << " has no memory windows: each grant is a registration";
  }
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    const size_t all = ConnectionOptions().landing_buffers;
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get(), all));
    EXPECT_TRUE(ConnectionTestPeer::LandingWindows(*p->server));
    // A window grant's block keeps its registration (local write and
    // MW_BIND only) from message to message: the few blocks in use go
    // round with the lkeys they had. A registration per message (as
    // before) shows as a new lkey per grant.
    std::set<uint32_t> lkeys;
    for (uint32_t i = 1; i <= 200; ++i) {
      CO_ASSERT_OK(
          co_await Deliver(p->client.get(), p->server.get(), 8192 + i, i));
      for (uint32_t k : ConnectionTestPeer::GrantedLkeys(*p->server)) {
        lkeys.insert(k);
      }
    }
    EXPECT_EQ(p->server->stats().landed_received, 200u);
    EXPECT_LE(lkeys.size(), 2 * all) << "a registration per landed message";
    co_await Close(*p);
  }(this));
}

// Protocol 7: the part of a landed message past its last whole 4 KiB
// rides behind the kLanded header (when it fits the peer's receive buffer)
// and the WRITE carries the rest; every split arrives intact and in place.
TEST_P(LandingTest, LandedTailsAtEverySplitArriveIntact) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    const size_t all = ConnectionOptions().landing_buffers;
    const size_t most = ConnectionOptions().landing_buffer_size;
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get(), all));
    // Tails of 1, 4095, 0, 1, 32 (the first rpc-level landed size), 4095
    // and 0 bytes, up to the largest landed message.
    const size_t sizes[] = {8193,  12287,    12288,   12289,
                            8224,  most - 1, most};
    uint32_t seq = 1;
    for (size_t n : sizes) {
      CO_ASSERT_OK(co_await Deliver(p->client.get(), p->server.get(), n, seq));
      ++seq;
    }
    EXPECT_EQ(p->server->stats().landed_received, std::size(sizes));
    EXPECT_EQ(p->server->stats().rendezvous_received, 1u);
    co_await Close(*p);
  }(this));
}

// A kLanded header that carries all it announces (or more) leaves nothing
// for the WRITE: a violation that fails only that connection.
TEST_P(LandingTest, LandedHeaderCarryingTheWholeMessageFailsThatConnection) {
  Run([](LandingTest* t) -> Task<void> {
    auto bad = co_await t->MakePair();
    CO_ASSERT_OK(bad);
    auto good = co_await t->MakePair();
    CO_ASSERT_OK(good);
    std::vector<std::byte> raw = LandedHeader(64, 0);
    raw.resize(raw.size() + 64);
    CO_ASSERT_OK(co_await SendRaw(*bad->client, raw));
    co_await ExpectOnlyBadFails(*bad, *good, "malformed landed");
    co_await Close(*bad);
    co_await Close(*good);
  }(this));
}

// Sends `n` messages, all started at once, sizes cycling through `sizes`;
// the receiver checks that they arrive complete and in order.
Task<void> SendAllAtOnce(Reactor* r, Connection* from, Connection* to, int n,
                         std::vector<size_t> sizes, int* failures) {
  WaitGroup wg;
  for (int i = 0; i < n; ++i) {
    wg.Add();
    auto one = [](Connection* c, std::vector<std::byte> msg, WaitGroup* wg,
                  int* failures) -> Task<void> {
      absl::Status s = co_await c->Send(msg);
      if (!s.ok()) {
        ADD_FAILURE() << s;
        ++*failures;
      }
      wg->Done();
    };
    r->Spawn(one(from, LandingTest::Numbered(sizes[i % sizes.size()], i), &wg,
                 failures));
  }
  for (int i = 0; i < n; ++i) {
    auto m = co_await to->Recv();
    if (!m.ok()) {
      ADD_FAILURE() << "message " << i << ": " << m.status();
      break;
    }
    size_t want = sizes[i % sizes.size()];
    if (!LandingTest::IsNumbered(m->data(), want, i)) {
      uint32_t got = 0;
      if (m->data().size() >= 4) std::memcpy(&got, m->data().data(), 4);
      ADD_FAILURE() << "message " << i << " of " << want << " bytes: got "
                    << m->data().size() << " bytes numbered " << got;
      break;
    }
  }
  co_await wg.Wait();
}

TEST_P(LandingTest, MixedSizesKeepOrderAcrossEagerLandedAndRendezvous) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get()));
    int failures = 0;
    // Named: gcc 12 cannot take a braced list into a coroutine's argument.
    std::vector<size_t> sizes = {64, 8160, 8192, 20000, 65536, kAbove, 300000};
    co_await SendAllAtOnce(t->reactor_.get(), p->client.get(), p->server.get(),
                           300, sizes, &failures);
    EXPECT_EQ(failures, 0);
    Connection::Stats ss = p->server->stats();
    EXPECT_EQ(ss.messages_received, 301u);
    // Each kind was used: up to 8192 (rendezvous_threshold) eager, 20000
    // and 65536 landed when a grant was free (else by rendezvous), kAbove
    // and 300000 always by rendezvous (plus the warm-up's).
    uint64_t medium = 0, large = 0;
    for (int i = 0; i < 300; ++i) {
      medium += (i % 7 == 3 || i % 7 == 4);
      large += (i % 7 >= 5);
    }
    EXPECT_GT(ss.landed_received, 0u);
    EXPECT_GE(ss.rendezvous_received, 1 + large);
    EXPECT_EQ(ss.landed_received + ss.rendezvous_received, 1 + medium + large);
    co_await Close(*p);
  }(this));
}

TEST_P(LandingTest, RunningOutOfGrantsFallsBackToTheRendezvous) {
  Run([](LandingTest* t) -> Task<void> {
    // The receiver grants 2 buffers; 40 medium Sends start at once.
    ConnectOptions co;  // named: gcc 12 and a braced coroutine argument
    ListenerOptions lo;
    lo.connection.landing_buffers = 2;
    auto p = co_await t->MakePair(co, lo);
    CO_ASSERT_OK(p);
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get()));
    EXPECT_EQ(ConnectionTestPeer::Grants(*p->client).size(), 2u);
    int failures = 0;
    std::vector<size_t> medium = {30000};
    co_await SendAllAtOnce(t->reactor_.get(), p->client.get(), p->server.get(),
                           40, medium, &failures);
    EXPECT_EQ(failures, 0);
    Connection::Stats ss = p->server->stats();
    EXPECT_EQ(ss.messages_received, 41u);
    EXPECT_GE(ss.landed_received, 2u);
    EXPECT_GE(ss.rendezvous_received, 2u);  // the warm-up and fallbacks
    EXPECT_EQ(ss.landed_received + ss.rendezvous_received, 41u);
    // Without landing buffers every medium message takes the rendezvous.
    ListenerOptions off;
    off.connection.landing_buffers = 0;
    auto q = co_await t->MakePair(co, off);
    CO_ASSERT_OK(q);
    co_await SendAllAtOnce(t->reactor_.get(), q->client.get(), q->server.get(),
                           20, medium, &failures);
    EXPECT_EQ(failures, 0);
    EXPECT_EQ(q->server->stats().landed_received, 0u);
    EXPECT_EQ(q->server->stats().rendezvous_received, 20u);
    EXPECT_TRUE(ConnectionTestPeer::Grants(*q->client).empty());
    co_await Close(*p);
    co_await Close(*q);
  }(this));
}

TEST_P(LandingTest, LandedSendsBeyondTheWorkersStagingBuffersWaitForOne) {
  Run([](LandingTest* t) -> Task<void> {
    // Three connections of one client Worker, each holding all its grants,
    // send as many landed messages as they have grants, all at once: three
    // times the Worker's staging buffers (as many as one connection's
    // grants). The first connection's sends take them all; each later
    // connection's first send then waits, holding its send turn, for a
    // buffer that a completed WRITE gives back (checked: 3 such waits).
    // Every message lands, intact and in order.
    const size_t all = ConnectionOptions().landing_buffers;
    std::vector<Pair> pairs;
    for (int i = 0; i < 3; ++i) {
      auto p = co_await t->MakePair();
      CO_ASSERT_OK(p);
      CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get(), all));
      pairs.push_back(*std::move(p));
    }
    int failures = 0;
    std::vector<size_t> medium = {30000};
    WaitGroup wg;
    for (Pair& p : pairs) {
      wg.Add();
      auto one = [](Reactor* r, Connection* from, Connection* to,
                    std::vector<size_t> sizes, int n, int* failures,
                    WaitGroup* wg) -> Task<void> {
        co_await SendAllAtOnce(r, from, to, n, sizes, failures);
        wg->Done();
      };
      t->reactor_->Spawn(one(t->reactor_.get(), p.client.get(), p.server.get(),
                             medium, static_cast<int>(all), &failures, &wg));
    }
    co_await wg.Wait();
    EXPECT_EQ(failures, 0);
    for (Pair& p : pairs) {
      EXPECT_EQ(p.client->stats().landed_sent, all);
      EXPECT_EQ(p.server->stats().landed_received, all);
      EXPECT_EQ(p.server->stats().messages_received, all + 1);
      co_await Close(p);
    }
  }(this));
}

// As for an eager Send (cm_messaging_test): a landed Send cancelled once its
// WRITE and header are posted still completes, and the connection stays up.
TEST_P(LandingTest, CancellingAPostedLandedSendKeepsTheConnection) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get()));
    auto send = [](Connection* c, std::vector<std::byte> b, absl::Status* out,
                   Event* done) -> Task<void> {
      *out = co_await c->Send(b);
      done->Set();
    };
    // The connection's first landed message goes through SendBig (which
    // looks the staging buffers up): it runs first -- takes its turn,
    // credit and buffers and posts -- and the stop comes while it waits for
    // its completion (this failed the connection before PostBatch took
    // ignore_stop). The next one is posted by the SendAwaiter itself, which
    // waits for nothing before the post (as an eager Send): a stop
    // requested before it even ran does not keep it from going.
    for (uint32_t i = 1; i <= 2; ++i) {
      std::stop_source stop;
      absl::Status sent = absl::UnknownError("not run");
      Event done;
      if (i == 2) stop.request_stop();
      t->reactor_->Spawn(
          send(p->client.get(), Numbered(30000, i), &sent, &done),
          stop.get_token());
      co_await t->reactor_->Yield();
      stop.request_stop();
      CO_ASSERT_OK(co_await done.Wait());
      EXPECT_TRUE(sent.ok()) << i << ": " << sent;
      EXPECT_TRUE(p->client->status().ok()) << i << ": " << p->client->status();
      auto m = co_await p->server->Recv();
      CO_ASSERT_OK(m);
      EXPECT_TRUE(IsNumbered(m->data(), 30000, i)) << i;
    }
    EXPECT_EQ(p->client->stats().landed_sent, 2u);
    CO_ASSERT_OK(co_await Deliver(p->client.get(), p->server.get(), 30000, 3));
    co_await Close(*p);
  }(this));
}

// A rendezvous Send (above landing_buffer_size) cancelled at whatever step
// it has reached -- the RTS posted, waiting for the CTS, the WRITE and DONE
// posted -- ends with OK or Cancelled, and the connection stays up: a
// posted work request is never cancelled (that moved the QP to the error
// state), only the wait for the CTS is, which tells the receiver.
TEST_P(LandingTest, CancellingARendezvousSendAtAnyStepKeepsTheConnection) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    auto send = [](Connection* c, std::vector<std::byte> b, absl::Status* out,
                   Event* done) -> Task<void> {
      *out = co_await c->Send(b);
      done->Set();
    };
    uint32_t seq = 1;
    for (int yields = 0; yields <= 8; ++yields) {
      std::stop_source stop;
      absl::Status sent = absl::UnknownError("not run");
      Event done;
      t->reactor_->Spawn(
          send(p->client.get(), Numbered(kAbove, seq), &sent, &done),
          stop.get_token());
      for (int i = 0; i < yields; ++i) co_await t->reactor_->Yield();
      stop.request_stop();
      CO_ASSERT_OK(co_await done.Wait());
      EXPECT_TRUE(sent.ok() || absl::IsCancelled(sent)) << yields << ": "
                                                         << sent;
      EXPECT_TRUE(p->client->status().ok())
          << yields << ": " << p->client->status();
      if (sent.ok()) {
        auto m = co_await p->server->Recv();
        CO_ASSERT_OK(m);
        EXPECT_TRUE(IsNumbered(m->data(), kAbove, seq)) << yields;
      }
      ++seq;
      // The connection still carries messages both ways.
      CO_ASSERT_OK(co_await Deliver(p->client.get(), p->server.get(), 64, seq));
      CO_ASSERT_OK(co_await Deliver(p->server.get(), p->client.get(), 64, seq));
      ++seq;
    }
    co_await Close(*p);
  }(this));
}

TEST_P(LandingTest, AGrantsRkeyDiesWithItsMessage) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    auto other = co_await t->MakePair();
    CO_ASSERT_OK(other);
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get()));
    internal::GrantPayload g = ConnectionTestPeer::Grants(*p->client).front();
    auto m = co_await Deliver(p->client.get(), p->server.get(), 30000, 1);
    CO_ASSERT_OK(m);
    EXPECT_EQ(p->server->stats().landed_received, 1u);
    // A peer that keeps the rkey and writes again: refused by the
    // receiver's NIC (the registration ended), and the message it
    // delivered is untouched.
    std::vector<std::byte> late = Pattern(4096, 0x55);
    absl::Status w = co_await p->client->Write(std::span<const std::byte>(late),
                                               {g.addr, late.size(), g.rkey});
    if (w.ok()) {
      // iWARP completes a WRITE once it is handed to TCP (siw); the
      // receiver's TERMINATE for the dead rkey ends the connection after.
      EXPECT_TRUE(t->iwarp()) << "a WRITE with a dead rkey completed";
    } else {
      // On iWARP the receiver's TERMINATE can also arrive while the WRITE
      // is still being handed to TCP (a loaded host: seen on siw in the VM
      // at load 6): siw then ends the WQE as a local QP operation error.
      const bool aborted =
          t->iwarp() && absl::StrContains(w.message(), "IBV_WC_LOC_QP_OP_ERR");
      const char* want = aborted ? "IBV_WC_LOC_QP_OP_ERR" : "REM_ACCESS_ERR";
      EXPECT_TRUE(absl::StrContains(w.message(), want)) << w;
      // The WRITE's own completion fails the connection at once, with
      // its reason (not later, when a flushed receive reports it).
      EXPECT_FALSE(p->client->status().ok());
      EXPECT_TRUE(absl::StrContains(p->client->status().message(), want))
          << p->client->status();
    }
    // iWARP: the TERMINATE that ends the connection comes later; wait for
    // it, bounded.
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (p->client->status().ok() && absl::Now() < deadline) {
      co_await t->reactor_->Sleep(absl::Milliseconds(5));
    }
    EXPECT_TRUE(IsNumbered(m->data(), 30000, 1));
    // The writer's connection is down (RC: a remote access error ends it),
    // with a clear error for its next Send; the other connection works.
    EXPECT_FALSE(p->client->status().ok());
    auto msg = Numbered(30000, 1);
    absl::Status after = co_await p->client->Send(msg);
    EXPECT_FALSE(after.ok());
    CO_ASSERT_OK(
        co_await Deliver(other->client.get(), other->server.get(), 30000, 1));
    co_await Close(*p);
    co_await Close(*other);
  }(this));
}

TEST_P(LandingTest, LandedHeaderNamingNoGrantFailsOnlyThatConnection) {
  Run([](LandingTest* t) -> Task<void> {
    auto bad = co_await t->MakePair();
    CO_ASSERT_OK(bad);
    auto good = co_await t->MakePair();
    CO_ASSERT_OK(good);
    // A raw kLanded header on the QP, though nothing was granted.
    std::vector<std::byte> raw = LandedHeader(20000, 12345);
    CO_ASSERT_OK(co_await SendRaw(*bad->client, raw));
    co_await ExpectOnlyBadFails(*bad, *good, "landed message names");
    co_await Close(*bad);
    co_await Close(*good);
  }(this));
}

// A grant by memory window (rxe) ends only when the kLanded header
// invalidates it. A peer that sends the header as a plain SEND -- keeping
// the window open into memory about to be handed to the application -- is
// a protocol violation: that connection fails, the window dies with it, and
// the other connection is untouched.
TEST_P(LandingTest, LandedHeaderThatKeepsItsWindowOpenFailsOnlyThatConnection) {
  if (!device_->caps().memory_windows) {
    GTEST_SKIP() << device_->caps().device_name
                 << " has no memory windows: its grants are registrations, "
                    "which the receiver ends itself";
  }
  Run([](LandingTest* t) -> Task<void> {
    auto bad = co_await t->MakePair();
    CO_ASSERT_OK(bad);
    auto good = co_await t->MakePair();
    CO_ASSERT_OK(good);
    CO_ASSERT_OK(co_await t->WarmUp(bad->client.get(), bad->server.get()));
    CO_ASSERT_OK(co_await t->WarmUp(good->client.get(), good->server.get()));
    internal::GrantPayload g = ConnectionTestPeer::Grants(*bad->client).front();
    EXPECT_TRUE(g.size & internal::kGrantInvalidate);
    // The data into the window, then the header naming grant 0 -- without
    // SEND_WITH_INV.
    std::vector<std::byte> data = Pattern(20000, 0x21);
    CO_ASSERT_OK(co_await bad->client->Write(
        std::span<const std::byte>(data), {g.addr, data.size(), g.rkey}));
    std::vector<std::byte> raw = LandedHeader(20000, 0);
    CO_ASSERT_OK(co_await SendRaw(*bad->client, raw));
    co_await ExpectOnlyBadFails(*bad, *good,
                                "did not invalidate its grant's window");
    EXPECT_EQ(good->server->stats().landed_received, 1u);
    co_await Close(*bad);
    co_await Close(*good);
  }(this));
}

TEST_P(LandingTest, CloseWithLandedSendsInFlightEndsEveryone) {
  Run([](LandingTest* t) -> Task<void> {
    auto p = co_await t->MakePair();
    CO_ASSERT_OK(p);
    CO_ASSERT_OK(co_await t->WarmUp(p->client.get(), p->server.get()));
    WaitGroup wg;
    int done = 0;
    for (int i = 0; i < 50; ++i) {
      wg.Add();
      auto one = [](Connection* c, int i, WaitGroup* wg,
                    int* done) -> Task<void> {
        auto msg = LandingTest::Numbered(30000, i);
        co_await c->Send(msg);  // may succeed or fail: it must return
        ++*done;
        wg->Done();
      };
      t->reactor_->Spawn(one(p->client.get(), i, &wg, &done));
    }
    co_await t->reactor_->Yield();
    // The server closes while they are in flight; what it received arrived
    // in order and whole, and every Send returns.
    absl::Status cs = co_await p->server->Close();
    (void)cs;
    co_await wg.Wait();
    EXPECT_EQ(done, 50);
    for (uint32_t i = 0;; ++i) {
      auto m = co_await p->server->Recv();
      if (!m.ok()) break;
      EXPECT_TRUE(IsNumbered(m->data(), 30000, i)) << i;
    }
    co_await p->client->Close();
  }(this));
}

TEST_P(LandingTest, APeerWithSmallerReceiveBuffersGetsLargerMessagesByWrite) {
  Run([](LandingTest* t) -> Task<void> {
    // The server's receive buffers hold 2 KiB (a server saving memory per
    // connection); the client keeps the default 8 KiB eager limit, so what
    // does not fit the server's buffers must go by WRITE.
    ConnectOptions co;
    ListenerOptions lo;
    lo.connection.rendezvous_threshold = 2048;
    auto p = co_await t->MakePair(co, lo);
    CO_ASSERT_OK(p);
    // (The ring rounds its buffers up to 64 bytes: 2112.)
    const size_t eager =
        p->client->peer().handshake.recv_buffer_size - internal::kHeaderSize;
    EXPECT_GE(eager, 2048u);
    EXPECT_LT(eager, 2200u);
    int failures = 0;
    std::vector<size_t> sizes = {64, 2048, 2200, 8000, 8192, 30000};
    co_await SendAllAtOnce(t->reactor_.get(), p->client.get(), p->server.get(),
                           120, sizes, &failures);
    EXPECT_EQ(failures, 0);
    Connection::Stats ss = p->server->stats();
    EXPECT_EQ(ss.messages_received, 120u);
    // 2200 and up did not fit the server's buffers: by WRITE.
    EXPECT_EQ(ss.landed_received + ss.rendezvous_received, 4u * 120 / 6);
    EXPECT_GT(ss.landed_received, 0u);
    // And back: the server's own eager limit (2 KiB) fits the client.
    CO_ASSERT_OK(co_await Deliver(p->server.get(), p->client.get(), 2048, 5));
    EXPECT_EQ(p->client->stats().rendezvous_received, 0u);
    co_await Close(*p);
  }(this));
}

TEST_P(LandingTest,
       SrqServerAtTheSmallestWindowServesRendezvousOnEveryConnection) {
  Run(
      [](LandingTest* t) -> Task<void> {
        // Regression: a window of 1 credit deadlocked every rendezvous (its RTS
        // waits for the second credit its DONE needs; the window only grows
        // once a message was sent). 2 is now the minimum, 1 is refused.
        CO_ASSERT_OK(t->UseSrq(t->server_ctx_, 1024));
        ConnectOptions co;
        ListenerOptions one;
        one.connection.use_srq = true;
        one.connection.srq_initial_credits = 1;
        auto refused = co_await t->MakePair(co, one);
        EXPECT_FALSE(refused.ok());
        EXPECT_NE(std::string(refused.status().message())
                      .find("srq_initial_credits must be in [2"),
                  std::string::npos)
            << refused.status();
        ListenerOptions lo;
        lo.connection.use_srq = true;
        lo.connection.srq_initial_credits = 2;
        lo.connection.landing_buffers = 0;  // every large message: rendezvous
        co.connection.landing_buffers = 0;
        std::vector<CmTest::Pair> pairs;
        for (int i = 0; i < 4; ++i) {
          auto p = co_await t->MakePair(co, lo);
          CO_ASSERT_OK(p);
          pairs.push_back(*std::move(p));
        }
        std::vector<size_t> sizes = {20000, 64, 65536};
        std::vector<Task<void>> all;
        std::vector<int> failures(pairs.size(), 0);
        for (size_t i = 0; i < pairs.size(); ++i) {
          all.push_back(SendAllAtOnce(t->reactor_.get(), pairs[i].client.get(),
                                      pairs[i].server.get(), 48, sizes,
                                      &failures[i]));
        }
        co_await WhenAll(std::move(all));
        for (size_t i = 0; i < pairs.size(); ++i) {
          EXPECT_EQ(failures[i], 0);
          EXPECT_EQ(pairs[i].server->stats().rendezvous_received, 32u);
          co_await pairs[i].client->Close();
          co_await pairs[i].server->Close();
        }
      }(this),
      absl::Seconds(30));
}

// The memory connections used comes back when they close: their receive
// rings and landing blocks are mapped (cm/page_memory.h) and unmapped, and
// a Worker's block caches keep no more idle blocks than are in use, beyond
// one per size class. With a cache bounded only by
// rendezvous_cache_bytes (64 MiB), the 4 x 32 granted blocks of 128 KiB
// stayed mapped after the close (16 MiB); with malloc'd rings and blocks,
// the process kept them in its arenas (issue 25).
TEST_P(LandingTest, ClosedConnectionsGiveTheirMemoryBack) {
  Run([](LandingTest* t) -> Task<void> {
    const size_t before = internal::MappedPageBytes();
    const ConnectionOptions o;
    {
      std::vector<CmTest::Pair> pairs;
      for (int i = 0; i < 4; ++i) {
        auto p = co_await t->MakePair();
        CO_ASSERT_OK(p);
        pairs.push_back(*std::move(p));
        CO_ASSERT_OK(co_await t->WarmUp(pairs.back().client.get(),
                                        pairs.back().server.get(),
                                        o.landing_buffers));
        for (uint32_t i = 1; i <= 8; ++i) {
          CO_ASSERT_OK(co_await Deliver(pairs.back().client.get(),
                                        pairs.back().server.get(), 65536, i));
        }
      }
      // The grants and the rings are mapped while the connections live.
      EXPECT_GE(internal::MappedPageBytes() - before,
                4 * o.landing_buffers * o.landing_buffer_size);
      for (CmTest::Pair& p : pairs) {
        co_await p.client->Close();
        co_await p.server->Close();
      }
    }
    co_await Settle(t->reactor_.get());
    // What stays: at most one idle block per size class used (the warm-up's
    // rendezvous, the landing size) in each cache of each Worker.
    const size_t kept = internal::MappedPageBytes() - before;
    EXPECT_LE(kept, 2 * 2 * (o.landing_buffer_size + 32 * 1024)) << kept;
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, LandingTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
