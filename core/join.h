// Spawn with a result: start a Task on a reactor and co_await its outcome
// later, from any coroutine.
//
//   JoinHandle<absl::StatusOr<int>> h = Spawn(pool.reactor(1), Compute());
//   ...
//   absl::StatusOr<int> v = co_await h.Join();
//
// Contract:
//  - The task starts on `reactor` (from any thread) and runs detached from
//    the caller; a JoinHandle dropped without Join leaves it running (like
//    Reactor::Spawn).
//  - Join() yields the task's result: for Task<absl::Status> or
//    Task<absl::StatusOr<U>> the result itself, for Task<void> an
//    absl::Status, for any other T an absl::StatusOr<T>. It fails with
//    Aborted only when the task could never finish: its reactor was
//    destroyed while it was suspended.
//  - Cancelling the coroutine that awaits Join() requests stop on the task
//    and keeps waiting until it has unwound: nothing is left running behind
//    a cancelled join. RequestStop() asks the task to stop without waiting.
//  - Join() may be awaited once, on any reactor thread that outlives the
//    task's completion. One small allocation (the shared state) per Spawn.
#ifndef COVERBS_CORE_JOIN_H_
#define COVERBS_CORE_JOIN_H_

#include <coroutine>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/task.h"
#include "core/timeout.h"

namespace coverbs {

template <typename T>
using JoinResult = typename internal::TimeoutResult<T>::type;

namespace internal {

template <typename T>
struct JoinState {
  std::mutex mu;
  bool done = false;
  std::optional<JoinResult<T>> result;
  std::coroutine_handle<> waiter;  // guarded by mu
  Reactor* waiter_reactor = nullptr;
  std::stop_source stop;

  void Complete(JoinResult<T> r) {
    // Schedules under mu: a waiter whose reactor is being destroyed
    // unregisters under mu (JoinAwaiter's destructor), so it cannot go away
    // between taking the waiter and scheduling it.
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    result.emplace(std::move(r));
    done = true;
    if (std::coroutine_handle<> w = std::exchange(waiter, {})) {
      waiter_reactor->Schedule(w);
    }
  }
};

// Completes the state with Aborted if the task's frame is destroyed before
// the task finished (its reactor went away).
template <typename T>
struct JoinGuard {
  std::shared_ptr<JoinState<T>> st;
  bool finished = false;
  ~JoinGuard() {
    if (!finished) {
      st->Complete(absl::AbortedError(
          "the spawned task's reactor was destroyed before the task finished"));
    }
  }
};

template <typename T>
Task<void> RunJoinable(Task<T> task, std::shared_ptr<JoinState<T>> st) {
  JoinGuard<T> guard{st};
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    guard.finished = true;
    st->Complete(absl::OkStatus());
  } else {
    T v = co_await std::move(task);
    guard.finished = true;
    st->Complete(JoinResult<T>(std::move(v)));
  }
}

template <typename T>
struct JoinAwaiter {
  explicit JoinAwaiter(JoinState<T>* s) : st(s) {}
  JoinAwaiter(const JoinAwaiter&) = delete;
  JoinState<T>* st;
  bool suspended = false;
  ~JoinAwaiter() {
    // The waiting frame is destroyed while suspended (its reactor went
    // away): unregister so that completion does not resume a dead frame.
    if (suspended) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->waiter = {};
    }
  }
  bool await_ready() {
    std::lock_guard<std::mutex> lock(st->mu);
    return st->done;
  }
  bool await_suspend(std::coroutine_handle<> h) {
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->done) return false;
    st->waiter = h;
    st->waiter_reactor = Reactor::Current();
    suspended = true;
    return true;
  }
  void await_resume() { suspended = false; }
};

}  // namespace internal

template <typename T>
class [[nodiscard]] JoinHandle {
 public:
  JoinHandle() = default;
  JoinHandle(JoinHandle&&) noexcept = default;
  JoinHandle& operator=(JoinHandle&&) noexcept = default;

  bool valid() const { return st_ != nullptr; }
  // Asks the task to stop (its ambient stop token); does not wait.
  void RequestStop() {
    if (st_) st_->stop.request_stop();
  }
  // True once the task finished (Join would not suspend).
  bool done() const {
    if (!st_) return false;
    std::lock_guard<std::mutex> lock(st_->mu);
    return st_->done;
  }

  // The task's result (see the file comment). Consumes the handle.
  Task<JoinResult<T>> Join() {
    std::shared_ptr<internal::JoinState<T>> st = std::move(st_);
    if (!st)
      co_return absl::FailedPreconditionError("Join on an empty JoinHandle");
    std::stop_token token = co_await CurrentStopToken();
    StopLink forward(token, st->stop);
    // A named awaiter: gcc 12 destroys some temporaries with non-trivial
    // destructors twice when they sit inside a co_await expression.
    internal::JoinAwaiter<T> wait(st.get());
    co_await wait;
    co_return std::move(*st->result);
  }

 private:
  template <typename U>
  friend JoinHandle<U> Spawn(Reactor& reactor, Task<U> task);
  explicit JoinHandle(std::shared_ptr<internal::JoinState<T>> st)
      : st_(std::move(st)) {}
  std::shared_ptr<internal::JoinState<T>> st_;
};

// Starts `task` on `reactor` (thread-safe) and returns a handle to join it.
template <typename T>
JoinHandle<T> Spawn(Reactor& reactor, Task<T> task) {
  auto st = std::make_shared<internal::JoinState<T>>();
  std::stop_token token = st->stop.get_token();
  reactor.Spawn(internal::RunJoinable(std::move(task), st), std::move(token));
  return JoinHandle<T>(std::move(st));
}

}  // namespace coverbs

#endif  // COVERBS_CORE_JOIN_H_
