// RPC end to end on every available provider: a Server on a 2-thread
// ReactorPool (accepted connections spread over both reactors) and Clients
// on the test thread's reactor. On the host it runs on the soft provider
// over 127.0.0.1; tests/vm runs it with COVERBS_PROVIDER=verbs on Soft-RoCE
// and SoftiWARP.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "gtest/gtest.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "rpc/wire.h"
#include "tests/cm/test_util.h"
#include "tests/co_assert.h"
#include "tests/repeat.h"
#include "transport/device.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::rpc {
namespace {

using transport::Device;

using cm::Providers;
using cm::TestAddress;

std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::byte>(seed * 31 + i * 13 + (i >> 8));
  }
  return v;
}

bool Same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// What the handlers observed, shared with the test thread.
struct Observed {
  std::atomic<int> slow_started{0};
  std::atomic<int> slow_cancelled{0};
  std::atomic<int> gate_running{0};
  std::atomic<int> gate_max{0};
};

class RpcTest : public ::testing::TestWithParam<std::string> {
 public:
  void SetUp() override {
    transport::ProviderOptions o;
    o.kind = *transport::ParseProviderKind(GetParam());
    if (const char* dev = std::getenv("COVERBS_VM_DEV");
        dev && o.kind == transport::ProviderKind::kVerbs) {
      o.device = dev;
    }
    auto d = Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    addr_ = TestAddress();
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    auto cc = cm::Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(cc.ok()) << cc.status();
    client_ctx_ = *std::move(cc);
    auto pool = ReactorPool::Create(2);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    for (size_t i = 0; i < pool_->size(); ++i) {
      std::promise<absl::StatusOr<std::unique_ptr<cm::Worker>>> p;
      auto f = p.get_future();
      pool_->Post(i, [&, i]() {
        // The SRQ is created only for connections that ask for it.
        cm::WorkerOptions co;
        co.srq_depth = 1024;
        p.set_value(cm::Worker::Create(pool_->reactor(i), *device_, co));
      });
      auto ctx = f.get();
      ASSERT_TRUE(ctx.ok()) << ctx.status();
      server_ctxs_.push_back(*std::move(ctx));
    }
  }

  void TearDown() override {
    // As an application should: Close() before the Worker goes (a
    // cancelled call's cancel frame may still be on its way).
    if (reactor_) {
      reactor_->BlockOn([](std::vector<std::unique_ptr<Client>>* cs)
                            -> Task<void> {
        for (auto& c : *cs) (void)co_await c->Close();
      }(&clients_));
    }
    clients_.clear();
    if (reactor_) reactor_->BlockOn(Settle(reactor_.get()));
    if (server_) server_->Shutdown();
    server_.reset();
    for (size_t i = 0; i < server_ctxs_.size(); ++i) {
      std::promise<void> p;
      auto f = p.get_future();
      pool_->Post(i, [&, i]() {
        server_ctxs_[i].reset();
        p.set_value();
      });
      f.get();
    }
    if (pool_) pool_->Stop();
    pool_.reset();
    client_ctx_.reset();
    if (reactor_) reactor_->BlockOn(Settle(reactor_.get()));
    reactor_.reset();
    device_.reset();
  }
  static Task<void> Settle(Reactor* r) {
    for (int i = 0; i < 20; ++i) co_await r->Yield();
  }

