// co_await Offload(fn): the work runs on a pool thread, the caller resumes
// on its reactor, the reactor goes on meanwhile, and cancellation ends the
// wait at once (work not started never runs; work running is dropped).
#include "core/offload.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> NewReactor() {
  auto r = Reactor::Create();
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

TEST(OffloadTest, RunsOnAPoolThreadAndResumesOnTheReactor) {
  auto r = NewReactor();
  r->BlockOn([](Reactor* r) -> Task<void> {
    const std::thread::id me = std::this_thread::get_id();
    absl::StatusOr<std::thread::id> ran =
        co_await Offload([] { return std::this_thread::get_id(); });
    if (!ran.ok()) {
      ADD_FAILURE() << ran.status();
      co_return;
    }
    EXPECT_NE(*ran, me);
    EXPECT_EQ(std::this_thread::get_id(), me);
    EXPECT_EQ(Reactor::Current(), r);
  }(r.get()));
}

TEST(OffloadTest, ResultsKeepTheirStatus) {
  auto r = NewReactor();
  r->BlockOn([]() -> Task<void> {
    int touched = 0;
    absl::Status v = co_await Offload([&touched] { touched = 7; });
    EXPECT_TRUE(v.ok()) << v;
    EXPECT_EQ(touched, 7);
    absl::Status s =
        co_await Offload([] { return absl::NotFoundError("no such key"); });
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    absl::StatusOr<std::string> so = co_await Offload(
        []() -> absl::StatusOr<std::string> { return std::string("v"); });
    if (!so.ok()) {
      ADD_FAILURE() << so.status();
      co_return;
    }
    EXPECT_EQ(*so, "v");
    absl::StatusOr<std::unique_ptr<int>> moved =
        co_await Offload([] { return std::make_unique<int>(3); });
    if (!moved.ok()) {
      ADD_FAILURE() << moved.status();
      co_return;
    }
    EXPECT_EQ(**moved, 3);
  }());
}

// While the work blocks its pool thread, the reactor runs its other tasks.
TEST(OffloadTest, TheReactorRunsOnMeanwhile) {
  auto r = NewReactor();
  r->BlockOn([](Reactor* r) -> Task<void> {
    std::atomic<int> ticks{0};
    std::atomic<bool> done{false};
    r->Spawn([](Reactor* r, std::atomic<int>* ticks,
                std::atomic<bool>* done) -> Task<void> {
      while (!done->load()) {
        (void)co_await r->Sleep(absl::Milliseconds(1));
        ticks->fetch_add(1);
      }
    }(r, &ticks, &done));
    absl::Status s = co_await Offload(
        [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); });
    done.store(true);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_GE(ticks.load(), 10);
    (void)co_await r->Sleep(absl::Milliseconds(5));
  }(r.get()));
}

