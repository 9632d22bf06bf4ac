// Offload: runs blocking or CPU-heavy work on a thread pool and resumes the
// awaiting coroutine on its own reactor, so that the reactor goes on
// serving its other tasks and connections meanwhile.
//
//   auto copy = [table = shared_table] { return table->Copy(); };
//   absl::StatusOr<Snapshot> s = co_await coverbs::Offload(copy);
//
// (The callable named first: gcc 12 destroys a lambda temporary that
// captures a shared_ptr inside a co_await expression twice; README.md,
// "Building your own code".)
//
// Contract:
//  - `fn` (a callable with no arguments) runs on a pool thread: the
//    process's default pool (OffloadPool::Default(), created on first use)
//    or the one given. The caller resumes on the reactor it awaited from.
//  - The result: fn's `absl::Status` / `absl::StatusOr<T>` as it is, a
//    `T` as `absl::StatusOr<T>`, nothing (void) as `absl::Status`.
//  - Cancellable: when the caller's ambient stop token is stopped, the
//    wait ends at once with Cancelled. Work not started yet never runs;
//    work already running finishes on its thread and its result is dropped
//    there. So `fn` must own what it uses (capture by value or by
//    shared_ptr): a cancelled caller may be gone by the time it runs.
//  - OffloadUntilDone(fn) is the same wait without cancellation: it
//    returns when the work has run, whatever the caller's stop token says,
//    so `fn` may use the caller's frame (the request a handler holds).
//  - Each Offload costs one allocation and two thread hand-offs (a few
//    microseconds): for work of a millisecond or more, not per message.
//  - OffloadPool::Post(fn) runs fn on a pool thread with nobody waiting:
//    for work whose end nobody needs to see, such as releasing a large
//    value off the reactor (fn owns it; it is destroyed on the pool
//    thread). Dropped, unrun, if the pool is being destroyed.
#ifndef COVERBS_CORE_OFFLOAD_H_
#define COVERBS_CORE_OFFLOAD_H_

#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

namespace internal {

// One offloaded call, shared by the awaiter and the pool: exactly one of
// {the work finishing, the caller's cancellation, the pool shutting down}
// claims the waiter and schedules it on its reactor.
class OffloadJob {
 public:
  virtual ~OffloadJob() = default;
  // Pool thread: runs the work unless the waiter was claimed already.
  void Execute();
  // Ends the wait with Cancelled (stop callback, pool shutdown).
  void Cancel();
  // The awaiter goes away (its frame destroyed while suspended): nobody
  // is to be resumed any more.
  void Detach();
  void Arm(Reactor* r, std::coroutine_handle<> h) {
    reactor_ = r;
    waiter_ = h;
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

 protected:
  virtual void Run() = 0;

 private:
  mutable std::mutex mu_;
  bool claimed_ = false;    // mu_
  bool cancelled_ = false;  // mu_
  Reactor* reactor_ = nullptr;
  std::coroutine_handle<> waiter_;
};

template <typename R>
struct OffloadOutput {
  using type = absl::StatusOr<R>;
};
template <>
struct OffloadOutput<void> {
  using type = absl::Status;
};
template <>
struct OffloadOutput<absl::Status> {
  using type = absl::Status;
};
template <typename T>
struct OffloadOutput<absl::StatusOr<T>> {
  using type = absl::StatusOr<T>;
};

}  // namespace internal

// A fixed set of threads that run offloaded work in FIFO order.
class OffloadPool {
 public:
  explicit OffloadPool(size_t threads);
  // Work not started yet is cancelled (its callers resume with Cancelled);
  // work running is waited for.
  ~OffloadPool();
  OffloadPool(const OffloadPool&) = delete;
  OffloadPool& operator=(const OffloadPool&) = delete;

  // The process's pool: max(4, hardware threads) threads, created on first
  // use, never destroyed (its threads sleep while there is no work).
  static OffloadPool& Default();
  size_t size() const { return threads_.size(); }

