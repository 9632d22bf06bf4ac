#include "core/sync.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/timeout.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

void Drain(Reactor* r) {
  while (r->RunOnce()) {
  }
}

TEST(EventTest, WakesAllWaitersAndStaysSet) {
  auto r = MakeReactor();
  Event e;
  int woken = 0;
  auto waiter = [](Event* e, int* woken) -> Task<void> {
    absl::Status s = co_await e->Wait();
    EXPECT_TRUE(s.ok());
    ++*woken;
  };
  for (int i = 0; i < 5; ++i) r->Spawn(waiter(&e, &woken));
  Drain(r.get());
  EXPECT_EQ(woken, 0);
  e.Set();
  Drain(r.get());
  EXPECT_EQ(woken, 5);
  r->Spawn(waiter(&e, &woken));  // already set: no suspension
  Drain(r.get());
  EXPECT_EQ(woken, 6);
  e.Reset();
  r->Spawn(waiter(&e, &woken));
  Drain(r.get());
  EXPECT_EQ(woken, 6);
  e.Set();
  Drain(r.get());
  EXPECT_EQ(woken, 7);
}

TEST(EventTest, WaitForTimesOutOrSeesTheSet) {
  auto r = MakeReactor();
  Event e;
  absl::Status s = r->BlockOn(e.WaitFor(absl::Milliseconds(10)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // Set meanwhile, from another waiter's turn: OK well before the limit.
  r->Spawn([](Event* e) -> Task<void> {
    e->Set();
    co_return;
  }(&e));
  s = r->BlockOn(e.WaitFor(absl::Seconds(10)));
  EXPECT_TRUE(s.ok()) << s;
}

TEST(EventTest, WaitCancelled) {
  auto r = MakeReactor();
  Event e;
  std::stop_source src;
  absl::Status got;
  auto waiter = [](Event* e, absl::Status* got) -> Task<void> {
    *got = co_await e->Wait();
  };
  r->Spawn(waiter(&e, &got), src.get_token());
  Drain(r.get());
  src.request_stop();
  Drain(r.get());
  EXPECT_EQ(got.code(), absl::StatusCode::kCancelled);
  e.Set();  // the cancelled waiter is gone
  Drain(r.get());
}

TEST(EventTest, CrossReactorSet) {
  auto pool = ReactorPool::Create(2);
  ASSERT_TRUE(pool.ok());
  Event e;
  std::atomic<bool> woke{false};
  std::atomic<std::thread::id> waiter_thread{};
  Event done;
  auto waiter = [](Event* e, std::atomic<bool>* woke,
                   std::atomic<std::thread::id>* tid) -> Task<void> {
    std::thread::id before = std::this_thread::get_id();
    absl::Status s = co_await e->Wait();
    EXPECT_TRUE(s.ok());
    // Resumed on its own reactor's thread, not the setter's.
    EXPECT_EQ(std::this_thread::get_id(), before);
    tid->store(before);
    *woke = true;
  };
  (*pool)->Spawn(0, waiter(&e, &woke, &waiter_thread));
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  (*pool)->Post(1, [&e] { e.Set(); });
  for (int i = 0; i < 2000 && !woke; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(woke.load());
  (*pool)->Stop();
}

TEST(SemaphoreTest, BoundsConcurrencyAcrossReactors) {
  constexpr int kPermits = 3;
  constexpr int kTasks = 400;
  auto pool = ReactorPool::Create(2);
  ASSERT_TRUE(pool.ok());
  Semaphore sem(kPermits);
  std::atomic<int> inside{0}, max_inside{0}, finished{0};
  auto worker = [](Reactor* r, Semaphore* sem, std::atomic<int>* inside,
                   std::atomic<int>* max_inside,
                   std::atomic<int>* finished) -> Task<void> {
    absl::Status s = co_await sem->Acquire();
    EXPECT_TRUE(s.ok());
    int now = inside->fetch_add(1) + 1;
    int prev = max_inside->load();
    while (now > prev && !max_inside->compare_exchange_weak(prev, now)) {
    }
    co_await r->Yield();
    inside->fetch_sub(1);
    sem->Release();
    finished->fetch_add(1);
  };
  for (int i = 0; i < kTasks; ++i) {
    size_t k = i % 2;
    (*pool)->Spawn(k, worker(&(*pool)->reactor(k), &sem, &inside, &max_inside,
                             &finished));
  }
  for (int i = 0; i < 10000 && finished < kTasks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (*pool)->Stop();
  EXPECT_EQ(finished.load(), kTasks);
  EXPECT_LE(max_inside.load(), kPermits);
  EXPECT_GE(max_inside.load(), 1);
  EXPECT_EQ(sem.available(), static_cast<size_t>(kPermits));
}

TEST(SemaphoreTest, FifoLargeRequestNotOvertaken) {
  auto r = MakeReactor();
  Semaphore sem(0);
  std::vector<int> order;
  auto acq = [](Semaphore* s, size_t n, int id,
                std::vector<int>* order) -> Task<void> {
    absl::Status st = co_await s->Acquire(n);
    EXPECT_TRUE(st.ok());
    order->push_back(id);
  };
  r->Spawn(acq(&sem, 3, 1, &order));
  r->Spawn(acq(&sem, 1, 2, &order));
  Drain(r.get());
  sem.Release(1);  // not enough for the head (3): nobody runs
  Drain(r.get());
  EXPECT_TRUE(order.empty());
  sem.Release(3);  // head gets 3, then the next gets 1
  Drain(r.get());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_EQ(sem.available(), 0u);
}

TEST(SemaphoreTest, CancelledHeadUnblocksOthers) {
  auto r = MakeReactor();
  Semaphore sem(1);
  std::stop_source src;
  absl::Status big, small;
  auto acq = [](Semaphore* s, size_t n, absl::Status* out) -> Task<void> {
    *out = co_await s->Acquire(n);
  };
  r->Spawn(acq(&sem, 5, &big), src.get_token());
  r->Spawn(acq(&sem, 1, &small));
  Drain(r.get());
  EXPECT_EQ(sem.waiters(), 2u);
  src.request_stop();
  Drain(r.get());
  EXPECT_EQ(big.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(small.ok());
  EXPECT_EQ(sem.available(), 0u);
}

TEST(SemaphoreTest, AcquireWithTimeout) {
  auto r = MakeReactor();
  Semaphore sem(0);
  auto acq = [](Semaphore* s) -> Task<absl::Status> {
    co_return co_await s->Acquire();
  };
  absl::Status s = r->BlockOn(WithTimeout(acq(&sem), absl::Milliseconds(10)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(sem.waiters(), 0u);
}

// TryAcquire and Release skip the lock while nobody waits; a parked waiter
// must still be served first, and once it is gone (here its frame is
// destroyed with its reactor) the fast path must come back.
TEST(SemaphoreTest, TryAcquireNeverOvertakesAWaiterAndRecoversAfterIt) {
  Semaphore sem(1);
  {
    auto r = MakeReactor();
    auto acq = [](Semaphore* s) -> Task<void> { (void)co_await s->Acquire(2); };
    r->Spawn(acq(&sem));
    Drain(r.get());
    EXPECT_EQ(sem.waiters(), 1u);
    EXPECT_FALSE(sem.TryAcquire(1));  // the waiter (2) is first in line
    EXPECT_EQ(sem.available(), 1u);
  }  // reactor and parked frame destroyed
  EXPECT_EQ(sem.waiters(), 0u);
  EXPECT_TRUE(sem.TryAcquire(1));
  sem.Release(1);
  EXPECT_EQ(sem.available(), 1u);
}

// Releases from plain threads race waiters parking on two reactors: a
// release that lands between a waiter's failed try and its parking must
// not be lost (the test would hang up to its bound and fail).
TEST(SemaphoreTest, ReleasesFromOtherThreadsRacingParkingWaiters) {
  constexpr int kTasks = 2000;
  auto pool = ReactorPool::Create(2);
  ASSERT_TRUE(pool.ok());
  Semaphore sem(0);
  std::atomic<int> finished{0};
  auto acq = [](Semaphore* s, std::atomic<int>* finished) -> Task<void> {
    EXPECT_TRUE((co_await s->Acquire()).ok());
    finished->fetch_add(1);
  };
  for (int i = 0; i < kTasks; ++i) (*pool)->Spawn(i % 2, acq(&sem, &finished));
  std::vector<std::thread> releasers;
  for (int t = 0; t < 2; ++t) {
    releasers.emplace_back([&sem] {
      for (int i = 0; i < kTasks / 2; ++i) sem.Release();
    });
  }
  for (auto& t : releasers) t.join();
  for (int i = 0; i < 10000 && finished < kTasks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (*pool)->Stop();
  EXPECT_EQ(finished.load(), kTasks);
  EXPECT_EQ(sem.available(), 0u);
  EXPECT_EQ(sem.waiters(), 0u);
}

// Done() from other threads while the waiter parks, many rounds.
TEST(WaitGroupTest, DoneFromOtherThreadsWakesTheWaiter) {
  auto r = MakeReactor();
  for (int round = 0; round < 200; ++round) {
    WaitGroup wg;
    wg.Add(2);
    std::vector<std::thread> ts;
    for (int t = 0; t < 2; ++t) ts.emplace_back([&wg] { wg.Done(); });
    auto wait = [](WaitGroup* wg) -> Task<absl::Status> {
      co_return co_await wg->Wait();
    };
    absl::Status s =
        r->BlockOn(WithTimeout(wait(&wg), absl::Seconds(10)));
    for (auto& t : ts) t.join();
    ASSERT_TRUE(s.ok()) << "round " << round << ": " << s;
    EXPECT_EQ(wg.count(), 0u);
  }
}

TEST(WaitGroupTest, WaitsForAll) {
  auto r = MakeReactor();
  WaitGroup wg;
  bool done = false;
  wg.Add(3);
  auto waiter = [](WaitGroup* wg, bool* done) -> Task<void> {
    EXPECT_TRUE((co_await wg->Wait()).ok());
    *done = true;
  };
  r->Spawn(waiter(&wg, &done));
  Drain(r.get());
  wg.Done();
  wg.Done();
  Drain(r.get());
  EXPECT_FALSE(done);
  wg.Done();
  Drain(r.get());
  EXPECT_TRUE(done);
}

TEST(ChannelTest, ProducersConsumersAcrossReactors) {
  constexpr int kPerProducer = 20000;
  auto pool = ReactorPool::Create(2);
  ASSERT_TRUE(pool.ok());
  Channel<std::pair<int, int>> ch(8);
  std::atomic<int> received{0};
  std::atomic<bool> order_ok{true};
  WaitGroup consumers_done;
  auto producer = [](Channel<std::pair<int, int>>* ch, int id) -> Task<void> {
    for (int i = 0; i < kPerProducer; ++i) {
      absl::Status s = co_await ch->Send({id, i});
      EXPECT_TRUE(s.ok()) << s;
    }
  };
  // One consumer: per producer, values must arrive in order.
  auto consumer = [](Channel<std::pair<int, int>>* ch, std::atomic<int>* n,
                     std::atomic<bool>* ok) -> Task<void> {
    int next[2] = {0, 0};
    for (;;) {
      absl::StatusOr<std::pair<int, int>> v = co_await ch->Recv();
      if (!v.ok()) {
        EXPECT_EQ(v.status().code(), absl::StatusCode::kOutOfRange);
        break;
      }
      if (v->second != next[v->first]) *ok = false;
      next[v->first] = v->second + 1;
      ++*n;
    }
  };
  (*pool)->Spawn(0, consumer(&ch, &received, &order_ok));
  (*pool)->Spawn(1, producer(&ch, 0));
  (*pool)->Spawn(0, producer(&ch, 1));
  for (int i = 0; i < 20000 && received < 2 * kPerProducer; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ch.Close();
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  (*pool)->Stop();
  EXPECT_EQ(received.load(), 2 * kPerProducer);
  EXPECT_TRUE(order_ok.load());
}

TEST(ChannelTest, CloseWakesWaitersAndDrains) {
  auto r = MakeReactor();
  Channel<int> ch(2);
  int a = 1, b = 2;
  ASSERT_TRUE(ch.TrySend(a));
  ASSERT_TRUE(ch.TrySend(b));
  int c = 3;
  EXPECT_FALSE(ch.TrySend(c));  // full
  absl::Status blocked_send;
  auto sender = [](Channel<int>* ch, absl::Status* out) -> Task<void> {
    *out = co_await ch->Send(99);
  };
  r->Spawn(sender(&ch, &blocked_send));
  Drain(r.get());
  ch.Close();
  Drain(r.get());
  EXPECT_EQ(blocked_send.code(), absl::StatusCode::kFailedPrecondition);
  // Buffered values are still delivered, then OutOfRange.
  auto recv_all = [](Channel<int>* ch) -> Task<std::vector<int>> {
    std::vector<int> got;
    for (;;) {
      auto v = co_await ch->Recv();
      if (!v.ok()) break;
      got.push_back(*v);
    }
    co_return got;
  };
  EXPECT_EQ(r->BlockOn(recv_all(&ch)), (std::vector<int>{1, 2}));
}

TEST(ChannelTest, RecvCancelled) {
  auto r = MakeReactor();
  Channel<int> ch(1);
  auto recv = [](Channel<int>* ch) -> Task<absl::StatusOr<int>> {
    co_return co_await ch->Recv();
  };
  absl::StatusOr<int> v =
      r->BlockOn(WithTimeout(recv(&ch), absl::Milliseconds(5)));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  int x = 5;
  EXPECT_TRUE(ch.TrySend(x));  // no stale receiver swallowed it
  EXPECT_EQ(ch.TryRecv(), 5);
}

TEST(ReactorPoolTest, ReactorsRunOnDistinctThreads) {
  auto pool = ReactorPool::Create(3);
  ASSERT_TRUE(pool.ok());
  std::mutex mu;
  std::vector<std::thread::id> ids;
  std::atomic<int> n{0};
  for (size_t i = 0; i < 3; ++i) {
    (*pool)->Post(i, [&, i] {
      EXPECT_EQ(Reactor::Current(), &(*pool)->reactor(i));
      std::lock_guard<std::mutex> l(mu);
      ids.push_back(std::this_thread::get_id());
      ++n;
    });
  }
  for (int i = 0; i < 5000 && n < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (*pool)->Stop();
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], ids[2]);
}

}  // namespace
}  // namespace coverbs
