// Micro-benchmarks of the core runtime (build with -c opt).
#include <benchmark/benchmark.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {
namespace {

std::unique_ptr<Reactor> MakeReactor() { return *Reactor::Create(); }

Task<int> Ready(int v) { co_return v; }

Task<int> CreateAndAwait(int n) {
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += co_await Ready(i);
  co_return sum;
}

// A Task is created, started (symmetric transfer), completes, resumes the
// caller and is destroyed: one frame allocation per iteration.
void BM_TaskCreateAwaitResume(benchmark::State& state) {
  auto r = MakeReactor();
  constexpr int kBatch = 1000;
  for (auto _ : state) {
    benchmark::DoNotOptimize(r->BlockOn(CreateAndAwait(kBatch)));
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_TaskCreateAwaitResume);

struct ReadyAwaitable {
  int v;
  bool await_ready() const noexcept { return true; }
  void await_suspend(std::coroutine_handle<>) noexcept {}
  int await_resume() const noexcept { return v; }
};

Task<int> AwaitReady(int n) {
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += co_await ReadyAwaitable{i};
  co_return sum;
}

// co_await of an already-ready value: no suspension.
void BM_AwaitReadyValue(benchmark::State& state) {
  auto r = MakeReactor();
  constexpr int kBatch = 10000;
  for (auto _ : state) {
    benchmark::DoNotOptimize(r->BlockOn(AwaitReady(kBatch)));
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_AwaitReadyValue);

Task<void> YieldLoop(Reactor* r, int n) {
  for (int i = 0; i < n; ++i) co_await r->Yield();
}

// Schedule + resume through the ready queue on the same thread.
void BM_ReactorScheduleSameThread(benchmark::State& state) {
  auto r = MakeReactor();
  constexpr int kBatch = 10000;
  for (auto _ : state) r->BlockOn(YieldLoop(r.get(), kBatch));
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_ReactorScheduleSameThread);

// Post from the reactor thread itself (goes through the locked inbox).
void BM_ReactorPostSameThread(benchmark::State& state) {
  auto r = MakeReactor();
  constexpr int kBatch = 1000;
  int ran = 0;
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) r->Post([&ran] { ++ran; });
    while (r->RunOnce()) {
    }
  }
  benchmark::DoNotOptimize(ran);
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_ReactorPostSameThread);

// Post from another thread to a running reactor, end to end (includes the
// eventfd wake-up when the reactor sleeps).
void BM_ReactorPostCrossThread(benchmark::State& state) {
  auto r = MakeReactor();
  std::thread loop([&] { r->Run(); });
  constexpr int kBatch = 1000;
  std::atomic<int> ran{0};
  int64_t expected = 0;
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) {
      r->Post([&ran] { ran.fetch_add(1, std::memory_order_relaxed); });
    }
    expected += kBatch;
    while (ran.load(std::memory_order_relaxed) < expected) {
    }
  }
  r->Stop();
  loop.join();
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_ReactorPostCrossThread)->UseRealTime();

Task<void> ZeroSleeps(Reactor* r, int n) {
  for (int i = 0; i < n; ++i) {
    absl::Status s = co_await r->Sleep(absl::ZeroDuration());
    benchmark::DoNotOptimize(s);
  }
}

// Arm a timer that is already due and fire it: heap push/pop + resume.
void BM_TimerArmFire(benchmark::State& state) {
  auto r = MakeReactor();
  constexpr int kBatch = 1000;
  for (auto _ : state) r->BlockOn(ZeroSleeps(r.get(), kBatch));
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_TimerArmFire);

}  // namespace
}  // namespace coverbs

BENCHMARK_MAIN();
