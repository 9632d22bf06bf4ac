// Issue #36.5: every shutdown order of a client program tears down cleanly
// with a live rpc::Client and calls in flight (ASan: no use after free, no
// leak). The server runs on a cm::WorkerPool of this process; the client's
// Reactor and Worker are on the test thread, created and destroyed in the
// order each test names:
//  - the Worker destroyed with calls in flight, the client still held;
//  - the client destroyed after its Worker (and a response held past both);
//  - the Reactor destroyed with a live client (one held by the test, one by
//    a suspended task whose frame the Reactor destroys);
//  - RunMain's order: the client dropped without Close, calls in flight,
//    then at once the Worker, then the Reactor -- and RunMain itself, whose
//    Main returns an error with a live client and calls in flight.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "coverbs/coverbs.h"
#include "gtest/gtest.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "tests/cm/test_util.h"
#include "transport/device.h"

namespace coverbs::rpc {
namespace {

struct CallResult {
  std::optional<absl::StatusOr<Response>> result;
};

// A call started in the background; its outcome goes to *out.
void SpawnCall(Reactor& r, Client* c, const std::string* method,
               CallResult* out, std::atomic<int>* done) {
  r.Spawn([](Client* c, const std::string* method, CallResult* out,
             std::atomic<int>* done) -> Task<void> {
    static const std::string payload = "in flight";
    out->result.emplace(co_await c->Call(*method, AsBytes(payload)));
    done->fetch_add(1);
  }(c, method, out, done));
}

class TeardownTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    transport::ProviderOptions o;
    o.kind = *transport::ParseProviderKind(GetParam());
    if (const char* dev = std::getenv("COVERBS_VM_DEV");
        dev && o.kind == transport::ProviderKind::kVerbs) {
      o.device = dev;
    }
    auto d = transport::Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    cm::WorkerPool::Options po;
    po.threads = 1;
    auto pool = cm::WorkerPool::Create(*device_, po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    server_ = std::make_unique<Server>();
    ASSERT_TRUE(server_
                    ->Register("Echo",
                               [](Request r) -> Task<absl::StatusOr<Payload>> {
                                 co_return std::move(r.payload);
                               })
                    .ok());
    // Holds each call (cancellable) until the test is over.
    ASSERT_TRUE(server_
                    ->Register("Slow",
                               [](Request) -> Task<absl::StatusOr<Payload>> {
                                 absl::Status s =
                                     co_await Reactor::Current()->Sleep(
                                         absl::Seconds(60));
                                 if (!s.ok()) co_return s;
                                 co_return Payload::Copy("slow");
                               })
                    .ok());
    ASSERT_TRUE(server_->Start(*pool_, cm::TestAddress(), 0).ok());
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    auto w = cm::Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(w.ok()) << w.status();
    worker_ = *std::move(w);
  }

  void TearDown() override {
    // Whatever the test left, in the supported order.
    worker_.reset();
    reactor_.reset();
    if (server_) {
      // Every connection the client side ended is gone on the server too
      // (ended by the peer, not leaked), well before the server shuts down.
      absl::Time until = absl::Now() + absl::Seconds(10);
      while (server_->stats().open_connections > 0 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      EXPECT_EQ(server_->stats().open_connections, 0u);
      server_->Shutdown();
    }
    server_.reset();
    pool_.reset();
    device_.reset();
  }

  std::unique_ptr<Client> Connect() {
    auto c = reactor_->BlockOn(
        Client::Connect(*worker_, cm::TestAddress(), server_->port()));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Runs the loop until `n` calls are running on the server.
  void AwaitServerCalls(uint64_t n) {
    absl::Time until = absl::Now() + absl::Seconds(10);
    while (server_->stats().calls < n && absl::Now() < until) {
      reactor_->RunOnce();
    }
    ASSERT_GE(server_->stats().calls, n);
  }

  // Each call ended UNAVAILABLE, naming why: the Worker went.
  static void ExpectWorkerGone(const CallResult& c) {
    ASSERT_TRUE(c.result.has_value());
    EXPECT_EQ(c.result->status().code(), absl::StatusCode::kUnavailable)
        << c.result->status();
    EXPECT_TRUE(absl::StrContains(c.result->status().message(),
                                  "the cm::Worker was destroyed"))
        << c.result->status();
  }
  static void ExpectWorkerGone(const std::vector<CallResult>& calls) {
    for (const CallResult& c : calls) ExpectWorkerGone(c);
  }

  const std::string slow_ = "Slow";
  const std::string echo_ = "Echo";
  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<cm::WorkerPool> pool_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<cm::Worker> worker_;
};

TEST_P(TeardownTest, WorkerDestroyedWithCallsInFlight) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<CallResult> calls(8);
  std::atomic<int> done{0};
  for (auto& c : calls) SpawnCall(*reactor_, client.get(), &slow_, &c, &done);
  AwaitServerCalls(calls.size());
  ASSERT_EQ(client->in_flight(), calls.size());

  worker_.reset();  // outside the loop, calls in flight

  // Every call returned during the Worker's destruction, with the cause.
  EXPECT_EQ(done.load(), static_cast<int>(calls.size()));
  ExpectWorkerGone(calls);
  EXPECT_EQ(client->in_flight(), 0u);
  EXPECT_EQ(client->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client->connection().close_cause(), cm::CloseCause::kLocalClose);
  // The client stays usable as an object: calls fail at once, Close
  // returns at once.
  static const std::string payload = "after";
  auto late = reactor_->BlockOn(client->Call(echo_, AsBytes(payload)));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable)
      << late.status();
  auto closed = reactor_->BlockOn(client->Close());
  EXPECT_TRUE(closed.ok()) << closed;
  client.reset();
  reactor_.reset();
}

TEST_P(TeardownTest, ClientDestroyedAfterItsWorker) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  // A response held past the Worker: its receive buffer outlives both.
  static const std::string payload = "kept";
  auto held = reactor_->BlockOn(client->Call(echo_, AsBytes(payload)));
  ASSERT_TRUE(held.ok()) << held.status();
  std::vector<CallResult> calls(4);
  std::atomic<int> done{0};
  for (auto& c : calls) SpawnCall(*reactor_, client.get(), &slow_, &c, &done);
  AwaitServerCalls(1 + calls.size());

