// rpc::ClientPool against real servers on the soft provider (loopback):
// calls spread over reactors and servers, a server stopped during calls
// (the calls on it fail with the cause, new ones go to the live server)
// and restarted on its port (reconnected with back-off), the default
// deadline, a pool with no reachable server (fail fast, or wait for ready),
// and the only server stopped and restarted.
#include "rpc/client_pool.h"

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"
#include "rpc/context.h"
#include "rpc/server.h"
#include "rpc/typed.h"
#include "transport/device.h"
#include "transport/provider.h"

namespace coverbs::rpc {
namespace {

inline constexpr Method<std::string, std::string> kUpper{"Upper"};
inline constexpr Method<int32_t, transport::RemoteRegion> kRegion{"Region"};
constexpr size_t kRegionBytes = 4096;

class ClientPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::ProviderOptions po;
    po.kind = transport::ProviderKind::kSoft;
    auto d = transport::Device::Open(po);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    auto sw = cm::WorkerPool::Create(*device_);
    ASSERT_TRUE(sw.ok()) << sw.status();
    server_workers_ = *std::move(sw);
    cm::WorkerPool::Options o;
    o.threads = 2;
    auto cw = cm::WorkerPool::Create(*device_, o);
    ASSERT_TRUE(cw.ok()) << cw.status();
    client_workers_ = *std::move(cw);
  }

  void TearDown() override {
    if (pool_) pool_->Shutdown();
    pool_.reset();
    for (auto& s : servers_) {
      if (s) s->Shutdown();
    }
    servers_.clear();
    client_workers_.reset();
    server_workers_.reset();
    device_.reset();
  }

  // A server with Echo and Slow (sleeps until cancelled, up to 30 s) on
  // `port` (0: any); servers_[i] is replaced.
  void StartServer(size_t i, uint16_t port) {
    if (servers_.size() <= i) servers_.resize(i + 1);
    auto s = std::make_unique<Server>();
    ASSERT_TRUE(
        s->Register("Echo", [](Request r) -> Task<absl::StatusOr<Payload>> {
           co_return std::move(r.payload);
         }).ok());
    ASSERT_TRUE(
        s->Register("Slow", [](Request) -> Task<absl::StatusOr<Payload>> {
           absl::Status st =
               co_await Reactor::Current()->Sleep(absl::Seconds(30));
           if (!st.ok()) co_return st;
           co_return Payload::Copy("late");
         }).ok());
    ASSERT_TRUE(
        s->Register("Sleepy", [](Request) -> Task<absl::StatusOr<Payload>> {
           absl::Status st =
               co_await Reactor::Current()->Sleep(absl::Milliseconds(100));
           if (!st.ok()) co_return st;
           co_return Payload::Copy("rested");
         }).ok());
    // Typed: the upper-cased string; a region of kRegionBytes exposed to
    // the caller's connection alone.
    ASSERT_TRUE(
        s->Register(kUpper,
                    [](std::string in) -> Task<absl::StatusOr<std::string>> {
                      for (char& c : in) c = absl::ascii_toupper(c);
                      co_return in;
                    })
            .ok());
    ASSERT_TRUE(
        s->Register(kRegion,
                    [](Context& ctx, int32_t fill)
                        -> Task<absl::StatusOr<transport::RemoteRegion>> {
                      std::string& bytes = ctx.KeepUntilClose(
                          std::string(kRegionBytes, static_cast<char>(fill)));
                      auto mr = ctx.connection().worker().pd().Register(
                          std::as_writable_bytes(std::span(bytes)),
                          transport::Access::kRemoteRead);
                      if (!mr.ok()) co_return mr.status();
                      co_return ctx.Expose(ctx.KeepUntilClose(*std::move(mr)));
                    })
            .ok());
    absl::Status st = s->Start(*server_workers_, "127.0.0.1", port);
    ASSERT_TRUE(st.ok()) << st;
    servers_[i] = std::move(s);
  }

  void MakePool(ClientPoolOptions o) {
    auto p = ClientPool::Create(*client_workers_, std::move(o));
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *std::move(p);
  }

