// The fixture of the rpc end-to-end tests (rpc_test.cc, rpc_cancel_test.cc,
// one binary): a Server on a 2-thread ReactorPool and Clients on the test
// thread's reactor, on every available provider.
#ifndef COVERBS_TESTS_RPC_RPC_FIXTURE_H_
#define COVERBS_TESTS_RPC_RPC_FIXTURE_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <stop_token>
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

namespace coverbs::rpc::rpc_test_util {

using transport::Device;

using cm::Providers;
using cm::TestAddress;

inline std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::byte>(seed * 31 + i * 13 + (i >> 8));
  }
  return v;
}

inline bool Same(std::span<const std::byte> a, std::span<const std::byte> b) {
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
      reactor_->BlockOn(
          [](std::vector<std::unique_ptr<Client>>* cs) -> Task<void> {
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
    ASSERT_TRUE(
        server_
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
                                 absl::Status s =
                                     co_await Reactor::Current()->Sleep(
                                         absl::Seconds(60));
                                 if (!s.ok()) {
                                   obs->slow_cancelled.fetch_add(1);
                                   co_return s;
                                 }
                                 co_return Payload::Copy("slow");
                               })
                    .ok());
    // Holds each call for 5 ms, recording how many run at once.
    ASSERT_TRUE(
        server_
            ->Register("Gate",
                       [obs](Request r) -> Task<absl::StatusOr<Payload>> {
                         int now = obs->gate_running.fetch_add(1) + 1;
                         int prev = obs->gate_max.load();
                         while (
                             now > prev &&
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

// Runs `call` in the background (under `stop`, if given): its result goes
// to *out, then `done` is set.
inline void SpawnCall(Task<absl::StatusOr<Response>> call,
                      absl::StatusOr<Response>* out, Event* done,
                      std::stop_token stop = {}) {
  Reactor::Current()->Spawn(
      [](Task<absl::StatusOr<Response>> call, absl::StatusOr<Response>* out,
         Event* done) -> Task<void> {
        *out = co_await std::move(call);
        done->Set();
      }(std::move(call), out, done),
      std::move(stop));
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

}  // namespace coverbs::rpc::rpc_test_util

#endif  // COVERBS_TESTS_RPC_RPC_FIXTURE_H_
