// ForEachBounded: never more than `limit` tasks at once, results in index
// order, tasks made in order as slots free, failures do not stop the rest,
// the caller's cancellation reaches every task.
#include "core/bounded.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "core/reactor.h"
#include "core/timeout.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

struct Gauge {
  int running = 0;
  int max = 0;
  std::vector<size_t> made;
};

// Holds its slot for a varying time, so that slots free out of order.
Task<absl::StatusOr<size_t>> Work(Gauge* g, size_t i) {
  g->max = std::max(g->max, ++g->running);
  absl::Status s = co_await Reactor::Current()->Sleep(
      absl::Microseconds(200 * ((i * 7) % 5)));
  --g->running;
  if (!s.ok()) co_return s;
  if (i % 10 == 3) co_return absl::NotFoundError("no " + std::to_string(i));
  co_return i* i;
}

TEST(ForEachBoundedTest, AtMostLimitAtOnceResultsInOrder) {
  auto r = MakeReactor();
  Gauge g;
  auto out = r->BlockOn(ForEachBounded(60, 4, [&g](size_t i) {
    g.made.push_back(i);
    return Work(&g, i);
  }));
  ASSERT_EQ(out.size(), 60u);
  EXPECT_EQ(g.max, 4);
  EXPECT_EQ(g.running, 0);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(g.made[i], i);
    if (i % 10 == 3) {
      EXPECT_EQ(out[i].status().code(), absl::StatusCode::kNotFound);
    } else {
      ASSERT_TRUE(out[i].ok()) << i;
      EXPECT_EQ(*out[i], i * i);
    }
  }
}

TEST(ForEachBoundedTest, EdgeLimitsAndVoidTasks) {
  auto r = MakeReactor();
  Gauge g;
  auto none =
      r->BlockOn(ForEachBounded(0, 8, [&g](size_t i) { return Work(&g, i); }));
  EXPECT_TRUE(none.empty());
  auto one_at_a_time =
      r->BlockOn(ForEachBounded(5, 0, [&g](size_t i) { return Work(&g, i); }));
  EXPECT_EQ(one_at_a_time.size(), 5u);
  EXPECT_EQ(g.max, 1);
  int ran = 0;
  r->BlockOn(ForEachBounded(7, 100, [&ran](size_t) -> Task<void> {
    ++ran;
    co_return;
  }));
  EXPECT_EQ(ran, 7);
}

TEST(ForEachBoundedTest, CancellingTheCallerStopsEveryTask) {
  auto r = MakeReactor();
  int stopped = 0;
  auto all = [&stopped]() -> Task<absl::Status> {
    auto out = co_await ForEachBounded(20, 5, [&stopped](size_t) -> Task<int> {
      absl::Status s = co_await Reactor::Current()->Sleep(absl::Seconds(30));
      if (!s.ok()) ++stopped;
      co_return 0;
    });
    co_return out.size() == 20 ? absl::OkStatus()
                               : absl::InternalError("results lost");
  };
  const absl::Time start = absl::Now();
  (void)r->BlockOn(WithTimeout(all(), absl::Milliseconds(50)));
  EXPECT_EQ(stopped, 20);  // the 5 running and the 15 made after the stop
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

}  // namespace
}  // namespace coverbs