  // Any thread.
  void Submit(std::shared_ptr<internal::OffloadJob> job);
  // Runs fn() on one of the pool's threads; nobody waits (see the
  // contract). Any thread.
  template <typename F>
  void Post(F fn);

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<internal::OffloadJob>> queue_;  // mu_
  bool stop_ = false;                                        // mu_
  std::vector<std::thread> threads_;
};

template <typename F>
class [[nodiscard]] OffloadAwaiter {
  using R = std::invoke_result_t<F&>;

 public:
  using Output = typename internal::OffloadOutput<R>::type;

  OffloadAwaiter(OffloadPool* pool, F fn, bool cancellable)
      : pool_(pool),
        job_(std::make_shared<Job>(std::move(fn))),
        cancellable_(cancellable) {}
  OffloadAwaiter(const OffloadAwaiter&) = delete;
  ~OffloadAwaiter() {
    cb_.reset();
    if (suspended_) job_->Detach();
  }

  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    Reactor* r = Reactor::Current();
    std::stop_token token;
    if (cancellable_) token = internal::StopTokenOf(h);
    if (token.stop_requested()) {
      early_cancel_ = true;
      return false;
    }
    if (r == nullptr) {  // no reactor to come back to: run it here
      job_->Execute();
      return false;
    }
    job_->Arm(r, h);
    suspended_ = true;
    pool_->Submit(job_);
    // Registered after the submit: a stop requested meanwhile runs the
    // callback right here, and the claim decides who resumes us.
    if (token.stop_possible()) {
      cb_.emplace(std::move(token), CancelCallback{job_.get()});
    }
    return true;
  }
  Output await_resume() {
    cb_.reset();
    suspended_ = false;
    if (early_cancel_ || job_->cancelled()) {
      return absl::CancelledError(
          "offloaded work cancelled (if it had started, it finishes on its "
          "thread and its result is dropped)");
    }
    return std::move(*job_->out);
  }

 private:
  struct Job : internal::OffloadJob {
    explicit Job(F f) : fn(std::move(f)) {}
    void Run() override {
      if constexpr (std::is_void_v<R>) {
        fn();
        out.emplace(absl::OkStatus());
      } else {
        out.emplace(fn());
      }
    }
    F fn;
    std::optional<Output> out;
  };
  struct CancelCallback {
    internal::OffloadJob* job;
    void operator()() const noexcept { job->Cancel(); }
  };

  OffloadPool* pool_;
  std::shared_ptr<Job> job_;
  const bool cancellable_;
  bool suspended_ = false;
  bool early_cancel_ = false;
  std::optional<std::stop_callback<CancelCallback>> cb_;
};

namespace internal {
// What OffloadPool::Post runs: never armed, so its end resumes nobody.
template <typename F>
class PostedJob final : public OffloadJob {
 public:
  explicit PostedJob(F fn) : fn_(std::move(fn)) {}

 protected:
  void Run() override { fn_(); }

 private:
  F fn_;
};
}  // namespace internal

template <typename F>
void OffloadPool::Post(F fn) {
  Submit(std::make_shared<internal::PostedJob<F>>(std::move(fn)));
}

// co_await Offload(fn): see the contract at the top.
template <typename F>
OffloadAwaiter<std::decay_t<F>> Offload(F&& fn) {
  return OffloadAwaiter<std::decay_t<F>>(&OffloadPool::Default(),
                                         std::forward<F>(fn), true);
}
template <typename F>
OffloadAwaiter<std::decay_t<F>> Offload(OffloadPool& pool, F&& fn) {
  return OffloadAwaiter<std::decay_t<F>>(&pool, std::forward<F>(fn), true);
}
// co_await OffloadUntilDone(fn): not cancellable (see the contract).
template <typename F>
OffloadAwaiter<std::decay_t<F>> OffloadUntilDone(F&& fn) {
  return OffloadAwaiter<std::decay_t<F>>(&OffloadPool::Default(),
                                         std::forward<F>(fn), false);
}
template <typename F>
OffloadAwaiter<std::decay_t<F>> OffloadUntilDone(OffloadPool& pool, F&& fn) {
  return OffloadAwaiter<std::decay_t<F>>(&pool, std::forward<F>(fn), false);
}

}  // namespace coverbs

#endif  // COVERBS_CORE_OFFLOAD_H_