  void StartServer(ServerOptions o = {}) {
    server_ = std::make_unique<Server>(std::move(o));
    Observed* obs = &obs_;
    ASSERT_TRUE(server_
                    ->Register("Echo",
                               [](Request r) -> Task<absl::StatusOr<Payload>> {
                                 co_return std::move(r.payload);
                               })
                    .ok());
    ASSERT_TRUE(server_
                    ->Register("Fail",
                               [](Request r) -> Task<absl::StatusOr<Payload>> {
                                 co_return absl::FailedPreconditionError(
                                     absl::StrCat("refused: ", r.payload.ToString()));
                               })
                    .ok());
    // Sleeps up to 60 s, honouring cancellation.
    ASSERT_TRUE(server_
                    ->Register("Slow",
                               [obs](Request) -> Task<absl::StatusOr<Payload>> {
                                 obs->slow_started.fetch_add(1);
                                 absl::Status s = co_await Reactor::Current()->Sleep(
                                     absl::Seconds(60));
                                 if (!s.ok()) {
                                   obs->slow_cancelled.fetch_add(1);
                                   co_return s;
                                 }
                                 co_return Payload::Copy("slow");
                               })
                    .ok());
    // Holds each call for 5 ms, recording how many run at once.
    ASSERT_TRUE(server_
                    ->Register("Gate",
                               [obs](Request r) -> Task<absl::StatusOr<Payload>> {
                                 int now = obs->gate_running.fetch_add(1) + 1;
                                 int prev = obs->gate_max.load();
                                 while (now > prev &&
                                        !obs->gate_max.compare_exchange_weak(prev, now)) {
                                 }
                                 (void)co_await Reactor::Current()->Sleep(
                                     absl::Milliseconds(5));
                                 obs->gate_running.fetch_sub(1);
                                 co_return std::move(r.payload);
                               })
                    .ok());
    std::vector<cm::Worker*> ctxs;
    for (auto& c : server_ctxs_) ctxs.push_back(c.get());
    absl::Status s = server_->Start(ctxs, addr_, 0);
    ASSERT_TRUE(s.ok()) << s;
  }

  Task<absl::StatusOr<Client*>> NewClient() {
    auto c = co_await Client::Connect(*client_ctx_, addr_, server_->port());
    if (!c.ok()) co_return c.status();
    clients_.push_back(*std::move(c));
    co_return clients_.back().get();
  }

  void Run(Task<void> t, absl::Duration limit = absl::Seconds(120)) {
    auto wrap = [](Task<void> t) -> Task<absl::Status> {
      co_await std::move(t);
      co_return absl::OkStatus();
    };
    absl::Status s = reactor_->BlockOn(WithTimeout(wrap(std::move(t)), limit));
    EXPECT_TRUE(s.ok()) << "test body: " << s;
  }

  // Eager payload limit: the connection's threshold minus the frame header.
  static size_t Threshold() {
    return cm::ConnectionOptions{}.rendezvous_threshold - kHeaderSize;
  }

  Observed obs_;
  std::unique_ptr<Device> device_;
  std::string addr_;
  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<cm::Worker> client_ctx_;
  std::unique_ptr<ReactorPool> pool_;
  std::vector<std::unique_ptr<cm::Worker>> server_ctxs_;
  std::unique_ptr<Server> server_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_P(RpcTest, EchoAcrossSizes) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    size_t th = Threshold();
    for (size_t n : {size_t{0}, size_t{1}, th - 1, th, th + 1, size_t{1} << 20,
                     size_t{16} << 20}) {
      auto req = Pattern(n, static_cast<uint32_t>(n));
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req)) << n << " bytes";
      // Large responses are handed over without a copy (at the threshold
      // the client copies conservatively: it compares with its receive
      // buffer size, which includes the connection's own header).
      if (n <= th) {
        EXPECT_FALSE(r->zero_copy()) << n << " bytes";
      }
      if (n >= (size_t{1} << 20)) {
        EXPECT_TRUE(r->zero_copy()) << n << " bytes";
      }
    }
    EXPECT_GE((*c)->connection().stats().rendezvous_sent, 3u);
    EXPECT_GE((*c)->connection().stats().rendezvous_received, 3u);
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
}

// Small requests reach the handler in their receive buffer while few are
// held: one at a time, none is copied. (A lease whose count was given back
// twice once made every request after the first a copy.)
TEST_P(RpcTest, SequentialSmallRequestsAreNotCopied) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    auto req = Pattern(64, 7);
    for (int i = 0; i < 100; ++i) {
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req));
    }
    CO_ASSERT_OK(co_await (*c)->Close());
  }(this));
  Server::Stats st = server_->stats();
  EXPECT_GE(st.calls, 100u);
  EXPECT_EQ(st.copied_requests, 0u);
}

// 10,000 echo calls (COVERBS_TEST_REPEAT_PERCENT scales them, down to 1,024:
// each of the 256 slots refilled 4 times) from 256 coroutines sharing one
// connection; every `large_every`-th request (0: none) goes by rendezvous.
// `server_credits`: the initial grant the server must announce (0: any).
void PipelinedEcho(RpcTest* t, int large_every, uint32_t server_credits = 0);