  worker_.reset();
  EXPECT_EQ(done.load(), static_cast<int>(calls.size()));
  ExpectWorkerGone(calls);
  // No Close: the client goes after its Worker, then the response, then
  // the Reactor.
  client.reset();
  EXPECT_EQ(held->ToString(), "kept");
  held = absl::CancelledError("dropped");
  reactor_.reset();
}

TEST_P(TeardownTest, ReactorDestroyedWithLiveClient) {
  std::unique_ptr<Client> kept = Connect();
  ASSERT_NE(kept, nullptr);
  // A second client owned by a suspended task: the Reactor destroys its
  // frame, and with it the client.
  std::unique_ptr<Client> owned = Connect();
  ASSERT_NE(owned, nullptr);
  std::vector<CallResult> calls(4);
  std::atomic<int> done{0};
  for (auto& c : calls) SpawnCall(*reactor_, kept.get(), &slow_, &c, &done);
  CallResult owned_call;
  SpawnCall(*reactor_, owned.get(), &slow_, &owned_call, &done);
  reactor_->Spawn([](std::unique_ptr<Client> c) -> Task<void> {
    // Sleeps past the test, holding the client.
    (void)co_await Reactor::Current()->Sleep(absl::Hours(1));
    (void)co_await c->Close();
  }(std::move(owned)));
  AwaitServerCalls(calls.size() + 1);

  worker_.reset();
  EXPECT_EQ(done.load(), static_cast<int>(calls.size()) + 1);
  ExpectWorkerGone(calls);
  ExpectWorkerGone(owned_call);
  reactor_.reset();  // destroys the sleeping task and its client
  EXPECT_EQ(kept->status().code(), absl::StatusCode::kUnavailable);
  kept.reset();  // after the Reactor
}

TEST_P(TeardownTest, ClientDroppedThenWorkerAtOnce) {
  // RunMain's order when main returns early: the client goes with main's
  // frame (no Close) while calls are in flight, the Worker right after --
  // the client's receive loop and the calls have not run since.
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<CallResult> calls(8);
  std::atomic<int> done{0};
  for (auto& c : calls) SpawnCall(*reactor_, client.get(), &slow_, &c, &done);
  AwaitServerCalls(calls.size());
  client.reset();
  worker_.reset();
  EXPECT_EQ(done.load(), static_cast<int>(calls.size()));
  for (const CallResult& c : calls) {
    ASSERT_TRUE(c.result.has_value());
    EXPECT_EQ(c.result->status().code(), absl::StatusCode::kCancelled)
        << c.result->status();
  }
  reactor_.reset();
}

TEST_P(TeardownTest, RunMainReturnsErrorWithLiveClientAndCallsInFlight) {
  // The client side's own Reactor and Worker are RunMain's here.
  worker_.reset();
  reactor_.reset();
  RunOptions options;
  options.device = device_.get();
  const uint16_t port = server_->port();
  Server* server = server_.get();
  int rc = RunMain(
      [port, server](cm::Worker& worker) -> Task<absl::Status> {
        auto client = co_await Client::Connect(worker, cm::TestAddress(), port);
        if (!client.ok()) co_return client.status();
        static const std::string slow = "Slow";
        static std::vector<CallResult> calls(8);
        static std::atomic<int> done{0};
        for (auto& c : calls) {
          SpawnCall(worker.reactor(), client->get(), &slow, &c, &done);
        }
        while (server->stats().calls < calls.size()) {
          (void)co_await worker.reactor().Sleep(absl::Milliseconds(1));
        }
        co_return absl::FailedPreconditionError("main gives up");
      },
      options);
  EXPECT_EQ(rc, 1);
}

INSTANTIATE_TEST_SUITE_P(Providers, TeardownTest,
                         ::testing::ValuesIn(cm::Providers()));

}  // namespace
}  // namespace coverbs::rpc