// A cancelled wait returns at once; the running work finishes on its
// thread and its result is dropped there.
TEST(OffloadTest, CancelledWaitReturnsAtOnceAndTheWorkIsDropped) {
  auto r = NewReactor();
  // The flags outlive the job, which the pool thread may free after the
  // test returned: no reference of the test's is dropped there.
  static std::atomic<bool> finished_flag{false}, started_flag{false};
  std::shared_ptr<std::atomic<bool>> finished(std::shared_ptr<void>(),
                                              &finished_flag);
  std::shared_ptr<std::atomic<bool>> started(std::shared_ptr<void>(),
                                             &started_flag);
  r->BlockOn([](std::shared_ptr<std::atomic<bool>> started,
                std::shared_ptr<std::atomic<bool>> finished) -> Task<void> {
    auto wait = [](std::shared_ptr<std::atomic<bool>> started,
                   std::shared_ptr<std::atomic<bool>> finished)
        -> Task<absl::StatusOr<std::string>> {
      co_return co_await Offload([started, finished] {
        started->store(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        finished->store(true);
        return std::string(1000, 'x');  // freed on the pool thread
      });
    };
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> res =
        co_await WithTimeout(wait(started, finished), absl::Milliseconds(50));
    auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_FALSE(res.ok());
    EXPECT_LT(waited, std::chrono::milliseconds(250));
    EXPECT_FALSE(finished->load());
  }(started, finished));
  // The work goes on to its end (and the process stays sound).
  for (int i = 0; i < 200 && !finished->load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(started->load());
  EXPECT_TRUE(finished->load());
}

// OffloadUntilDone ignores the caller's stop: the work may use its frame.
TEST(OffloadTest, UntilDoneWaitsForTheWorkDespiteAStop) {
  auto r = NewReactor();
  r->BlockOn([](Reactor* r) -> Task<void> {
    std::stop_source stop;
    Event done;
    absl::StatusOr<int> res = absl::UnknownError("not run");
    r->Spawn(
        [](absl::StatusOr<int>* out, Event* done) -> Task<void> {
          int local = 40;  // in this frame: safe, the wait outlives the work
          *out = co_await OffloadUntilDone([&local] {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            return local + 2;
          });
          done->Set();
        }(&res, &done),
        stop.get_token());
    (void)co_await r->Sleep(absl::Milliseconds(5));
    stop.request_stop();
    (void)co_await done.Wait();
    if (!res.ok()) {
      ADD_FAILURE() << res.status();
      co_return;
    }
    EXPECT_EQ(*res, 42);
  }(r.get()));
}

// Work still queued when its caller gives up never runs.
TEST(OffloadTest, WorkCancelledBeforeItStartsNeverRuns) {
  static std::atomic<bool> ran_flag{false}, gate_flag{false};
  std::shared_ptr<std::atomic<bool>> ran(std::shared_ptr<void>(), &ran_flag);
  std::shared_ptr<std::atomic<bool>> gate(std::shared_ptr<void>(), &gate_flag);
  OffloadPool pool(1);
  auto r = NewReactor();
  r->BlockOn([](OffloadPool* pool, std::shared_ptr<std::atomic<bool>> ran,
                std::shared_ptr<std::atomic<bool>> gate) -> Task<void> {
    // The pool's only thread is held by this one.
    auto hold = [](OffloadPool* pool,
                   std::shared_ptr<std::atomic<bool>> gate) -> Task<void> {
      absl::Status s = co_await Offload(*pool, [gate] {
        while (!gate->load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
      EXPECT_TRUE(s.ok()) << s;
    };
    Reactor* r = Reactor::Current();
    WaitGroup wg;
    wg.Add(1);
    r->Spawn([](Task<void> t, WaitGroup* wg) -> Task<void> {
      co_await std::move(t);
      wg->Done();
    }(hold(pool, gate), &wg));
    std::stop_source stop;
    Event done;
    absl::Status queued_result;
    r->Spawn(
        [](OffloadPool* pool, std::shared_ptr<std::atomic<bool>> ran,
           absl::Status* out, Event* done) -> Task<void> {
          *out = co_await Offload(*pool, [ran] { ran->store(true); });
          done->Set();
        }(pool, ran, &queued_result, &done),
        stop.get_token());
    (void)co_await r->Sleep(absl::Milliseconds(20));
    stop.request_stop();
    (void)co_await done.Wait();
    EXPECT_EQ(queued_result.code(), absl::StatusCode::kCancelled)
        << queued_result;
    gate->store(true);
    (void)co_await wg.Wait();
  }(&pool, ran, gate));
  // Whatever the pool still had is behind us once it is destroyed.
  EXPECT_FALSE(ran->load());
}

// A stop already requested: nothing is submitted.
TEST(OffloadTest, AlreadyStoppedCallerIsCancelledWithoutRunning) {
  auto r = NewReactor();
  bool ran = false;
  std::stop_source stop;
  stop.request_stop();
  Event done;
  absl::Status res;
  r->BlockOn([](Reactor* r, bool* ran, std::stop_source* stop, Event* done,
                absl::Status* res) -> Task<void> {
    r->Spawn(
        [](bool* ran, Event* done, absl::Status* res) -> Task<void> {
          *res = co_await Offload([ran] { *ran = true; });
          done->Set();
        }(ran, done, res),
        stop->get_token());
    (void)co_await done->Wait();
  }(r.get(), &ran, &stop, &done, &res));
  EXPECT_EQ(res.code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(ran);
}

// A reactor destroyed while a task of it waits for offloaded work: the
// work's end finds nobody to resume and touches nothing freed.
TEST(OffloadTest, ReactorDestroyedWhileWorkRuns) {
  static std::atomic<bool> finished_flag{false}, started_flag{false};
  std::shared_ptr<std::atomic<bool>> finished(std::shared_ptr<void>(),
                                              &finished_flag);
  std::shared_ptr<std::atomic<bool>> started(std::shared_ptr<void>(),
                                             &started_flag);
  {
    auto r = NewReactor();
    r->Spawn([](std::shared_ptr<std::atomic<bool>> started,
                std::shared_ptr<std::atomic<bool>> finished) -> Task<void> {
      (void)co_await Offload([started, finished] {
        started->store(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        finished->store(true);
      });
      ADD_FAILURE() << "resumed after its reactor was destroyed";
    }(started, finished));
    r->RunOnce();
    // Destroyed while the work runs (work not started would never run).
    for (int i = 0; i < 200 && !started->load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(started->load());
  }
  for (int i = 0; i < 200 && !finished->load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(finished->load());
}

// Destroying a pool cancels what it has not started.
TEST(OffloadTest, DestroyedPoolCancelsQueuedWork) {
  auto pool = std::make_unique<OffloadPool>(1);
  auto r = NewReactor();
  static std::atomic<bool> gate_flag{false};
  std::shared_ptr<std::atomic<bool>> gate(std::shared_ptr<void>(), &gate_flag);
  absl::Status first, second;
  Event done1, done2;
  r->BlockOn([](Reactor* r, OffloadPool* pool,
                std::shared_ptr<std::atomic<bool>> gate, absl::Status* first,
                absl::Status* second, Event* done1,
                Event* done2) -> Task<void> {
    r->Spawn([](OffloadPool* pool, std::shared_ptr<std::atomic<bool>> gate,
                absl::Status* out, Event* done) -> Task<void> {
      *out = co_await Offload(*pool, [gate] {
        while (!gate->load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
      done->Set();
    }(pool, gate, first, done1));
    r->Spawn(
        [](OffloadPool* pool, absl::Status* out, Event* done) -> Task<void> {
          *out = co_await Offload(*pool, [] {});
          done->Set();
        }(pool, second, done2));
    (void)co_await r->Sleep(absl::Milliseconds(20));
  }(r.get(), pool.get(), gate, &first, &second, &done1, &done2));
  std::thread destroyer([&pool] { pool.reset(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  gate->store(true);
  destroyer.join();
  r->BlockOn([](Event* a, Event* b) -> Task<void> {
    (void)co_await a->Wait();
    (void)co_await b->Wait();
  }(&done1, &done2));
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_EQ(second.code(), absl::StatusCode::kCancelled) << second;
}

// Post: fire and forget; what fn owns is released on the pool thread.
TEST(OffloadTest, PostRunsOnAPoolThreadAndReleasesThere) {
  OffloadPool pool(2);
  struct Noted {
    std::atomic<std::thread::id>* where;
    ~Noted() {
      if (where != nullptr) where->store(std::this_thread::get_id());
    }
  };
  std::atomic<std::thread::id> ran{}, released{};
  std::atomic<bool> done{false};
  std::unique_ptr<Noted> owned(new Noted{&released});
  pool.Post([&ran, &done, owned = std::move(owned)]() mutable {
    ran.store(std::this_thread::get_id());
    owned.reset();
    done.store(true);
  });
  for (int i = 0; i < 500 && !done.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(done.load());
  EXPECT_NE(ran.load(), std::this_thread::get_id());
  EXPECT_EQ(released.load(), ran.load());
}

}  // namespace
}  // namespace coverbs
