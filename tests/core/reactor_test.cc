#include "core/reactor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor(ReactorOptions o = {}) {
  auto r = Reactor::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// Closes fds at scope end.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

Task<absl::StatusOr<uint32_t>> WaitReadable(Reactor* r, int fd) {
  co_return co_await r->WaitFd(fd, POLLIN);
}

TEST(ReactorTest, EventfdReadiness) {
  auto r = MakeReactor();
  Fd efd{eventfd(0, EFD_NONBLOCK)};
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    uint64_t one = 1;
    ASSERT_EQ(write(efd.fd, &one, 8), 8);
  });
  absl::StatusOr<uint32_t> ev = r->BlockOn(WaitReadable(r.get(), efd.fd));
  writer.join();
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_TRUE(*ev & POLLIN);
}

Task<std::string> EchoOverSocket(Reactor* r, int a, int b) {
  // b is not readable until a writes.
  const char msg[] = "ping";
  EXPECT_EQ(write(a, msg, 4), 4);
  auto ev = co_await r->WaitFd(b, POLLIN);
  if (!ev.ok()) co_return std::string(ev.status().message());
  char buf[8] = {};
  ssize_t n = read(b, buf, sizeof(buf));
  co_return std::string(buf, n > 0 ? n : 0);
}

TEST(ReactorTest, SocketPairReadiness) {
  auto r = MakeReactor();
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
  Fd a{sv[0]}, b{sv[1]};
  EXPECT_EQ(r->BlockOn(EchoOverSocket(r.get(), a.fd, b.fd)), "ping");
}

Task<void> SleepAndRecord(Reactor* r, absl::Duration d, int id,
                          std::vector<int>* order, WaitGroup* wg) {
  absl::Status s = co_await r->Sleep(d);
  EXPECT_TRUE(s.ok()) << s;
  order->push_back(id);
  wg->Done();
}

Task<void> WaitAll(WaitGroup* wg) {
  absl::Status s = co_await wg->Wait();
  EXPECT_TRUE(s.ok());
}

TEST(ReactorTest, TimersFireInDeadlineOrder) {
  auto r = MakeReactor();
  std::vector<int> order;
  WaitGroup wg;
  const int ms[] = {50, 10, 40, 0, 20, 30, 20};
  wg.Add(7);
  for (int i = 0; i < 7; ++i) {
    r->Spawn(SleepAndRecord(r.get(), absl::Milliseconds(ms[i]), i, &order, &wg));
  }
  absl::Time start = absl::Now();
  r->BlockOn(WaitAll(&wg));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  // Deadline order; equal deadlines (4 and 6: both 20 ms, armed in order) FIFO.
  EXPECT_EQ(order, (std::vector<int>{3, 1, 4, 6, 5, 2, 0}));
}

Task<void> Bump(int* counter) {
  ++*counter;
  co_return;
}

TEST(ReactorTest, MillionSpawnedTasksComplete) {
  auto r = MakeReactor();
  int counter = 0;
  for (int i = 0; i < 1000000; ++i) r->Spawn(Bump(&counter));
  auto drain = [](Reactor* r) -> Task<void> {
    while (r->spawned_alive() > 0) co_await r->Yield();
  };
  r->BlockOn(drain(r.get()));
  EXPECT_EQ(counter, 1000000);
  EXPECT_EQ(r->spawned_alive(), 0u);
}

TEST(ReactorTest, PostsFromTwoThreadsRunExactlyOnce) {
  auto r = MakeReactor();
  constexpr int kPerThread = 50000;
  std::vector<int> hits(2 * kPerThread, 0);  // touched only on the reactor
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        r->Post([&, idx = t * kPerThread + i] {
          ++hits[idx];
          if (ran.fetch_add(1) + 1 == 2 * kPerThread) r->Stop();
        });
      }
    });
  }
  r->Run();
  for (auto& t : threads) t.join();
  EXPECT_EQ(ran.load(), 2 * kPerThread);
  for (int h : hits) ASSERT_EQ(h, 1);
}

struct Sentinel {
  explicit Sentinel(std::atomic<int>* live) : live(live) { ++*live; }
  ~Sentinel() { --*live; }
  std::atomic<int>* live;
};

