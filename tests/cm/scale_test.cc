// Connection capacity: one server Worker accepts, and one client Worker
// opens, 1,000 connections on the soft provider (256 on verbs: tests/vm runs
// this on rxe and siw), more than one completion queue holds: the Worker
// adds CQs as connections fill them. Every connection carries a message;
// when they are gone every CQ entry is free again.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cm/connect.h"
#include "cm/listener.h"
#include "core/reactor.h"
#include "core/join.h"
#include "core/when.h"
#include "gtest/gtest.h"
#include "tests/cm/test_util.h"
#include "transport/device.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::cm {
namespace {

int ConnectionCount(const std::string& provider) {
  if (const char* n = std::getenv("COVERBS_SCALE_CONNECTIONS")) {
    return std::atoi(n);
  }
  return provider == "soft" ? 1000 : 256;
}

class ScaleTest : public ::testing::TestWithParam<std::string> {};

std::string Payload(int i) { return absl::StrCat("connection ", i); }

TEST_P(ScaleTest, ThousandConnectionsOnOneWorkerEachSide) {
  const int n = ConnectionCount(GetParam());
  auto r = Reactor::Create();
  ASSERT_TRUE(r.ok()) << r.status();
  std::unique_ptr<Reactor> reactor = *std::move(r);
  transport::ProviderOptions po;
  po.kind = *transport::ParseProviderKind(GetParam());
  auto d = transport::Device::Open(po);
  ASSERT_TRUE(d.ok()) << d.status();
  auto server_ctx = Worker::Create(*reactor, **d);
  ASSERT_TRUE(server_ctx.ok()) << server_ctx.status();
  auto client_ctx = Worker::Create(*reactor, **d);
  ASSERT_TRUE(client_ctx.ok()) << client_ctx.status();
  // Small rings keep the test's memory modest (both sides live in this
  // process); each connection still reserves 74 send + 14 receive CQ
  // entries, so ~28 fit in one 4096-entry CQ.
  ConnectionOptions co;
  co.recv_credits = 8;
  const std::string addr = TestAddress();

  reactor->BlockOn([&]() -> Task<void> {
    ListenerOptions lo;
    lo.connection = co;
    lo.accept_timeout = absl::Seconds(30);
    auto ln = Listener::Create(**server_ctx, addr, 0, lo);
    if (!ln.ok()) {
      ADD_FAILURE() << ln.status();
      co_return;
    }
    std::vector<std::unique_ptr<Connection>> served;
    auto serve = [](Listener* ln, int n,
                    std::vector<std::unique_ptr<Connection>>* out)
        -> Task<absl::Status> {
      while (static_cast<int>(out->size()) < n) {
        auto a = ln->Accept();
        auto c = co_await std::move(a);
        if (!c.ok()) co_return c.status();
        out->push_back(*std::move(c));
      }
      co_return absl::OkStatus();
    };
    auto connect_one = [](Worker* ctx, std::string addr, uint16_t port,
                          ConnectionOptions co, int i)
        -> Task<absl::StatusOr<std::unique_ptr<Connection>>> {
      ConnectOptions o;
      o.connection = co;
      o.connect_timeout = absl::Seconds(30);
      auto c = co_await Connect(*ctx, addr, port, o);
      if (!c.ok()) co_return c.status();
      std::string p = Payload(i);
      auto send = (*c)->Send(std::as_bytes(std::span(p)));
      absl::Status s = co_await std::move(send);
      if (!s.ok()) co_return s;
      co_return c;
    };
    auto accepting = Spawn(*reactor, serve(ln->get(), n, &served));
    std::vector<std::unique_ptr<Connection>> clients;
    // 32 connects in flight at a time.
    for (int base = 0; base < n; base += 32) {
      std::vector<Task<absl::StatusOr<std::unique_ptr<Connection>>>> batch;
      for (int i = base; i < std::min(n, base + 32); ++i) {
        batch.push_back(
            connect_one(client_ctx->get(), addr, (*ln)->port(), co, i));
      }
      auto all = WhenAll(std::move(batch));
      auto results = co_await std::move(all);
      for (auto& c : results) {
        if (!c.ok()) {
          ADD_FAILURE() << "connection " << clients.size() << ": "
                        << c.status();
          co_return;
        }
        clients.push_back(*std::move(c));
      }
    }
    auto join = accepting.Join();
    absl::Status accepted = co_await std::move(join);
    if (!accepted.ok()) {
      ADD_FAILURE() << "accepting: " << accepted;
      co_return;
    }
    EXPECT_EQ(static_cast<int>(served.size()), n);
    EXPECT_EQ((*ln)->stats().accepted, static_cast<uint64_t>(n));
    // Each server connection got its client's message.
    int got = 0;
    for (auto& c : served) {
      auto recv = c->Recv();
      auto m = co_await std::move(recv);
      if (!m.ok()) {
        ADD_FAILURE() << c->name() << ": " << m.status();
        continue;
      }
      std::string text(reinterpret_cast<const char*>(m->data().data()),
                       m->data().size());
      if (text.rfind("connection ", 0) == 0) ++got;
    }
    EXPECT_EQ(got, n);
    EXPECT_GT((*server_ctx)->cq_count(), 1);
    EXPECT_GT((*client_ctx)->cq_count(), 1);
    std::printf("%d connections: %d CQs on the server, %d on the client\n", n,
                (*server_ctx)->cq_count(), (*client_ctx)->cq_count());
    for (auto& c : clients) {
      auto close = c->Close();
      co_await std::move(close);
    }
    clients.clear();
    served.clear();
    (*ln)->Close();
    auto settle = reactor->Sleep(absl::Milliseconds(100));
    co_await settle;
  }());
  // Every reservation was given back.
  EXPECT_EQ((*server_ctx)->cq().reserved(), 0);
  EXPECT_EQ((*client_ctx)->cq().reserved(), 0);
  client_ctx->reset();
  server_ctx->reset();
  reactor->BlockOn([&]() -> Task<void> {
    auto settle = reactor->Sleep(absl::Milliseconds(50));
    co_await settle;
  }());
}

INSTANTIATE_TEST_SUITE_P(Providers, ScaleTest,
                         ::testing::ValuesIn(InProcessProviders()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::cm
