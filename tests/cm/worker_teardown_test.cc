// Issue #36.5 at the connection layer: a cm::Worker destroyed with its
// connections open (cm/worker.h, "Lifetime"). Both ends run on one reactor,
// each on its own Worker; the client's Worker goes first, outside the loop:
//  - a receive waiting in a task wakes with the Worker's cause, and the
//    task lets go of the connection while the Worker waits;
//  - a connection the test still holds is detached: valid and down,
//    operations fail with its status, Close returns at once, and it (and a
//    Message it delivered) may go after the Worker and the Reactor;
//  - the peer sees the connection end;
//  - a Worker destroyed inside its loop (from a task) fails and detaches
//    a quiet connection at once.
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "tests/cm/cm_fixture.h"

namespace coverbs::cm {
namespace {

constexpr char kCause[] = "the cm::Worker was destroyed";

Task<absl::Status> SendText(Connection* c, std::string text) {
  co_return co_await c->Send(text);
}
Task<absl::StatusOr<Message>> RecvOne(Connection* c) {
  co_return co_await c->Recv();
}

class WorkerTeardownTest : public CmTest {
 protected:
  // A connected pair, made on the loop.
  Pair MakeConnected() {
    auto p = reactor_->BlockOn(MakePair());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : Pair{};
  }
  // Runs the loop until `done` or 10 s.
  template <typename F>
  void RunUntil(F done) {
    absl::Time until = absl::Now() + absl::Seconds(10);
    while (!done() && absl::Now() < until) {
      if (!reactor_->RunOnce()) absl::SleepFor(absl::Microseconds(100));
    }
  }
};

TEST_P(WorkerTeardownTest, WaitingReceiveWakesAndConnectionOutlivesWorker) {
  Pair p = MakeConnected();
  ASSERT_NE(p.client, nullptr);
  // A message delivered and held past the Worker (its receive buffer).
  const std::string hello = "hello";
  ASSERT_TRUE(reactor_->BlockOn(SendText(p.server.get(), hello)).ok());
  auto held = reactor_->BlockOn(RecvOne(p.client.get()));
  ASSERT_TRUE(held.ok()) << held.status();
  // A receive waiting in a task.
  std::optional<absl::Status> waited;
  reactor_->Spawn(
      [](Connection* c, std::optional<absl::Status>* out) -> Task<void> {
        auto m = co_await c->Recv();
        *out = m.status();
      }(p.client.get(), &waited));
  reactor_->RunOnce();

  client_ctx_.reset();

  ASSERT_TRUE(waited.has_value());
  EXPECT_EQ(waited->code(), absl::StatusCode::kUnavailable) << *waited;
  EXPECT_TRUE(absl::StrContains(waited->message(), kCause)) << *waited;
  // Detached: down with the cause; everything fails, nothing crashes.
  EXPECT_EQ(p.client->close_cause(), CloseCause::kLocalClose);
  EXPECT_TRUE(absl::StrContains(p.client->status().message(), kCause));
  EXPECT_FALSE(reactor_->BlockOn(SendText(p.client.get(), hello)).ok());
  EXPECT_FALSE(reactor_->BlockOn(RecvOne(p.client.get())).ok());
  EXPECT_FALSE(p.client->TryRecv().has_value());
  std::string buf(16, '\0');
  EXPECT_FALSE(
      reactor_
          ->BlockOn(p.client->Read(std::as_writable_bytes(std::span(buf)),
                                   transport::RemoteRegion{}))
          .ok());
  EXPECT_FALSE(
      reactor_->BlockOn(p.client->FetchAdd(transport::RemoteRegion{}, 1)).ok());
  EXPECT_TRUE(reactor_->BlockOn(p.client->Close()).ok());
  EXPECT_EQ(std::string(held->text()), "hello");
  // The peer sees the end.
  std::optional<absl::Status> peer;
  reactor_->Spawn(
      [](Connection* c, std::optional<absl::Status>* out) -> Task<void> {
        auto m = co_await c->Recv();
        *out = m.status();
      }(p.server.get(), &peer));
  RunUntil([&] { return peer.has_value(); });
  ASSERT_TRUE(peer.has_value());
  EXPECT_FALSE(peer->ok());
  p.server.reset();
  p.listener.reset();
  server_ctx_.reset();
  // The Reactor goes, then the connection, then its message.
  reactor_->BlockOn(Settle(reactor_.get()));
  reactor_.reset();
  p.client.reset();
  held = absl::CancelledError("dropped");
}

TEST_P(WorkerTeardownTest, ConnectionsOnlyTasksHoldAreDestroyed) {
  Pair p = MakeConnected();
  ASSERT_NE(p.client, nullptr);
  // The task owns the connection: once its receive fails, it lets go.
  bool ended = false;
  reactor_->Spawn([](std::unique_ptr<Connection> c, bool* ended) -> Task<void> {
    for (;;) {
      auto m = co_await c->Recv();
      if (!m.ok()) break;
    }
    *ended = true;
  }(std::move(p.client), &ended));
  reactor_->RunOnce();
  client_ctx_.reset();
  EXPECT_TRUE(ended);
}

TEST_P(WorkerTeardownTest, DestroyedInsideItsLoop) {
  Pair p = MakeConnected();
  ASSERT_NE(p.client, nullptr);
  // Inside the loop the Worker cannot wait for tasks suspended on its
  // connections (cm/worker.h): only a quiet connection -- its HELLO's send
  // completed, nothing waiting on it -- is detached safely there.
  reactor_->BlockOn([](Reactor* r) -> Task<void> {
    (void)co_await r->Sleep(absl::Milliseconds(300));
  }(reactor_.get()));
  std::unique_ptr<Worker> w = std::move(client_ctx_);
  reactor_->BlockOn([](std::unique_ptr<Worker> w) -> Task<void> {
    w.reset();  // inside the loop: failed and detached at once
    co_return;
  }(std::move(w)));
  EXPECT_TRUE(absl::StrContains(p.client->status().message(), kCause))
      << p.client->status();
  EXPECT_TRUE(reactor_->BlockOn(p.client->Close()).ok());
  p.client.reset();
}

INSTANTIATE_TEST_SUITE_P(Providers, WorkerTeardownTest,
                         ::testing::ValuesIn(InProcessProviders()));

}  // namespace
}  // namespace coverbs::cm
