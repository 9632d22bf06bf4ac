// RPC deadlines, cancellation (cancel frames, stop tokens) and what they
// leave behind, on every available provider. Part of rpc_test (same binary,
// same fixture: rpc_fixture.h; the suite is instantiated in rpc_test.cc).
#include "tests/rpc/rpc_fixture.h"

namespace coverbs::rpc {
namespace {

using namespace rpc_test_util;  // NOLINT: the fixture and its helpers

TEST_P(RpcTest, DeadlineExpiryCancelsTheSlowHandler) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    CallOptions o;
    o.deadline = absl::Now() + absl::Milliseconds(200);
    auto r = co_await (*c)->Call("Slow", {}, o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
        << r.status();
    EXPECT_EQ((*c)->in_flight(), 0u);
    // The cancel frame reached the server and stopped the handler.
    Observed* obs = &t->obs_;
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
    EXPECT_EQ(obs->slow_started, 1);
    EXPECT_EQ((*c)->stats().cancels_sent, 1u);
    Server* s = t->server_.get();
    EXPECT_TRUE(
        co_await Eventually([s] { return s->stats().cancelled_calls == 1; }));
    // The connection is still good.
    auto e = co_await (*c)->Call("Echo", Pattern(100, 3));
    CO_ASSERT_OK(e);
  }(this));
}

// The server runs each call at once inside its receive loop until the
// handler first waits: a handler that waits must not hold up the
// connection's next requests.
TEST_P(RpcTest, AWaitingHandlerDoesNotHoldUpTheConnection) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    std::stop_source cancel;
    absl::StatusOr<Response> slow = absl::UnknownError("pending");
    Event done;
    CallOptions o;
    o.cancel = cancel.get_token();
    SpawnCall((*c)->Call("Slow", {}, o), &slow, &done);
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    // Calls behind the waiting one are served meanwhile.
    for (int i = 0; i < 20; ++i) {
      auto e = co_await (*c)->Call("Echo", Pattern(64, i));
      CO_ASSERT_OK(e);
      EXPECT_TRUE(Same(e->data(), Pattern(64, i))) << i;
    }
    EXPECT_FALSE(done.is_set());
    cancel.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(slow.status().code(), absl::StatusCode::kCancelled)
        << slow.status();
  }(this));
}

// Calls waiting under one ambient token share the client's stop watch:
// stopping that token (from another thread) cancels every one of them and
// none of the calls under a second token, which then stop on their own.
TEST_P(RpcTest, StoppingASharedTokenCancelsEveryCallUnderIt) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    constexpr int kEach = 4;
    std::stop_source first, second;
    std::vector<absl::Status> got(2 * kEach, absl::UnknownError("pending"));
    WaitGroup wg;
    for (int i = 0; i < 2 * kEach; ++i) {
      wg.Add();
      Reactor::Current()->Spawn(
          [](Client* c, absl::Status* out, WaitGroup* wg) -> Task<void> {
            auto r = co_await c->Call("Slow", {});
            *out = r.status();
            wg->Done();
          }(*c, &got[i], &wg),
          i < kEach ? first.get_token() : second.get_token());
    }
    Observed* obs = &t->obs_;
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_started == 2 * kEach; }));
    std::thread([&first] { first.request_stop(); }).join();
    EXPECT_TRUE(co_await Eventually([&got] {
      for (int i = 0; i < kEach; ++i) {
        if (got[i].code() != absl::StatusCode::kCancelled) return false;
      }
      return true;
    }));
    for (int i = kEach; i < 2 * kEach; ++i) {
      EXPECT_EQ(got[i].code(), absl::StatusCode::kUnknown) << got[i];
    }
    second.request_stop();
    co_await wg.Wait();
    for (const absl::Status& s : got) {
      EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    }
    EXPECT_EQ((*c)->in_flight(), 0u);
  }(this));
}

TEST_P(RpcTest, CancellationStopsTheCall) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    std::stop_source cancel;
    absl::StatusOr<Response> result = absl::UnknownError("pending");
    Event done;
    CallOptions o;
    o.cancel = cancel.get_token();
    SpawnCall((*c)->Call("Slow", {}, o), &result, &done);
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    cancel.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled)
        << result.status();
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
    // A stop on the caller's own (ambient) token works the same way.
    Task<absl::StatusOr<Response>> call = (*c)->Call("Slow", {});
    std::stop_source ambient;
    call.SetStopToken(ambient.get_token());
    SpawnCall(std::move(call), &result, &done);
    done.Reset();
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 2; }));
    ambient.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 2; }));
    // Both able to stop (the call joins them in a stop source of its own):
    // the explicit token still cancels while the ambient one stays quiet.
    std::stop_source cancel2;
    CallOptions o2;
    o2.cancel = cancel2.get_token();
    Task<absl::StatusOr<Response>> call2 = (*c)->Call("Slow", {}, o2);
    std::stop_source ambient2;
    call2.SetStopToken(ambient2.get_token());
    SpawnCall(std::move(call2), &result, &done);
    done.Reset();
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 3; }));
    cancel2.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 3; }));
    EXPECT_FALSE(ambient2.stop_requested());
  }(this));
}

// A client cancels 300 calls its server is running at once: every one
// ends Cancelled on both sides and the connection stays usable.
TEST_P(RpcTest, ManyRunningCallsCancelledAtOnceLeaveTheConnectionUp) {
  ServerOptions so;
  so.max_concurrent_calls = 1024;
  StartServer(std::move(so));
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    constexpr int kCalls = 300;
    std::stop_source stop;
    int cancelled = 0, other = 0;
    std::string first_other;
    WaitGroup wg;
    wg.Add(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, int* cancelled, int* other, std::string* first,
             WaitGroup* wg) -> Task<void> {
            auto r = co_await c->Call("Slow", {});
            if (r.status().code() == absl::StatusCode::kCancelled) {
              ++*cancelled;
            } else {
              if (*other == 0) *first = r.status().ToString();
              ++*other;
            }
            wg->Done();
          }(client, &cancelled, &other, &first_other, &wg),
          stop.get_token());
    }
    Observed* obs = &t->obs_;
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_started == kCalls; }));
    stop.request_stop();
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(cancelled, kCalls) << other << " others, first: " << first_other;
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == kCalls; }));
    auto req = Pattern(64, 5);
    auto r = co_await client->Call("Echo", req);
    CO_ASSERT_OK(r);
    EXPECT_TRUE(Same(r->data(), req));
  }(this));
}

// A test (or an application) that ends right after cancelling a call:
// Close() waits for the cancel frame's send, so the Worker can go next.
// (Before, the detached send outlived the CQ and crashed at teardown.)
TEST_P(RpcTest, CloseRightAfterACancelWaitsForTheCancelFrame) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    std::stop_source stop;
    absl::StatusOr<Response> slow = absl::UnknownError("pending");
    Event done;
    SpawnCall(client->Call("Slow", {}), &slow, &done, stop.get_token());
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    stop.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(slow.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(client->stats().cancels_sent, 1u);
    CO_ASSERT_OK(co_await client->Close());
  }(this));
}

}  // namespace
}  // namespace coverbs::rpc
