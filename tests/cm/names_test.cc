// Addresses in cm::Connect and cm::Listener: IPv6 (listen on "::", connect
// to "::1", an IPv4 client of a dual-stack listener), host names resolved
// within the resolve timeout with every address tried in turn
// ("localhost"), and the errors for names that resolve to nothing. The
// soft provider on the host's loopback (rdma_cm cannot use the loopback
// device: the verbs path runs cm_test in the VM).
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
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

class NamesTest : public CmTest {
 public:
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
};

TEST_P(NamesTest, Ipv6ListenOnAnyConnectToLoopback) {
  Run([](NamesTest* t) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", "::1");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, "::1");
    // Brackets, as in URLs, are accepted too.
    peer = co_await t->RoundTrip("[::1]", "[::1]");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, "::1");
  }(this));
}

TEST_P(NamesTest, Ipv4ClientOfADualStackListener) {
  Run([](NamesTest* t) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", "127.0.0.1");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, "::ffff:127.0.0.1");
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
  Run([](NamesTest* t) -> Task<void> {
    auto peer = co_await t->RoundTrip("::", "localhost");
    CO_ASSERT_OK(peer);
    // "localhost" as a listening address is 127.0.0.1.
    peer = co_await t->RoundTrip("localhost", "localhost");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, "127.0.0.1");
  }(this));
}

// A name with several addresses: they are tried in turn until one answers,
// so a listener on the last one is reached.
TEST_P(NamesTest, HostNameTriesEveryAddress) {
  const std::vector<std::string> all = AddressesOf("localhost");
  if (all.size() < 2) {
    GTEST_SKIP() << "this host's resolver gives localhost " << all.size()
                 << " address(es) (/etc/hosts): nothing to try in turn";
  }
  Run([](NamesTest* t, std::string last) -> Task<void> {
    auto peer = co_await t->RoundTrip(last, "localhost");
    CO_ASSERT_OK(peer);
    EXPECT_EQ(*peer, last);
  }(this, all.back()));
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

INSTANTIATE_TEST_SUITE_P(Providers, NamesTest, ::testing::Values("soft"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
