// Addresses in cm::Connect and cm::Listener: IPv6 (listen on "::", connect
// to an IPv6 address, an IPv4 client of a dual-stack listener), host names
// resolved within the resolve timeout with every address tried in turn, and
// the errors for names that resolve to nothing.
//
// Soft provider: the host's loopback (::1, 127.0.0.1, "localhost").
// Verbs provider (rdma_cm; the VM harness, tests/vm): the RDMA netdev's
// addresses (COVERBS_VM_ADDR6_A, COVERBS_VM_ADDR_A) and the guest's name
// for both (COVERBS_VM_NAME_A); rdma_cm cannot reach the loopback
// addresses (LoopbackOnVerbs asserts how each device fails).
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "core/sync.h"
#include "gtest/gtest.h"
#include "tests/cm/cm_fixture.h"
#include "tests/co_assert.h"

namespace coverbs::cm {
namespace {

// The addresses a provider is tested on.
struct Addresses {
  std::string v6;    // an IPv6 address of this host the provider reaches
  std::string v4;    // an IPv4 address of this host the provider reaches
  std::string name;  // a host name for one or both of them
};

class NamesTest : public CmTest {
 public:
  void SetUp() override {
    CmTest::SetUp();
    if (GetParam() != "verbs") {
      addresses_ = {"::1", "127.0.0.1", "localhost"};
      return;
    }
    const char* v6 = std::getenv("COVERBS_VM_ADDR6_A");
    const char* v4 = std::getenv("COVERBS_VM_ADDR_A");
    const char* name = std::getenv("COVERBS_VM_NAME_A");
    if (v6 == nullptr || v4 == nullptr || name == nullptr) {
      GTEST_SKIP() << "verbs outside the VM harness: COVERBS_VM_ADDR6_A, "
                      "COVERBS_VM_ADDR_A and COVERBS_VM_NAME_A (addresses "
                      "on the RDMA device's netdev, and a name for them) "
                      "are not set; rdma_cm cannot use the loopback";
    }
    addresses_ = {v6, v4, name};
  }

  // Listens on `listen_at`, connects to `connect_to`, exchanges one message
  // each way; yields the server side's view of the peer's address.
  Task<absl::StatusOr<std::string>> RoundTrip(std::string listen_at,
                                              std::string connect_to) {
    ConnectOptions co;  // named: gcc 12 and braced temporaries in co_await
    ListenerOptions lo;
    auto p = co_await MakePairAt(std::move(listen_at), std::move(connect_to),
                                 std::move(co), std::move(lo));
    if (!p.ok()) co_return p.status();
    Connection* c = p->client.get();
    Connection* accepted = p->server.get();
    auto ping = Pattern(64, 3);
    absl::Status s = co_await c->Send(ping);
    if (!s.ok()) co_return s;
    auto m = co_await accepted->Recv();
    if (!m.ok()) co_return m.status();
    if (!Same(m->data(), ping)) co_return absl::DataLossError("ping differs");
    s = co_await accepted->Send(ping);
    if (!s.ok()) co_return s;
    auto r = co_await c->Recv();
    if (!r.ok()) co_return r.status();
    std::string peer = accepted->peer().address;
    co_await Close(*p);
    co_return peer;
  }

  Addresses addresses_;
};

// Soft: "::" and "::1". Verbs: "::" and the netdev's IPv6 address.
TEST_P(NamesTest, Ipv6ListenOnAny) {
  Run([](NamesTest* t, std::string v6) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", v6);
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, v6);
    // Listening on the address itself; brackets, as in URLs, are accepted
    // too.
    peer = co_await t->RoundTrip("[" + v6 + "]", "[" + v6 + "]");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, v6);
  }(this, addresses_.v6));
}

// siw (Linux 6.1) resets an IPv4 client's connection to a "::" listener
// before the listener sees a request (rping does the same): the client
// reads it as refused.
TEST_P(NamesTest, Ipv4ClientOfADualStackListener) {
  Run([](NamesTest* t, std::string v4) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", v4);
    if (t->GetParam() == "verbs" && t->iwarp()) {
      std::cerr << t->device_->name()
                << ", IPv4 client of \"::\": " << peer.status() << "\n";
      EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable)
          << peer.status();
      EXPECT_TRUE(
          absl::StrContains(peer.status().message(), "connection refused"))
          << peer.status();
      co_return;
    }
    CO_ASSERT_OK(peer);
    // A socket listening on :: (soft) sees an IPv4 peer as an IPv4-mapped
    // IPv6 address; rdma_cm, and the loop provider's connector, report the
    // IPv4 address as it is.
    EXPECT_EQ(*peer, t->GetParam() == "soft" ? "::ffff:" + v4 : v4);
  }(this, addresses_.v4));
}