TEST_P(RpcTest, TenThousandPipelinedCallsWith256InFlight) {
  StartServer();
  PipelinedEcho(this, 0);
}

// Rendezvous in both directions while every receive buffer is taken by
// messages queued behind a rendezvous: this deadlocked while CTS needed a
// credit (cm protocol 1); CTS now lands in reserved receives.
TEST_P(RpcTest, PipelinedCallsWithLargePayloads) {
  StartServer();
  PipelinedEcho(this, 97);
}

// The same through a server whose connections receive from their
// Worker's shared receive queue: credit windows start at 2 and grow, and
// requests above its 2 KiB buffers come by WRITE.
TEST_P(RpcTest, PipelinedCallsThroughAnSrqServer) {
  ServerOptions o;
  o.listener.connection.use_srq = true;
  o.listener.connection.qp.rnr_retry = 0;  // any RNR fails the connection
  StartServer(std::move(o));
  PipelinedEcho(this, 97, 2);
}

void PipelinedEcho(RpcTest* test, int large_every, uint32_t server_credits) {
  test->Run([](RpcTest* t, int large_every,
               uint32_t server_credits) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    if (server_credits != 0) {
      EXPECT_EQ(client->connection().peer().handshake.credits, server_credits);
    }
    const int kDepth = 256;
    const int calls = coverbs::testing::Repeat(10000, 4 * kDepth);
    int next = 0, ok = 0, max_in_flight = 0;
    WaitGroup wg;
    wg.Add(kDepth);
    auto worker = [](Client* client, int large_every, int calls, int* next,
                     int* ok, int* max_in_flight, WaitGroup* wg) -> Task<void> {
      while (*next < calls) {
        int i = (*next)++;
        // Mostly small, some above the threshold.
        size_t n = large_every > 0 && i % large_every == 0
                       ? RpcTest::Threshold() + 100 + i
                       : 16 + i % 200;
        auto req = Pattern(n, i);
        *max_in_flight = std::max<int>(*max_in_flight, client->in_flight() + 1);
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
      Reactor::Current()->Spawn(
          worker(client, large_every, calls, &next, &ok, &max_in_flight, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, calls);
    EXPECT_EQ(max_in_flight, kDepth);
    CO_ASSERT_OK(co_await client->Close());
  }(test, large_every, server_credits));
}

TEST_P(RpcTest, UnknownMethodIsNotFound) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    auto req = Pattern(10, 1);
    auto r = co_await (*c)->Call("NoSuchMethod", req);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
    // The connection stays usable.
    auto e = co_await (*c)->Call("Echo", req);
    CO_ASSERT_OK(e);
    EXPECT_EQ(t->server_->stats().unknown_method, 1u);
  }(this));
}

TEST_P(RpcTest, HandlerErrorTravelsBackWithCodeAndMessage) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    std::string why = "no thanks";
    auto r = co_await (*c)->Call("Fail", std::as_bytes(std::span(why)));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(r.status().message(), "refused: no thanks");
  }(this));
}

// Waits (bounded) until `pred` holds.
template <typename F>
Task<bool> Eventually(F pred) {
  for (int i = 0; i < 2000; ++i) {
    if (pred()) co_return true;
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(5));
  }
  co_return pred();
}

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
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
    EXPECT_EQ(obs->slow_started, 1);
    EXPECT_EQ((*c)->stats().cancels_sent, 1u);
    Server* s = t->server_.get();
    EXPECT_TRUE(co_await Eventually(
        [s] { return s->stats().cancelled_calls == 1; }));
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
    Reactor::Current()->Spawn([](Client* c, CallOptions o,
                                 absl::StatusOr<Response>* out,
                                 Event* done) -> Task<void> {
      *out = co_await c->Call("Slow", {}, o);
      done->Set();
    }(*c, o, &slow, &done));
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
    Reactor::Current()->Spawn([](Client* c, CallOptions o,
                                 absl::StatusOr<Response>* out,
                                 Event* done) -> Task<void> {
      *out = co_await c->Call("Slow", {}, o);
      done->Set();
    }(*c, o, &result, &done));
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    cancel.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled)
        << result.status();
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
    // A stop on the caller's own (ambient) token works the same way.
    Task<absl::StatusOr<Response>> call = (*c)->Call("Slow", {});
    std::stop_source ambient;
    call.SetStopToken(ambient.get_token());
    Reactor::Current()->Spawn([](Task<absl::StatusOr<Response>> call,
                                 absl::StatusOr<Response>* out,
                                 Event* done) -> Task<void> {
      *out = co_await std::move(call);
      done->Set();
    }(std::move(call), &result, &done));
    done.Reset();
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 2; }));
    ambient.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled);
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_cancelled == 2; }));
    // Both able to stop (the call joins them in a stop source of its own):
    // the explicit token still cancels while the ambient one stays quiet.
    std::stop_source cancel2;
    CallOptions o2;
    o2.cancel = cancel2.get_token();
    Task<absl::StatusOr<Response>> call2 = (*c)->Call("Slow", {}, o2);
    std::stop_source ambient2;
    call2.SetStopToken(ambient2.get_token());
    Reactor::Current()->Spawn([](Task<absl::StatusOr<Response>> call,
                                 absl::StatusOr<Response>* out,
                                 Event* done) -> Task<void> {
      *out = co_await std::move(call);
      done->Set();
    }(std::move(call2), &result, &done));
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

