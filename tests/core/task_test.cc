#include "core/task.h"

#include <memory>
#include <stop_token>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

Task<int> Value(int v) { co_return v; }
Task<void> SetTo(int* out, int v) {
  *out = v;
  co_return;
}

TEST(TaskTest, ReturnsValue) {
  auto r = MakeReactor();
  EXPECT_EQ(r->BlockOn(Value(41)), 41);
}

TEST(TaskTest, Void) {
  auto r = MakeReactor();
  int out = 0;
  r->BlockOn(SetTo(&out, 7));
  EXPECT_EQ(out, 7);
}

Task<std::unique_ptr<std::string>> MoveOnly() {
  co_return std::make_unique<std::string>("moved");
}
Task<size_t> UsesMoveOnly() {
  std::unique_ptr<std::string> s = co_await MoveOnly();
  co_return s->size();
}

TEST(TaskTest, MoveOnlyResult) {
  auto r = MakeReactor();
  EXPECT_EQ(r->BlockOn(UsesMoveOnly()), 5u);
}

Task<absl::StatusOr<int>> MaybeFail(bool fail) {
  if (fail) co_return absl::NotFoundError("no such thing");
  co_return 3;
}
Task<absl::Status> Propagate(bool fail) {
  absl::StatusOr<int> v = co_await MaybeFail(fail);
  if (!v.ok()) co_return v.status();
  co_return *v == 3 ? absl::OkStatus() : absl::InternalError("bad value");
}

TEST(TaskTest, StatusPropagation) {
  auto r = MakeReactor();
  EXPECT_TRUE(r->BlockOn(Propagate(false)).ok());
  absl::Status s = r->BlockOn(Propagate(true));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no such thing");
}

TEST(TaskTest, IsLazy) {
  auto r = MakeReactor();
  int out = 0;
  Task<void> t = SetTo(&out, 1);
  EXPECT_EQ(out, 0);  // nothing ran yet
  r->BlockOn(std::move(t));
  EXPECT_EQ(out, 1);
}

// Counts live instances so tests can see frames being freed.
struct Sentinel {
  explicit Sentinel(int* live) : live(live) { ++*live; }
  ~Sentinel() { --*live; }
  int* live;
};

Task<void> HoldsSentinel(int* live, Event* never) {
  Sentinel s(live);
  absl::Status st = co_await never->Wait();
  (void)st;
}

TEST(TaskTest, DestroyingUnstartedTaskFreesFrame) {
  int live = 0;
  Event never;
  {
    Task<void> t = HoldsSentinel(&live, &never);
    EXPECT_EQ(live, 0);  // body not started: sentinel not constructed
  }
  EXPECT_EQ(live, 0);
}

Task<void> Parent(int* live, Event* never) {
  Sentinel s(live);
  co_await HoldsSentinel(live, never);
}

TEST(TaskTest, DestroyingSuspendedTaskFreesWholeChain) {
  auto r = MakeReactor();
  int live = 0;
  Event never;
  {
    Task<void> t = Parent(&live, &never);
    // Start it by hand and let it suspend on the event.
    r->Schedule(t.handle());
    while (r->RunOnce()) {
    }
    EXPECT_EQ(live, 2);
    EXPECT_FALSE(t.done());
  }  // destroy the suspended chain
  EXPECT_EQ(live, 0);
  // The waiter unlinked itself: setting the event must not touch freed memory.
  never.Set();
  r->RunOnce();
}

TEST(TaskTest, AwaitingFinishedTaskDoesNotSuspend) {
  auto r = MakeReactor();
  auto body = [](Reactor* r) -> Task<int> {
    Task<int> inner = Value(5);
    r->Schedule(inner.handle());  // run it to completion first
    co_await r->Yield();
    co_await r->Yield();
    if (!inner.done()) co_return -1;
    co_return co_await inner;
  };
  EXPECT_EQ(r->BlockOn(body(r.get())), 5);
}

Task<int> Deep(int n) {
  if (n == 0) co_return 0;
  int v = co_await Deep(n - 1);
  co_return v + 1;
}

TEST(TaskTest, MillionNestedAwaitsDoNotOverflowStack) {
  auto r = MakeReactor();
  EXPECT_EQ(r->BlockOn(Deep(1000000)), 1000000);
}

Task<int> Loop(int n) {
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += co_await Value(1);
  co_return sum;
}

TEST(TaskTest, MillionSequentialAwaits) {
  auto r = MakeReactor();
  EXPECT_EQ(r->BlockOn(Loop(1000000)), 1000000);
}

// SwapStopToken: what the coroutine awaits after the swap sees the new token,
// the old one comes back with a second swap, and the callers' tokens are
// untouched.
Task<bool> StopRequestedHere() {
  std::stop_token t = co_await CurrentStopToken();
  co_return t.stop_requested();
}
Task<std::string> SwapsAndRestores(std::stop_token narrow) {
  std::string seen;
  seen += (co_await StopRequestedHere()) ? "1" : "0";
  co_await internal::SwapStopToken{&narrow};
  seen += (co_await StopRequestedHere()) ? "1" : "0";
  co_await internal::SwapStopToken{&narrow};
  seen += (co_await StopRequestedHere()) ? "1" : "0";
  seen += narrow.stop_requested() ? "1" : "0";
  co_return seen;
}

TEST(TaskTest, SwapStopTokenReplacesTheAmbientTokenUntilSwappedBack) {
  auto r = MakeReactor();
  std::stop_source stopped;
  stopped.request_stop();
  // Ambient (BlockOn's) not stopped; the swapped-in one is.
  EXPECT_EQ(r->BlockOn(SwapsAndRestores(stopped.get_token())), "0101");
}

}  // namespace
}  // namespace coverbs