Task<void> ParkOnFd(std::atomic<int>* live, Reactor* r, int fd) {
  Sentinel s(live);
  auto ev = co_await r->WaitFd(fd, POLLIN);
  ADD_FAILURE() << "never-ready fd became ready";
}
Task<void> ParkOnSleep(std::atomic<int>* live, Reactor* r) {
  Sentinel s(live);
  absl::Status st = co_await r->Sleep(absl::Hours(1));
  ADD_FAILURE() << "slept an hour?";
}
Task<void> ParkOnEvent(std::atomic<int>* live, Event* e) {
  Sentinel s(live);
  absl::Status st = co_await e->Wait();
}

TEST(ReactorTest, DestroyWithSuspendedTasksFreesEverything) {
  std::atomic<int> live{0};
  Fd efd{eventfd(0, EFD_NONBLOCK)};
  Event never;
  {
    auto r = MakeReactor();
    for (int i = 0; i < 100; ++i) {
      r->Spawn(ParkOnFd(&live, r.get(), efd.fd));
      r->Spawn(ParkOnSleep(&live, r.get()));
      r->Spawn(ParkOnEvent(&live, &never));
    }
    while (r->RunOnce()) {
    }
    EXPECT_EQ(live.load(), 300);
    EXPECT_EQ(r->spawned_alive(), 300u);
    r->Stop();
  }  // ASan reports any leaked frame; the sentinels show they were destroyed.
  EXPECT_EQ(live.load(), 0);
  never.Set();  // waiters unlinked themselves: no use-after-free here
}

Task<absl::Status> SleepLong(Reactor* r) { co_return co_await r->Sleep(absl::Hours(1)); }

TEST(ReactorTest, CancelSleep) {
  auto r = MakeReactor();
  std::stop_source src;
  absl::Status result = absl::UnknownError("not run");
  auto body = [](Reactor* r, absl::Status* out) -> Task<void> {
    *out = co_await SleepLong(r);
  };
  r->Spawn(body(r.get(), &result), src.get_token());
  while (r->RunOnce()) {
  }
  src.request_stop();
  while (r->RunOnce()) {
  }
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
  EXPECT_EQ(r->spawned_alive(), 0u);
}

TEST(ReactorTest, CancelFdWaitFromAnotherThread) {
  auto r = MakeReactor();
  Fd efd{eventfd(0, EFD_NONBLOCK)};
  std::stop_source src;
  absl::StatusOr<uint32_t> result = 0u;
  auto body = [](Reactor* r, int fd, absl::StatusOr<uint32_t>* out) -> Task<void> {
    *out = co_await r->WaitFd(fd, POLLIN);
    r->Stop();
  };
  r->Spawn(body(r.get(), efd.fd, &result), src.get_token());
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    src.request_stop();
  });
  r->Run();
  canceller.join();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled) << result.status();
}