// Handlers holding more than half of the server's receive buffers: the
// requests beyond that are copied; once those handlers ended (their leases
// came back, on whatever count the server keeps), requests are views again.
TEST_P(RpcTest, RequestsBeyondHalfTheReceiveBuffersAreCopied) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    const int half =
        static_cast<int>((*c)->connection().peer().handshake.credits / 2);
    const int n = half + 4;
    std::stop_source stop;
    WaitGroup wg;
    wg.Add(n);
    for (int i = 0; i < n; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, WaitGroup* wg) -> Task<void> {
            auto req = Pattern(64, 1);
            (void)co_await c->Call("Slow", req);
            wg->Done();
          }(*c, &wg),
          stop.get_token());
    }
    Observed* obs = &t->obs_;
    EXPECT_TRUE(
        co_await Eventually([obs, n] { return obs->slow_started == n; }));
    Server* server = t->server_.get();
    EXPECT_GE(server->stats().copied_requests, 4u);
    stop.request_stop();
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_TRUE(
        co_await Eventually([obs, n] { return obs->slow_cancelled == n; }));
    const uint64_t copied = server->stats().copied_requests;
    auto req = Pattern(64, 2);
    for (int i = 0; i < 10; ++i) {
      auto r = co_await (*c)->Call("Echo", req);
      CO_ASSERT_OK(r);
    }
    EXPECT_EQ(server->stats().copied_requests, copied);
  }(this));
}