  // Until `n` connections are live (bounded): calls made before all are up
  // would go round-robin over fewer.
  void WaitLive(uint64_t n) {
    absl::Time until = absl::Now() + absl::Seconds(20);
    while (pool_->stats().live < n && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(pool_->stats().live, n);
  }

  // Runs `task` on client reactor i and waits for its result.
  template <typename T>
  T RunOn(size_t i, Task<T> task) {
    std::promise<T> done;
    auto f = done.get_future();
    client_workers_->reactors().Spawn(
        i, [](Task<T> t, std::promise<T>* p) -> Task<void> {
          p->set_value(co_await std::move(t));
        }(std::move(task), &done));
    return f.get();
  }

  // `n` Echo calls one after another; the first failure, else OK.
  static Task<absl::Status> Echoes(ClientPool* pool, int n) {
    const std::string msg = "ping";
    for (int i = 0; i < n; ++i) {
      auto r = co_await pool->Call("Echo", std::as_bytes(std::span(msg)));
      if (!r.ok()) co_return r.status();
      if (r->ToString() != msg) co_return absl::DataLossError("echo differs");
    }
    co_return absl::OkStatus();
  }

  std::unique_ptr<transport::Device> device_;
  std::unique_ptr<cm::WorkerPool> server_workers_;
  std::unique_ptr<cm::WorkerPool> client_workers_;
  std::vector<std::unique_ptr<Server>> servers_;
  std::unique_ptr<ClientPool> pool_;
};

TEST_F(ClientPoolTest, CallsSpreadOverReactorsAndServers) {
  StartServer(0, 0);
  StartServer(1, 0);
  MakePool({.servers = {{"127.0.0.1", servers_[0]->port()},
                        {"localhost", servers_[1]->port()}}});
  WaitLive(4);
  for (size_t i = 0; i < 2; ++i) {
    absl::Status s = RunOn(i, Echoes(pool_.get(), 20));
    ASSERT_TRUE(s.ok()) << s;
  }
  // One connection per reactor to each server; the calls alternate.
  EXPECT_EQ(servers_[0]->stats().connections, 2u);
  EXPECT_EQ(servers_[1]->stats().connections, 2u);
  EXPECT_EQ(servers_[0]->stats().calls + servers_[1]->stats().calls, 40u);
  EXPECT_GE(servers_[0]->stats().calls, 10u);
  EXPECT_GE(servers_[1]->stats().calls, 10u);
  EXPECT_EQ(pool_->stats().calls, 40u);
  EXPECT_EQ(pool_->stats().live, 4u);
}

TEST_F(ClientPoolTest, ServerStoppedAndRestarted) {
  StartServer(0, 0);
  StartServer(1, 0);
  const uint16_t port0 = servers_[0]->port();
  MakePool(
      {.servers = {{"127.0.0.1", port0}, {"127.0.0.1", servers_[1]->port()}},
       .reconnect_min = absl::Milliseconds(10),
       .reconnect_max = absl::Milliseconds(100)});
  WaitLive(4);
  ASSERT_TRUE(RunOn(0, Echoes(pool_.get(), 4)).ok());

  // Two Slow calls in flight (one per server, round-robin), then server 0
  // stops: its call fails with the cause, the other is still running.
  auto in_flight = [](ClientPool* pool) -> Task<absl::Status> {
    auto call = [](ClientPool* pool) -> Task<absl::StatusOr<Response>> {
      CallOptions o;
      o.deadline = absl::Now() + absl::Seconds(5);
      co_return co_await pool->Call("Slow", {}, o);
    };
    WaitGroup wg;
    absl::StatusOr<Response> r[2] = {absl::UnknownError(""),
                                     absl::UnknownError("")};
    for (int i = 0; i < 2; ++i) {
      wg.Add();
      Reactor::Current()->Spawn([](Task<absl::StatusOr<Response>> t,
                                   absl::StatusOr<Response>* out,
                                   WaitGroup* wg) -> Task<void> {
        *out = co_await std::move(t);
        wg->Done();
      }(call(pool), &r[i], &wg));
    }
    co_await wg.Wait();
    int unavailable = 0, deadline = 0;
    for (auto& x : r) {
      if (x.status().code() == absl::StatusCode::kUnavailable) ++unavailable;
      if (x.status().code() == absl::StatusCode::kDeadlineExceeded) ++deadline;
    }
    if (unavailable != 1 || deadline != 1) {
      co_return absl::InternalError(absl::StrCat(
          "expected one UNAVAILABLE and one DEADLINE_EXCEEDED: ",
          r[0].status().ToString(), " / ", r[1].status().ToString()));
    }
    co_return absl::OkStatus();
  };
  std::promise<absl::Status> result;
  auto f = result.get_future();
  client_workers_->reactors().Spawn(
      1, [](Task<absl::Status> t, std::promise<absl::Status>* p) -> Task<void> {
        p->set_value(co_await std::move(t));
      }(in_flight(pool_.get()), &result));
  // Both Slow handlers running (2 echoes + 1 Slow on each server).
  absl::Time running = absl::Now() + absl::Seconds(20);
  while ((servers_[0]->stats().calls < 3 || servers_[1]->stats().calls < 3) &&
         absl::Now() < running) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  servers_[0]->Shutdown();
  servers_[0].reset();
  absl::Status s = f.get();
  EXPECT_TRUE(s.ok()) << s;

  // Both reactors saw their connection to server 0 go (a call racing the
  // loss would fail with UNAVAILABLE, as in flight); new calls go to the
  // live server.
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (pool_->stats().live > 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(pool_->stats().live, 2u);
  ASSERT_TRUE(RunOn(0, Echoes(pool_.get(), 10)).ok());
  ASSERT_TRUE(RunOn(1, Echoes(pool_.get(), 10)).ok());
  // 2 of the 4 first echoes (round-robin), 1 Slow call, then all 20.
  EXPECT_EQ(servers_[1]->stats().calls, 2u + 1u + 20u);
  EXPECT_GE(pool_->stats().losses, 2u);  // both reactors' connections

  // Server 0 comes back on its port: the pool reconnects by itself.
  StartServer(0, port0);
  until = absl::Now() + absl::Seconds(20);
  while (pool_->stats().live < 4 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(pool_->stats().live, 4u);
  ASSERT_TRUE(RunOn(0, Echoes(pool_.get(), 10)).ok());
  EXPECT_GE(servers_[0]->stats().calls, 4u);
  EXPECT_GE(pool_->stats().connect_failures, 1u);
}

// Typed calls through the pool, and a lease that keeps one connection for
// a call and the RDMA READ of the region it returned.
TEST_F(ClientPoolTest, TypedCallsAndLeasedRead) {
  StartServer(0, 0);
  StartServer(1, 0);
  MakePool({.servers = {{"127.0.0.1", servers_[0]->port()},
                        {"127.0.0.1", servers_[1]->port()}}});
  WaitLive(4);
  absl::Status s = RunOn(0, [](ClientPool* p) -> Task<absl::Status> {
    for (int i = 0; i < 4; ++i) {
      absl::StatusOr<std::string> up =
          co_await p->Call(kUpper, std::string("pool"));
      if (!up.ok()) co_return up.status();
      if (*up != "POOL") co_return absl::DataLossError(*up);
      // A lease: the token is usable on the connection that made it.
      absl::StatusOr<std::shared_ptr<Client>> lease = co_await p->Lease();
      if (!lease.ok()) co_return lease.status();
      const int32_t fill = 'a' + i;
      absl::StatusOr<transport::RemoteRegion> region =
          co_await (*lease)->Call(kRegion, fill);
      if (!region.ok()) co_return region.status();
      if (region->length != kRegionBytes) {
        co_return absl::DataLossError("region length");
      }
      std::string got(region->length, '\0');
      absl::Status read = co_await (*lease)->connection().Read(
          std::as_writable_bytes(std::span(got)), *region);
      if (!read.ok()) co_return read;
      if (got != std::string(kRegionBytes, static_cast<char>(fill))) {
        co_return absl::DataLossError("read bytes differ");
      }
    }
    co_return absl::OkStatus();
  }(pool_.get()));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(pool_->stats().leases, 4u);
  // The leases went round-robin too: both servers exposed regions.
  EXPECT_GE(servers_[0]->stats().calls, 4u);
  EXPECT_GE(servers_[1]->stats().calls, 4u);
}

// Callers keep calling (Echo, and Sleepy: 100 ms in its handler) while
// one of two servers drains: the calls running there finish, the ones it
// refuses go to the other server, and none fails.
TEST_F(ClientPoolTest, DrainingServerLosesNoCall) {
  StartServer(0, 0);
  StartServer(1, 0);
  MakePool({.servers = {{"127.0.0.1", servers_[0]->port()},
                        {"127.0.0.1", servers_[1]->port()}},
            .reconnect_min = absl::Milliseconds(10),
            .reconnect_max = absl::Milliseconds(50)});
  WaitLive(4);
  struct Shared {
    std::atomic<bool> stop{false};
    std::atomic<int> ok{0}, sleepy_ok{0}, failed{0};
    std::mutex mu;
    std::string first_failure;
  } sh;
  std::promise<void> done[2];
  constexpr int kCallers = 8;  // per reactor
  for (size_t i = 0; i < 2; ++i) {
    client_workers_->reactors().Spawn(
        i,
        [](ClientPool* p, Shared* sh, std::promise<void>* done) -> Task<void> {
          WaitGroup wg;
          for (int k = 0; k < kCallers; ++k) {
            wg.Add();
            Reactor::Current()->Spawn([](ClientPool* p, Shared* sh, int k,
                                         WaitGroup* wg) -> Task<void> {
              const std::string msg = "drain";
              for (int n = 0; !sh->stop.load(); ++n) {
                const bool sleepy = (n + k) % 4 == 0;
                CallOptions o;
                o.deadline = absl::Now() + absl::Seconds(30);
                auto r = co_await p->Call(sleepy ? "Sleepy" : "Echo",
                                          std::as_bytes(std::span(msg)), o);
                if (r.ok()) {
                  (sleepy ? sh->sleepy_ok : sh->ok).fetch_add(1);
                  continue;
                }
                sh->failed.fetch_add(1);
                std::lock_guard lock(sh->mu);
                if (sh->first_failure.empty()) {
                  sh->first_failure = std::string(r.status().message());
                }
              }
              wg->Done();
            }(p, sh, k, &wg));
          }
          (void)co_await wg.Wait();
          done->set_value();
        }(pool_.get(), &sh, &done[i]));
  }
  // Both servers busy (Sleepy calls running on each), then server 0
  // drains while the callers go on.
  absl::Time until = absl::Now() + absl::Seconds(20);
  while ((servers_[0]->stats().calls < 50 || servers_[1]->stats().calls < 50) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  servers_[0]->Shutdown(absl::Seconds(20));
  const Server::Stats drained = servers_[0]->stats();
  servers_[0].reset();
  // Calls go on, on server 1 alone.
  const int ok_at_drain = sh.ok.load();
  until = absl::Now() + absl::Seconds(20);
  while (sh.ok.load() < ok_at_drain + 200 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  sh.stop.store(true);
  done[0].get_future().wait();
  done[1].get_future().wait();
  EXPECT_EQ(sh.failed.load(), 0) << sh.first_failure;
  EXPECT_GE(sh.ok.load(), ok_at_drain + 200);
  EXPECT_GT(sh.sleepy_ok.load(), 0);
  // Nothing running was cancelled by the drain.
  EXPECT_EQ(drained.cancelled_calls, 0u);
  EXPECT_EQ(pool_->stats().drain_retries, drained.drain_refused);
  std::printf("drain: %llu refused and sent on, %d Sleepy calls, %d others\n",
              static_cast<unsigned long long>(drained.drain_refused),
              sh.sleepy_ok.load(), sh.ok.load());
}

TEST_F(ClientPoolTest, DefaultDeadline) {
  StartServer(0, 0);
  MakePool({.servers = {{"127.0.0.1", servers_[0]->port()}},
            .default_deadline = absl::Milliseconds(200)});
  absl::Time start = absl::Now();
  absl::StatusOr<Response> r =
      RunOn(0, [](ClientPool* p) -> Task<absl::StatusOr<Response>> {
        co_return co_await p->Call("Slow", {});
      }(pool_.get()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(ClientPoolTest, NoServerReachableFailsFast) {
  // A port nobody listens on: bound, then closed.
  StartServer(0, 0);
  const uint16_t port = servers_[0]->port();
  servers_[0]->Shutdown();
  servers_[0].reset();
  MakePool({.servers = {{"127.0.0.1", port}}});
  // The first call waits for the first attempt, which is refused: then it
  // fails at once, long before its deadline.
  absl::StatusOr<Response> r =
      RunOn(0, [](ClientPool* p) -> Task<absl::StatusOr<Response>> {
        CallOptions o;
        o.deadline = absl::Now() + absl::Seconds(60);
        co_return co_await p->Call("Echo", {}, o);
      }(pool_.get()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "no live connection"))
      << r.status();
  // The connect error (refused, or reset by the listener going away).
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                absl::StrCat("connect to 127.0.0.1:", port)))
      << r.status();
  EXPECT_GE(pool_->stats().connect_failures, 1u);
  EXPECT_EQ(pool_->stats().fail_fast, 1u);
  // Off the pool's reactors: refused.
  auto bad = ClientPool::Create(*client_workers_, {});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientPoolTest, WaitForReadyWaitsUntilTheDeadline) {
  StartServer(0, 0);
  const uint16_t port = servers_[0]->port();
  servers_[0]->Shutdown();
  servers_[0].reset();
  MakePool({.servers = {{"127.0.0.1", port}}, .wait_for_ready = true});
  absl::StatusOr<Response> r =
      RunOn(0, [](ClientPool* p) -> Task<absl::StatusOr<Response>> {
        CallOptions o;
        o.deadline = absl::Now() + absl::Milliseconds(300);
        co_return co_await p->Call("Echo", {}, o);
      }(pool_.get()));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(),
                                absl::StrCat("connect to 127.0.0.1:", port)))
      << r.status();
  EXPECT_EQ(pool_->stats().fail_fast, 0u);
}

// The only server stops and comes back on its port: calls fail fast while
// it is down (the reactor keeps turning, so the pool keeps reconnecting),
// a wait_for_ready pool's call waits through the outage, and both recover
// by themselves.
TEST_F(ClientPoolTest, OnlyServerStoppedAndRestarted) {
  for (bool wait_for_ready : {false, true}) {
    SCOPED_TRACE(wait_for_ready ? "wait_for_ready" : "fail fast");
    StartServer(0, 0);
    const uint16_t port = servers_[0]->port();
    MakePool({.servers = {{"127.0.0.1", port}},
              .reconnect_min = absl::Milliseconds(10),
              .reconnect_max = absl::Milliseconds(50),
              .wait_for_ready = wait_for_ready});
    WaitLive(2);
    ASSERT_TRUE(RunOn(0, Echoes(pool_.get(), 4)).ok());
    servers_[0]->Shutdown();
    servers_[0].reset();
    // Both reactors take their connection out (the loss is seen by the
    // watcher; no call is needed).
    absl::Time until = absl::Now() + absl::Seconds(20);
    while (pool_->stats().live > 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(pool_->stats().live, 0u);
    // A call while down: fails fast, or waits for the restart below.
    std::promise<absl::Status> down_call;
    auto f = down_call.get_future();
    client_workers_->reactors().Spawn(
        0, [](ClientPool* p, std::promise<absl::Status>* out) -> Task<void> {
          CallOptions o;
          o.deadline = absl::Now() + absl::Seconds(60);
          const std::string msg = "down";
          auto r = co_await p->Call("Echo", std::as_bytes(std::span(msg)), o);
          // A copy with its own message: the Debian libabsl is not
          // instrumented, so TSan cannot see a shared rep's atomic count.
          out->set_value(r.ok()
                             ? absl::OkStatus()
                             : absl::Status(r.status().code(),
                                            std::string(r.status().message())));
        }(pool_.get(), &down_call));
    if (!wait_for_ready) {
      absl::Status s = f.get();
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "no live connection")) << s;
    }
    StartServer(0, port);
    if (wait_for_ready) {
      absl::Status s = f.get();
      EXPECT_TRUE(s.ok()) << s;
    }
    WaitLive(2);
    ASSERT_TRUE(RunOn(0, Echoes(pool_.get(), 10)).ok());
    ASSERT_TRUE(RunOn(1, Echoes(pool_.get(), 10)).ok());
    const ClientPool::Stats st = pool_->stats();
    EXPECT_EQ(st.losses, 2u);
    EXPECT_EQ(st.reconnects, 2u);
    EXPECT_EQ(st.connects, 4u);
    // Fail fast needs a failed attempt; a waiting pool may reconnect on
    // its first try after the restart.
    if (!wait_for_ready) {
      EXPECT_GE(st.connect_failures, 1u);
    }
    pool_->Shutdown();
    pool_.reset();
    servers_[0]->Shutdown();
    servers_[0].reset();
  }
}

}  // namespace
}  // namespace coverbs::rpc