TEST(ReactorTest, WithTimeoutOnNeverReadyFd) {
  auto r = MakeReactor();
  Fd efd{eventfd(0, EFD_NONBLOCK)};
  absl::StatusOr<uint32_t> inner = 0u;
  auto wait = [](Reactor* r, int fd, absl::StatusOr<uint32_t>* inner)
      -> Task<absl::StatusOr<uint32_t>> {
    *inner = co_await r->WaitFd(fd, POLLIN);
    co_return *inner;
  };
  absl::Time start = absl::Now();
  absl::StatusOr<uint32_t> got = r->BlockOn(
      WithTimeout(wait(r.get(), efd.fd, &inner), absl::Milliseconds(30)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded)
      << got.status();
  // The wait itself was cancelled, not leaked.
  EXPECT_EQ(inner.status().code(), absl::StatusCode::kCancelled);
  // The reactor keeps working: a fd wait and a sleep still complete.
  uint64_t one = 1;
  ASSERT_EQ(write(efd.fd, &one, 8), 8);
  absl::StatusOr<uint32_t> ev = r->BlockOn(WaitReadable(r.get(), efd.fd));
  EXPECT_TRUE(ev.ok());
  absl::Status again =
      r->BlockOn(WithTimeout(SleepLong(r.get()), absl::Milliseconds(1)));
  EXPECT_EQ(again.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(ReactorTest, WithTimeoutPassesResultThrough) {
  auto r = MakeReactor();
  auto quick = [](Reactor* r) -> Task<absl::StatusOr<int>> {
    absl::Status s = co_await r->Sleep(absl::Milliseconds(1));
    if (!s.ok()) co_return s;
    co_return 42;
  };
  absl::StatusOr<int> v =
      r->BlockOn(WithTimeout(quick(r.get()), absl::Seconds(10)));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 42);
  EXPECT_FALSE(r->NextDeadline().has_value());  // the deadline timer is gone
}

TEST(ReactorTest, RunOnceDoesNotBlock) {
  auto r = MakeReactor();
  absl::Time start = absl::Now();
  EXPECT_FALSE(r->RunOnce());
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(ReactorTest, YieldRunsBehindReadyWork) {
  auto r = MakeReactor();
  std::vector<int> order;
  auto a = [](Reactor* r, std::vector<int>* o) -> Task<void> {
    o->push_back(1);
    co_await r->Yield();
    o->push_back(3);
  };
  auto b = [](std::vector<int>* o) -> Task<void> {
    o->push_back(2);
    co_return;
  };
  r->Spawn(a(r.get(), &order));
  r->Spawn(b(&order));
  while (r->RunOnce()) {
  }
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

// A poller that pretends to have work in flight and counts how it is driven.
class FakePoller : public Poller {
 public:
  int Poll() override {
    ++polls;
    return 0;
  }
  bool InFlight() const override { return in_flight; }
  bool PrepareToSleep() override {
    ++arms;
    return true;
  }
  std::atomic<int> polls{0};
  std::atomic<int> arms{0};
  bool in_flight = true;
};

double ThreadCpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// Runs the reactor on a thread for `d` and returns the CPU it used.
double RunFor(Reactor* r, absl::Duration d) {
  double cpu = 0;
  std::thread t([&] {
    double start = ThreadCpuSeconds();
    r->Run();
    cpu = ThreadCpuSeconds() - start;
  });
  absl::SleepFor(d);
  r->Stop();
  t.join();
  return cpu;
}

TEST(ReactorTest, EventModeIdlesWithoutPolling) {
  ReactorOptions o;
  o.poll_mode = PollMode::kEvent;
  auto r = MakeReactor(o);
  FakePoller p;
  r->AddPoller(&p);
  double cpu = RunFor(r.get(), absl::Milliseconds(300));
  EXPECT_EQ(p.polls.load(), 0);  // event mode never spins on pollers
  EXPECT_GE(p.arms.load(), 1);   // but arms them before sleeping
  EXPECT_LT(cpu, 0.1) << "idle reactor burned CPU";
  r->RemovePoller(&p);
}

TEST(ReactorTest, AdaptiveSpinsWhileInFlightThenSleeps) {
  ReactorOptions o;
  o.poll_mode = PollMode::kAdaptive;
  o.adaptive_spin = absl::Milliseconds(20);
  auto r = MakeReactor(o);
  FakePoller p;
  r->AddPoller(&p);
  double cpu = RunFor(r.get(), absl::Milliseconds(300));
  // It spun (many polls) for about the spin budget, then armed and slept:
  // far less CPU than the 300 ms it was running.
  EXPECT_GT(p.polls.load(), 10);
  EXPECT_GE(p.arms.load(), 1);
  EXPECT_LT(cpu, 0.2);
  r->RemovePoller(&p);
}

TEST(ReactorTest, AdaptiveIdleWithNothingInFlight) {
  ReactorOptions o;
  o.poll_mode = PollMode::kAdaptive;
  auto r = MakeReactor(o);
  FakePoller p;
  p.in_flight = false;
  r->AddPoller(&p);
  double cpu = RunFor(r.get(), absl::Milliseconds(300));
  EXPECT_LT(p.polls.load(), 10);
  EXPECT_LT(cpu, 0.1);
  r->RemovePoller(&p);
}

TEST(ReactorTest, BusyModeSpins) {
  ReactorOptions o;
  o.poll_mode = PollMode::kBusy;
  auto r = MakeReactor(o);
  FakePoller p;
  r->AddPoller(&p);
  RunFor(r.get(), absl::Milliseconds(100));
  EXPECT_GT(p.polls.load(), 1000);
  EXPECT_EQ(p.arms.load(), 0);  // never sleeps
  r->RemovePoller(&p);
}

// Sleeps for `d`, then notes `id` in `order`; `early` if it woke before
// its deadline.
Task<void> NoteAfter(Reactor* r, absl::Duration d, int id,
                     std::vector<int>* order, bool* early) {
  SteadyTime due = SteadyAfter(d);
  absl::Status s = co_await r->Sleep(d);
  EXPECT_TRUE(s.ok()) << "sleeper " << id << ": " << s;
  if (SteadyNow() < due) *early = true;
  order->push_back(id);
}

// A spinning reactor reads the clock only once its io_uring alarm rang
// (FireTimers): timers still fire, never early, in deadline order -- also
// one added after a later one was armed (the alarm moves earlier), and
// ones added while the alarm of a cancelled timer is still pending.
TEST(ReactorTest, BusyModeTimersFireInOrderNeverEarly) {
  ReactorOptions o;
  o.poll_mode = PollMode::kBusy;
  auto r = MakeReactor(o);
  std::vector<int> order;
  bool early = false;
  absl::Status cancelled = absl::UnknownError("not run");
  auto cancellable = [](Reactor* r, absl::Status* out) -> Task<void> {
    *out = co_await r->Sleep(absl::Milliseconds(10));
  };
  auto driver = [&]() -> Task<void> {
    Reactor* rp = r.get();
    rp->Spawn(NoteAfter(rp, absl::Milliseconds(300), 3, &order, &early));
    co_await rp->Yield();
    co_await rp->Yield();  // armed, and the alarm for it
    std::stop_source stop;
    rp->Spawn(cancellable(rp, &cancelled), stop.get_token());
    co_await rp->Yield();
    co_await rp->Yield();  // the alarm moved to its 10 ms
    stop.request_stop();   // gone; that alarm stays pending
    co_await rp->Yield();
    rp->Spawn(NoteAfter(rp, absl::Milliseconds(20), 1, &order, &early));
    rp->Spawn(NoteAfter(rp, absl::Milliseconds(100), 2, &order, &early));
    SteadyTime give_up = SteadyAfter(absl::Seconds(20));
    while (order.size() < 3 && SteadyNow() < give_up) co_await rp->Yield();
  };
  r->BlockOn(driver());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_FALSE(early);
  EXPECT_TRUE(absl::IsCancelled(cancelled)) << cancelled;
}

// Counts BeginIteration / EndIteration and checks that they nest.
class IterationPoller : public Poller {
 public:
  int Poll() override { return 0; }
  bool InFlight() const override { return false; }
  bool PrepareToSleep() override { return true; }
  void BeginIteration() override {
    ++open;
    ++begins;
  }
  void EndIteration() override {
    if (--open < 0) negative = true;
  }
  int open = 0;
  int begins = 0;
  bool negative = false;
};

// Every iteration is bracketed, and a poller added or removed inside one
// gets the missing half, so a provider holding back work for the bracket
// always sees its end.
TEST(ReactorTest, IterationBracketsStayPaired) {
  auto r = MakeReactor();
  IterationPoller stays, added, removed;
  r->AddPoller(&stays);
  r->AddPoller(&removed);
  auto task = [](Reactor* r, IterationPoller* added,
                 IterationPoller* removed) -> Task<void> {
    r->AddPoller(added);
    r->RemovePoller(removed);
    co_await r->Yield();
    r->RemovePoller(added);
  };
  r->Spawn(task(r.get(), &added, &removed));
  while (r->RunOnce()) {
  }
  EXPECT_GE(stays.begins, 2);
  EXPECT_EQ(stays.open, 0);
  EXPECT_GE(added.begins, 1);
  EXPECT_EQ(added.open, 0);
  EXPECT_GE(removed.begins, 1);
  EXPECT_EQ(removed.open, 0);
  EXPECT_FALSE(stays.negative || added.negative || removed.negative);
  r->RemovePoller(&stays);
}

TEST(ReactorTest, ParsePollMode) {
  EXPECT_EQ(*ParsePollMode("busy"), PollMode::kBusy);
  EXPECT_EQ(*ParsePollMode("adaptive"), PollMode::kAdaptive);
  EXPECT_EQ(*ParsePollMode("event"), PollMode::kEvent);
  EXPECT_FALSE(ParsePollMode("spin").ok());
}

}  // namespace
}  // namespace coverbs