// The client keeps pending calls in a 256-slot ring by call id and the
// ids that find their slot taken in a map: 600 calls in flight at once, and
// a slow call lapped by 300 later ones (whose ids then collide with its
// slot), go through both.
TEST_P(RpcTest, MoreCallsInFlightThanThePendingRing) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    Client* client = *c;
    int ok = 0;
    WaitGroup wg;
    constexpr int kEcho = 600;
    wg.Add(kEcho);
    for (int i = 0; i < kEcho; ++i) {
      Reactor::Current()->Spawn(
          [](Client* c, int i, int* ok, WaitGroup* wg) -> Task<void> {
            auto req = Pattern(64, i);
            auto r = co_await c->Call("Echo", req);
            if (r.ok() && Same(r->data(), req)) ++*ok;
            wg->Done();
          }(client, i, &ok, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, kEcho);
    EXPECT_EQ(client->in_flight(), 0u);

    std::stop_source stop;
    absl::StatusOr<Response> slow = absl::UnknownError("pending");
    Event slow_done;
    Reactor::Current()->Spawn(
        [](Client* c, absl::StatusOr<Response>* out,
           Event* done) -> Task<void> {
          *out = co_await c->Call("Slow", {});
          done->Set();
        }(client, &slow, &slow_done),
        stop.get_token());
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    for (int i = 0; i < 300; ++i) {
      auto req = Pattern(64, i);
      auto r = co_await client->Call("Echo", req);
      CO_ASSERT_OK(r);
      EXPECT_TRUE(Same(r->data(), req)) << i;
      EXPECT_EQ(client->in_flight(), 1u);
    }
    stop.request_stop();
    CO_ASSERT_OK(co_await slow_done.Wait());
    EXPECT_EQ(slow.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(client->in_flight(), 0u);
    // The cancel frame reached the server (and its send is over before the
    // fixture tears the reactors down).
    EXPECT_TRUE(
        co_await Eventually([obs] { return obs->slow_cancelled == 1; }));
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
    EXPECT_TRUE(co_await Eventually(
        [obs] { return obs->slow_cancelled == kCalls; }));
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
    Reactor::Current()->Spawn(
        [](Client* c, absl::StatusOr<Response>* out, Event* done) -> Task<void> {
          *out = co_await c->Call("Slow", {});
          done->Set();
        }(client, &slow, &done),
        stop.get_token());
    Observed* obs = &t->obs_;
    EXPECT_TRUE(co_await Eventually([obs] { return obs->slow_started == 1; }));
    stop.request_stop();
    CO_ASSERT_OK(co_await done.Wait());
    EXPECT_EQ(slow.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(client->stats().cancels_sent, 1u);
    CO_ASSERT_OK(co_await client->Close());
  }(this));
}

TEST_P(RpcTest, PerConnectionLimitIsBackPressureNotFailure) {
  ServerOptions so;
  so.max_concurrent_calls = 2;
  so.max_queued_calls = 3;
  StartServer(std::move(so));
  Run([](RpcTest* t) -> Task<void> {
    auto c = co_await t->NewClient();
    CO_ASSERT_OK(c);
    constexpr int kCalls = 40;
    int ok = 0;
    WaitGroup wg;
    wg.Add(kCalls);
    for (int i = 0; i < kCalls; ++i) {
      Reactor::Current()->Spawn([](Client* c, int i, int* ok,
                                   WaitGroup* wg) -> Task<void> {
        auto req = Pattern(64, i);
        auto r = co_await c->Call("Gate", req);
        if (r.ok() && Same(r->data(), req)) ++*ok;
        wg->Done();
      }(*c, i, &ok, &wg));
    }
    CO_ASSERT_OK(co_await wg.Wait());
    EXPECT_EQ(ok, kCalls);
    EXPECT_LE(t->obs_.gate_max.load(), 2);
    EXPECT_GE(t->obs_.gate_max.load(), 1);
  }(this));
}

TEST_P(RpcTest, ConnectionsSpreadAcrossReactors) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    for (int i = 0; i < 4; ++i) {
      auto c = co_await t->NewClient();
      CO_ASSERT_OK(c);
      auto r = co_await (*c)->Call("Echo", Pattern(10, i));
      CO_ASSERT_OK(r);
    }
  }(this));
  // Each server reactor hosts connections: the workers' CQs saw traffic.
  EXPECT_EQ(server_->stats().connections, 4u);
}

