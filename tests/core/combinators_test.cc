// WhenAll / WhenAny, Spawn + JoinHandle, and the CO_* status macros.
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "core/join.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/status_macros.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "core/when.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

Task<int> SleepThen(absl::Duration d, int v) {
  absl::Status s = co_await Reactor::Current()->Sleep(d);
  co_return s.ok() ? v : -1;
}

Task<absl::Status> SleepStatus(absl::Duration d) {
  co_return co_await Reactor::Current()->Sleep(d);
}

Task<int> Now(int v) { co_return v; }

Task<void> Nothing() { co_return; }

TEST(WhenAllTest, RunsConcurrentlyAndKeepsArgumentOrder) {
  auto r = MakeReactor();
  absl::Time start = absl::Now();
  auto [a, b, c, d] = r->BlockOn(WhenAll(SleepThen(absl::Milliseconds(60), 1),
                                         SleepThen(absl::Milliseconds(30), 2),
                                         Now(3), Nothing()));
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 2);
  EXPECT_EQ(c, 3);
  EXPECT_EQ(d, std::monostate{});
  // Concurrent: not 60 + 30 ms (generous bound for loaded machines).
  EXPECT_LT(took, absl::Milliseconds(85 + 500));
  EXPECT_GE(took, absl::Milliseconds(59));
}

