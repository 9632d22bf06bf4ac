// RPC over the loop provider (transport/loop): the whole stack -- rpc, cm,
// the loop connector and QPs -- with the server's connections on the two
// threads of a ReactorPool and the client on the test thread, so that
// every message crosses threads inside the provider. rpc_test runs the full
// suite on soft (and verbs); this is the smoke test that loop carries the
// same traffic, refuses a port nobody listens on, and tells a client that
// its server went away.
#include "tests/rpc/rpc_fixture.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers

using LoopEchoTest = RpcTest;

TEST_P(LoopEchoTest, EchoAcrossSizesIncludingRendezvous) {
  StartServer();
  EXPECT_EQ(device_->caps().provider, "loop");
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    const size_t th = Threshold();
    for (size_t n : {size_t{0}, size_t{1}, size_t{64}, th - 1, th, th + 1,
                     size_t{1} << 20}) {
      auto req = Pattern(n, static_cast<uint32_t>(n));
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req)) << n << " bytes";
    }
    EXPECT_GE((*c)->connection().stats().rendezvous_sent, 1u);
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

// 4,000 64-byte calls, 16 in flight: credits, receive reposting and the
// cross-thread completion path under load.
TEST_P(LoopEchoTest, PipelinedSmallCalls) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    constexpr int kDepth = 16, kCalls = 4000;
    int next = 0, ok = 0;
    WaitGroup wg;
    wg.Add(kDepth);
    auto worker = [](Client* client, int* next, int* ok,
                     WaitGroup* wg) -> Task<void> {
      while (*next < kCalls) {
        const int i = (*next)++;
        auto req = Pattern(64, i);
        auto r = co_await client->Call("Echo", req);
        if (r.ok() && Same(r->data(), req)) {
          ++*ok;
        } else {
          ADD_FAILURE() << "call " << i << ": " << r.status();
        }
      }
      wg->Done();
    };
    for (int k = 0; k < kDepth; ++k) {
      Reactor::Current()->Spawn(worker(*c, &next, &ok, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, kCalls);
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

TEST_P(LoopEchoTest, PortWithoutListenerIsRefused) {
  Run([](RpcTest* t) -> Task<void> {
    // No server started: nobody listens on any loop port of this test.
    auto c = co_await Client::Connect(*t->client_ctx_, t->addr_, 61999);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
    EXPECT_NE(c.status().message().find("connection refused"),
              std::string::npos)
        << c.status();
  }(this));
}

// The server shuts down under a connected client: the loop link's OnDown
// (or the flushed QP) ends the client's connection, and a call fails
// instead of waiting.
TEST_P(LoopEchoTest, ServerShutdownFailsTheClientsCalls) {
  StartServer();
  Client* client = nullptr;
  Run([](RpcTest* t, Client** out) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    auto r = co_await (*c)->Call("Echo", Pattern(64, 1));
    CO_ASSERT_OK(r);
    *out = *c;
  }(this, &client));
  ASSERT_NE(client, nullptr);
  server_->Shutdown();
  Run([](Client* c) -> Task<void> {
    CallOptions o;
    o.deadline = absl::Now() + absl::Seconds(10);
    auto r = co_await c->Call("Echo", Pattern(64, 2), o);
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.status().code(), absl::StatusCode::kDeadlineExceeded)
        << "the client never learned that the server went: " << r.status();
  }(client));
}

INSTANTIATE_TEST_SUITE_P(Loop, LoopEchoTest, ::testing::Values("loop"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