TEST_P(RpcTest, MalformedFrameGetsAnErrorAndClosesOnlyThatConnection) {
  StartServer();
  Run([](RpcTest* t) -> Task<void> {
    auto good = co_await t->NewClient();
    CO_ASSERT_OK(good);
    auto raw = co_await cm::Connect(*t->client_ctx_, t->addr_, t->server_->port());
    CO_ASSERT_OK(raw);
    // A request whose payload_len lies about the message size.
    HeaderBytes h = RequestHeader(42, MethodId("Echo"), 100);
    std::vector<std::byte> bad(h.begin(), h.end());
    bad.resize(kHeaderSize + 10);
    CO_ASSERT_OK(co_await (*raw)->Send(bad));
    // The call id could be read: call 42 gets the error, then the connection.
    auto m1 = co_await (*raw)->Recv();
    CO_ASSERT_OK(m1);
    auto f1 = DecodeFrame(m1->data(), Side::kClient);
    CO_ASSERT_OK(f1);
    EXPECT_EQ(f1->header.type, FrameType::kError);
    EXPECT_EQ(f1->header.call_id, 42u);
    absl::Status why = StatusFromErrorFrame(*f1);
    EXPECT_EQ(why.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(why.message().find("payload_len 100"), std::string::npos) << why;
    auto m2 = co_await (*raw)->Recv();
    CO_ASSERT_OK(m2);
    auto f2 = DecodeFrame(m2->data(), Side::kClient);
    CO_ASSERT_OK(f2);
    EXPECT_EQ(f2->header.call_id, 0u);
    // Then the server closes it.
    auto m3 = co_await (*raw)->Recv();
    EXPECT_EQ(m3.status().code(), absl::StatusCode::kUnavailable) << m3.status();
    // Garbage on another connection: a connection-level error.
    auto raw2 = co_await cm::Connect(*t->client_ctx_, t->addr_, t->server_->port());
    CO_ASSERT_OK(raw2);
    std::vector<std::byte> junk(7, std::byte{0xee});
    CO_ASSERT_OK(co_await (*raw2)->Send(junk));
    auto g = co_await (*raw2)->Recv();
    CO_ASSERT_OK(g);
    auto fg = DecodeFrame(g->data(), Side::kClient);
    CO_ASSERT_OK(fg);
    EXPECT_EQ(fg->header.call_id, 0u);
    EXPECT_NE(StatusFromErrorFrame(*fg).message().find("truncated"),
              std::string::npos);
    (void)co_await (*raw)->Close();
    (void)co_await (*raw2)->Close();
    // The well-behaved client is unaffected.
    auto r = co_await (*good)->Call("Echo", Pattern(1000, 9));
    CO_ASSERT_OK(r);
    EXPECT_EQ(t->server_->stats().protocol_errors, 2u);
  }(this));
}

TEST_P(RpcTest, ServerKilledDuringCallsFailsEveryPendingCall) {
  // Under bazel test: the runfiles path; run directly (the VM harness): the
  // helper built next to this binary.
  const char* helper = std::getenv("COVERBS_RPC_SERVER_PEER");
  std::string path = helper ? helper : "tests/rpc/rpc_server_peer";
  if (access(path.c_str(), X_OK) != 0) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      std::string exe(self, n);
      path = exe.substr(0, exe.rfind('/') + 1) + "rpc_server_peer";
    }
  }
  ASSERT_EQ(access(path.c_str(), X_OK), 0) << "helper not found: " << path;
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  // The child keeps only the write end (dup'ed without CLOEXEC).
  std::string provider = GetParam();
  std::string fd_arg = "3";
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 3);
    execl(path.c_str(), path.c_str(), provider.c_str(), addr_.c_str(),
          fd_arg.c_str(), nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  close(fds[1]);
  // Read the port (bounded: the helper is killed below if it never says).
  std::string port_text;
  char ch;
  for (int i = 0; i < 16 && read(fds[0], &ch, 1) == 1 && ch != '\n'; ++i) {
    port_text.push_back(ch);
  }
  close(fds[0]);
  uint16_t port = static_cast<uint16_t>(std::atoi(port_text.c_str()));
  if (port == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    FAIL() << "the server helper did not report a port";
  }
  Run([](RpcTest* t, uint16_t port, pid_t pid) -> Task<void> {
    auto c = co_await Client::Connect(*t->client_ctx_, t->addr_, port);
    CO_ASSERT_OK(c);
    auto e = co_await (*c)->Call("Echo", Pattern(100, 1));
    CO_ASSERT_OK(e);
    constexpr int kPending = 32;
    std::vector<absl::Status> results(kPending, absl::UnknownError("pending"));
    WaitGroup wg;
    wg.Add(kPending);
    for (int i = 0; i < kPending; ++i) {
      // Some small and one large request in flight.
      Reactor::Current()->Spawn([](Client* c, absl::Status* out,
                                   WaitGroup* wg) -> Task<void> {
        auto r = co_await c->Call("Hang", {});
        *out = r.status();
        wg->Done();
      }(c->get(), &results[i], &wg));
    }
    Client* client = c->get();
    EXPECT_TRUE(co_await Eventually(
        [client] { return client->in_flight() == kPending; }));
    co_await Reactor::Current()->Sleep(absl::Milliseconds(50));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    CO_ASSERT_OK(co_await wg.Wait());
    for (const absl::Status& s : results) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    }
    EXPECT_FALSE((*c)->status().ok());
    // Later calls fail at once.
    auto late = co_await (*c)->Call("Echo", Pattern(10, 2));
    EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
    (void)co_await (*c)->Close();
  }(this, port, pid), absl::Seconds(60));
}

INSTANTIATE_TEST_SUITE_P(Providers, RpcTest, ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::rpc