// rdma_cm has no loopback device: a verbs client cannot reach ::1 or
// 127.0.0.1, even with the listener on "::" (whose own bind succeeds).
// The error names the step that failed, which differs by device (Linux
// 6.1): siw refuses to resolve the address, rxe resolves it to no device
// with a route. Soft covers ::1 in Ipv6ListenOnAny.
TEST_P(NamesTest, LoopbackOnVerbs) {
  if (GetParam() != "verbs") {
    GTEST_SKIP() << "about rdma_cm only: the soft provider reaches ::1 "
                    "(Ipv6ListenOnAny covers it)";
  }
  Run([](NamesTest* t) -> Task<void> {
    for (std::string lo : {"::1", "127.0.0.1"}) {
      auto peer = co_await t->RoundTrip("::", lo);
      std::cerr << t->device_->name() << ", " << lo << ": " << peer.status()
                << "\n";
      EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable)
          << lo << ": " << peer.status();
      EXPECT_TRUE(absl::StrContains(peer.status().message(), "loopback"))
          << peer.status();
      const char* step =
          t->iwarp() ? "address resolution failed" : "route resolution failed";
      EXPECT_TRUE(absl::StrContains(peer.status().message(), step))
          << t->device_->name() << ": " << peer.status();
    }
  }(this));
}

// The addresses getaddrinfo gives for `name` (numeric, in its order).
std::vector<std::string> AddressesOf(const char* name) {
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(name, nullptr, &hints, &res) != 0) return out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    char buf[INET6_ADDRSTRLEN];
    if (getnameinfo(ai->ai_addr, ai->ai_addrlen, buf, sizeof(buf), nullptr, 0,
                    NI_NUMERICHOST) == 0 &&
        std::find(out.begin(), out.end(), buf) == out.end()) {
      out.push_back(buf);
    }
  }
  freeaddrinfo(res);
  return out;
}

// A host name is resolved (off the reactor) and connected to.
TEST_P(NamesTest, HostName) {
  Run([](NamesTest* t, std::string name) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", name);
    CO_ASSERT_OK(peer);
    // A listener on a name binds its first address ("localhost":
    // 127.0.0.1).
    peer = co_await t->RoundTrip(name, name);
    CO_ASSERT_OK(peer);
    const std::vector<std::string> all = AddressesOf(name.c_str());
    CO_ASSERT_TRUE(!all.empty());
    EXPECT_EQ(*peer, name == "localhost" ? "127.0.0.1" : all.front());
  }(this, addresses_.name));
}

// A name with several addresses: they are tried in turn until one answers,
// so a listener on the last one is reached.
TEST_P(NamesTest, HostNameTriesEveryAddress) {
  const std::string name = addresses_.name;
  const std::vector<std::string> all = AddressesOf(name.c_str());
  if (all.size() < 2) {
    GTEST_SKIP() << "this host's resolver gives " << name << " " << all.size()
                 << " address(es) (/etc/hosts): nothing to try in turn";
  }
  Run([](NamesTest* t, std::string last, std::string name) -> Task<void> {
    auto peer = co_await t->RoundTrip(last, name);
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, last);
  }(this, all.back(), name));
}

TEST_P(NamesTest, NameThatResolvesToNothing) {
  Run([](NamesTest* t) -> Task<void> {
    // .invalid never resolves (RFC 6761); offline, the lookup fails too.
    ConnectOptions co;
    co.resolve_timeout = absl::Seconds(10);
    auto c =
        co_await Connect(*t->client_ctx_, "no-such-host.invalid", 7471, co);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
    EXPECT_TRUE(absl::StrContains(c.status().message(),
                                  "connect to no-such-host.invalid:7471"))
        << c.status();
    EXPECT_TRUE(
        absl::StrContains(c.status().message(), "address resolution failed"))
        << c.status();
    auto ln = Listener::Create(*t->server_ctx_, "no-such-host.invalid", 0);
    EXPECT_EQ(ln.status().code(), absl::StatusCode::kInvalidArgument)
        << ln.status();
    EXPECT_TRUE(
        absl::StrContains(ln.status().message(), "no-such-host.invalid"))
        << ln.status();
  }(this));
}

INSTANTIATE_TEST_SUITE_P(Providers, NamesTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
