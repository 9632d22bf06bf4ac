// The connection-layer test fixture shared by the cm suites (cm_test,
// landing_test): a reactor, a device of the parameter's provider, a server
// and a client Worker, and helpers to make connected pairs and run
// coroutine test bodies with a time limit.
#ifndef COVERBS_TESTS_CM_CM_FIXTURE_H_
#define COVERBS_TESTS_CM_CM_FIXTURE_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "gtest/gtest.h"
#include "tests/cm/test_util.h"
#include "tests/co_assert.h"
#include "transport/device.h"

namespace coverbs::cm {

using transport::Device;

inline std::vector<std::byte> Pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::byte>(seed + i * 13 + (i >> 8));
  }
  return v;
}

inline bool Same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

class CmTest : public ::testing::TestWithParam<std::string> {
 public:
  void SetUp() override {
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    transport::ProviderOptions o;
    o.kind = *transport::ParseProviderKind(GetParam());
    auto d = Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    addr_ = TestAddress();
    auto a = Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(a.ok()) << a.status();
    server_ctx_ = *std::move(a);
    auto b = Worker::Create(*reactor_, *device_);
    ASSERT_TRUE(b.ok()) << b.status();
    client_ctx_ = *std::move(b);
  }
  void TearDown() override {
    client_ctx_.reset();
    server_ctx_.reset();
    if (reactor_) {
      // Let detached internal tasks finish before the reactor goes.
      reactor_->BlockOn(Settle(reactor_.get()));
    }
    device_.reset();
    reactor_.reset();
  }
  static Task<void> Settle(Reactor* r) {
    for (int i = 0; i < 20; ++i) co_await r->Yield();
  }

  bool iwarp() const {
    return device_->caps().transport == transport::TransportKind::kIWarp;
  }

  // Runs `t` on the reactor, failing (not hanging) after `limit`.
  void Run(Task<void> t, absl::Duration limit = absl::Seconds(60)) {
    auto wrap = [](Task<void> t) -> Task<absl::Status> {
      co_await std::move(t);
      co_return absl::OkStatus();
    };
    absl::Status s = reactor_->BlockOn(WithTimeout(wrap(std::move(t)), limit));
    EXPECT_TRUE(s.ok()) << "test body: " << s;
  }

  struct Pair {
    std::unique_ptr<Listener> listener;
    std::unique_ptr<Connection> server;
    std::unique_ptr<Connection> client;
  };

  // Listener + Connect + Accept, concurrently.
  // gcc 12 mishandles default arguments of coroutines: overload instead.
  Task<absl::StatusOr<Pair>> MakePair() { return MakePair({}, {}); }
  Task<absl::StatusOr<Pair>> MakePair(ConnectOptions co) {
    return MakePair(std::move(co), {});
  }
  // Both ends with the same connection options.
  Task<absl::StatusOr<Pair>> MakePairWith(ConnectionOptions both) {
    ConnectOptions co;
    co.connection = both;
    ListenerOptions lo;
    lo.connection = std::move(both);
    return MakePair(std::move(co), std::move(lo));
  }
  Task<absl::StatusOr<Pair>> MakePair(ConnectOptions co, ListenerOptions lo) {
    return MakePairAt(addr_, addr_, std::move(co), std::move(lo));
  }
  // The listener on `listen_at`, the client connecting to `connect_to`
  // (host names, IPv6 literals, a wildcard listener).
  // Accepts one connection on `l` into `*out`, then marks `wg` done (spawn
  // it, then connect).
  static Task<void> AcceptInto(Listener* l,
                               absl::StatusOr<std::unique_ptr<Connection>>* out,
                               WaitGroup* wg) {
    *out = co_await l->Accept();
    wg->Done();
  }

  Task<absl::StatusOr<Pair>> MakePairAt(std::string listen_at,
                                        std::string connect_to,
                                        ConnectOptions co, ListenerOptions lo) {
    Pair p;
    auto ln = Listener::Create(*server_ctx_, listen_at, 0, lo);
    if (!ln.ok()) co_return ln.status();
    p.listener = *std::move(ln);
    absl::StatusOr<std::unique_ptr<Connection>> accepted =
        absl::UnknownError("not run");
    WaitGroup wg;
    wg.Add();
    reactor_->Spawn(AcceptInto(p.listener.get(), &accepted, &wg));
    auto c = co_await Connect(*client_ctx_, connect_to, p.listener->port(), co);
    if (!c.ok()) {
      p.listener->Close();
      co_await wg.Wait();
      co_return c.status();
    }
    co_await wg.Wait();
    if (!accepted.ok()) co_return accepted.status();
    p.client = *std::move(c);
    p.server = *std::move(accepted);
    co_return p;
  }

  // Posts `bytes` as one SEND straight on `c`'s QP, bypassing the cm
  // framing (a peer that breaks the protocol).
  static Task<absl::Status> SendRaw(Connection& c, std::span<std::byte> bytes) {
    auto mr = c.worker().pd().Register(bytes, IBV_ACCESS_LOCAL_WRITE);
    if (!mr.ok()) co_return mr.status();
    auto wc = co_await c.qp().Send(mr->Local());
    co_return wc.status();
  }

  // Closes both ends of a pair (client first).
  static Task<void> Close(Pair& p) {
    co_await p.client->Close();
    co_await p.server->Close();
  }

  // `n` Sends of 4-byte sequence numbers from `from`, all started at once,
  // while `to` receives them in order, pausing `pause_ms` every `every`
  // messages (a receiver that falls behind). Failed Sends are counted in
  // `failures`; order and Recv errors are checked here.
  Task<void> SendAhead(Connection* from, Connection* to, int n, int every,
                       int pause_ms, int* failures) {
    WaitGroup wg;
    for (int i = 0; i < n; ++i) {
      wg.Add();
      auto one = [](Connection* c, int i, WaitGroup* wg,
                    int* failures) -> Task<void> {
        uint32_t v = i;
        auto s = co_await c->Send(std::as_bytes(std::span(&v, 1)));
        if (!s.ok()) ++*failures;
        wg->Done();
      };
      reactor_->Spawn(one(from, i, &wg, failures));
    }
    for (int i = 0; i < n; ++i) {
      if (i % every == 0) {
        co_await reactor_->Sleep(absl::Milliseconds(pause_ms));
      }
      auto m = co_await to->Recv();
      if (!m.ok()) {
        ADD_FAILURE() << "message " << i << ": " << m.status();
        break;
      }
      uint32_t v;
      std::memcpy(&v, m->data().data(), 4);
      EXPECT_EQ(v, static_cast<uint32_t>(i));
    }
    co_await wg.Wait();
  }

  // Replaces a worker with one that has a shared receive queue.
  absl::Status UseSrq(std::unique_ptr<Worker>& ctx, uint32_t depth) {
    WorkerOptions o;
    o.srq_depth = depth;
    auto c = Worker::Create(*reactor_, *device_, o);
    if (!c.ok()) return c.status();
    ctx = *std::move(c);
    return absl::OkStatus();
  }

  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Worker> server_ctx_;
  std::unique_ptr<Worker> client_ctx_;
  std::string addr_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_TESTS_CM_CM_FIXTURE_H_