TEST(WhenAllTest, AllSynchronousNeverSuspends) {
  auto r = MakeReactor();
  std::vector<Task<int>> v;
  for (int i = 0; i < 100; ++i) v.push_back(Now(i));
  std::vector<int> out = r->BlockOn(WhenAll(std::move(v)));
  ASSERT_EQ(out.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(out[i], i);
  std::vector<Task<int>> empty;
  EXPECT_TRUE(r->BlockOn(WhenAll(std::move(empty))).empty());
}

TEST(WhenAllTest, VoidVectorAndCancellationReachesEveryTask) {
  auto r = MakeReactor();
  std::vector<Task<void>> voids;
  int ran = 0;
  auto bump = [](int* n) -> Task<void> {
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(1));
    ++*n;
  };
  for (int i = 0; i < 10; ++i) voids.push_back(bump(&ran));
  r->BlockOn(WhenAll(std::move(voids)));
  EXPECT_EQ(ran, 10);

  // A timeout on the caller cancels all children, and WhenAll waits for
  // them: each one reports Cancelled.
  auto all = []() -> Task<absl::StatusOr<std::vector<absl::Status>>> {
    std::vector<Task<absl::Status>> v;
    for (int i = 0; i < 5; ++i) v.push_back(SleepStatus(absl::Seconds(30)));
    co_return co_await WhenAll(std::move(v));
  };
  absl::Time start = absl::Now();
  absl::StatusOr<std::vector<absl::Status>> got =
      r->BlockOn(WithTimeout(all(), absl::Milliseconds(20)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // all() itself finished (with five Cancelled results), so WithTimeout
  // reports its value rather than DeadlineExceeded.
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 5u);
  for (const absl::Status& s : *got) EXPECT_TRUE(absl::IsCancelled(s)) << s;
}

TEST(WhenAnyTest, FirstWinsAndTheOthersAreStoppedBeforeItReturns) {
  auto r = MakeReactor();
  int unwound = 0;
  auto slow = [](int* unwound) -> Task<absl::Status> {
    absl::Status s = co_await Reactor::Current()->Sleep(absl::Seconds(30));
    if (absl::IsCancelled(s)) ++*unwound;
    co_return s;
  };
  std::vector<Task<absl::Status>> v;
  v.push_back(slow(&unwound));
  v.push_back(SleepStatus(absl::Milliseconds(10)));
  v.push_back(slow(&unwound));
  absl::Time start = absl::Now();
  WhenAnyResult<absl::Status> first = r->BlockOn(WhenAny(std::move(v)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(first.index, 1u);
  EXPECT_TRUE(first.value.ok());
  EXPECT_EQ(unwound, 2);  // both losers finished before WhenAny returned
  EXPECT_EQ(r->spawned_alive(), 0u);

  auto w = r->BlockOn(WhenAny(Now(5), SleepThen(absl::Seconds(30), 6)));
  EXPECT_EQ(w.index, 0u);
  EXPECT_EQ(w.value, 5);
}

TEST(JoinTest, JoinsAcrossReactorThreads) {
  auto pool = ReactorPool::Create(2);
  ASSERT_TRUE(pool.ok());
  auto r = MakeReactor();
  auto work = [](int v) -> Task<absl::StatusOr<int>> {
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(5));
    co_return v * 2;
  };
  JoinHandle<absl::StatusOr<int>> h1 = Spawn((*pool)->reactor(0), work(21));
  JoinHandle<absl::StatusOr<int>> h2 = Spawn((*pool)->reactor(1), work(50));
  JoinHandle<int> h3 = Spawn((*pool)->reactor(1), Now(7));
  JoinHandle<void> h4 = Spawn((*pool)->reactor(0), Nothing());
  auto joiner = [](JoinHandle<absl::StatusOr<int>> a,
                   JoinHandle<absl::StatusOr<int>> b, JoinHandle<int> c,
                   JoinHandle<void> d) -> Task<int> {
    absl::StatusOr<int> x = co_await a.Join();
    absl::StatusOr<int> y = co_await b.Join();
    absl::StatusOr<int> z = co_await c.Join();
    absl::Status w = co_await d.Join();
    co_return (x.ok() && y.ok() && z.ok() && w.ok()) ? *x + *y + *z : -1;
  };
  EXPECT_EQ(r->BlockOn(joiner(std::move(h1), std::move(h2), std::move(h3),
                              std::move(h4))),
            42 + 100 + 7);
}

TEST(JoinTest, CancellingTheJoinerStopsTheTaskAndWaitsForIt) {
  auto r = MakeReactor();
  bool unwound = false;
  auto slow = [](bool* unwound) -> Task<absl::Status> {
    absl::Status s = co_await Reactor::Current()->Sleep(absl::Seconds(30));
    *unwound = true;
    co_return s;
  };
  JoinHandle<absl::Status> h = Spawn(*r, slow(&unwound));
  auto join = [](JoinHandle<absl::Status> h) -> Task<absl::Status> {
    co_return co_await h.Join();
  };
  absl::Time start = absl::Now();
  absl::Status s =
      r->BlockOn(WithTimeout(join(std::move(h)), absl::Milliseconds(20)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The task itself reported Cancelled, which the timeout reports as such.
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(unwound);
}

TEST(JoinTest, TaskWhoseReactorIsDestroyedJoinsAsAborted) {
  auto joiner_reactor = MakeReactor();
  auto r = MakeReactor();
  Event never;
  auto wait = [](Event* e) -> Task<absl::Status> {
    co_return co_await e->Wait();
  };
  JoinHandle<absl::Status> h = Spawn(*r, wait(&never));
  while (r->RunOnce()) {
  }
  EXPECT_FALSE(h.done());
  r.reset();  // the task's frame is destroyed while suspended
  EXPECT_TRUE(h.done());
  auto join = [](JoinHandle<absl::Status> h) -> Task<absl::Status> {
    co_return co_await h.Join();
  };
  absl::Status s = joiner_reactor->BlockOn(join(std::move(h)));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
}

TEST(JoinTest, HandleDroppedLeavesTheTaskRunning) {
  auto r = MakeReactor();
  int ran = 0;
  auto bump = [](int* n) -> Task<void> {
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(1));
    ++*n;
  };
  { JoinHandle<void> h = Spawn(*r, bump(&ran)); }
  EXPECT_TRUE(r->BlockOn(SleepStatus(absl::Milliseconds(20))).ok());
  EXPECT_EQ(ran, 1);
}

// --- CO_RETURN_IF_ERROR / CO_ASSIGN_OR_RETURN.

Task<absl::StatusOr<int>> Parse(std::string s) {
  if (s.empty()) co_return absl::InvalidArgumentError("empty");
  co_return static_cast<int>(s.size());
}

Task<absl::Status> Check(bool ok) {
  co_return ok ? absl::OkStatus() : absl::FailedPreconditionError("not ok");
}

Task<absl::StatusOr<int>> Sum(std::string a, std::string b, bool check) {
  CO_ASSIGN_OR_RETURN(int x, co_await Parse(a));
  CO_ASSIGN_OR_RETURN(const int y, co_await Parse(b));
  CO_RETURN_IF_ERROR(co_await Check(check));
  int z = 0;
  CO_ASSIGN_OR_RETURN(z, co_await Parse("zz"));
  co_return x + y + z;
}

Task<absl::Status> StatusOnly(std::string a) {
  CO_RETURN_IF_ERROR(co_await Parse(a));  // a StatusOr in a Status coroutine
  co_return absl::OkStatus();
}

TEST(StatusMacrosTest, ReturnTheFirstErrorOrTheValue) {
  auto r = MakeReactor();
  EXPECT_EQ(*r->BlockOn(Sum("ab", "c", true)), 2 + 1 + 2);
  absl::StatusOr<int> bad = r->BlockOn(Sum("ab", "", true));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r->BlockOn(Sum("a", "b", false)).status().message(), "not ok");
  EXPECT_TRUE(r->BlockOn(StatusOnly("x")).ok());
  EXPECT_EQ(r->BlockOn(StatusOnly("")).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace coverbs
