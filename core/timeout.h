// Deadlines for any Task.
//
//   absl::StatusOr<int> r = co_await WithTimeout(ReadSomething(),
//   absl::Milliseconds(5));
//
// When the deadline passes first, WithTimeout requests stop on the task's
// (ambient) stop token, waits for the task to unwind -- every waiting
// awaitable in coverbs honours the token -- and returns DeadlineExceeded. The
// timed-out operation is therefore cancelled and finished, never leaked or
// left running. Stop requested on the caller's own token propagates into the
// task as well.
#ifndef COVERBS_CORE_TIMEOUT_H_
#define COVERBS_CORE_TIMEOUT_H_

#include <optional>
#include <stop_token>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

namespace internal {

template <typename T>
struct TimeoutResult {
  using type = absl::StatusOr<T>;
};
template <>
struct TimeoutResult<void> {
  using type = absl::Status;
};
template <>
struct TimeoutResult<absl::Status> {
  using type = absl::Status;
};
template <typename U>
struct TimeoutResult<absl::StatusOr<U>> {
  using type = absl::StatusOr<U>;
};

struct StopForwarder {
  std::stop_source* source;
  void operator()() const noexcept { source->request_stop(); }
};

}  // namespace internal

// Requests stop on a stop_source when a deadline passes: a timer on the
// current reactor, disarmed when this object is destroyed (or Cancel()).
// Lives in a coroutine frame or on the reactor thread's stack; used on the
// reactor thread only.
class StopAtDeadline final : private internal::TimerNode {
 public:
  // Not armed.
  StopAtDeadline() = default;
  // Armed on Reactor::Current(), which must exist.
  StopAtDeadline(std::stop_source& source, SteadyTime deadline) {
    Arm(source, deadline);
  }
  StopAtDeadline(const StopAtDeadline&) = delete;
  StopAtDeadline& operator=(const StopAtDeadline&) = delete;
  ~StopAtDeadline() { Cancel(); }

  void Arm(std::stop_source& source, SteadyTime deadline) {
    Cancel();
    reactor_ = Reactor::Current();
    source_ = &source;
    fired_ = false;
    this->deadline = deadline;
    reactor_->AddTimer(this);
  }
  void Cancel() {
    if (reactor_ != nullptr && armed()) reactor_->CancelTimer(this);
  }
  // True if the deadline passed (and stop was requested) while armed.
  bool fired() const { return fired_; }

 private:
  void OnTimer() override {
    fired_ = true;
    source_->request_stop();
  }
  Reactor* reactor_ = nullptr;
  std::stop_source* source_ = nullptr;
  bool fired_ = false;
};

// Forwards stop from a token to a stop_source for as long as it lives
// (e.g. the caller's ambient token into the source of a sub-operation).
class StopLink {
 public:
  StopLink(const std::stop_token& from, std::stop_source& to) {
    if (from.stop_possible()) cb_.emplace(from, internal::StopForwarder{&to});
  }
  StopLink(const StopLink&) = delete;
  StopLink& operator=(const StopLink&) = delete;

 private:
  std::optional<std::stop_callback<internal::StopForwarder>> cb_;
};

template <typename T>
Task<typename internal::TimeoutResult<T>::type> WithTimeout(
    Task<T> task, absl::Duration timeout) {
  std::stop_source source;
  std::stop_token parent = co_await CurrentStopToken();
  StopLink link(parent, source);
  StopAtDeadline timer(source, SteadyAfter(timeout));
  task.SetStopToken(source.get_token());
  auto deadline_error = [&timeout]() {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline of ", absl::FormatDuration(timeout),
                     " exceeded; the operation was cancelled"));
  };
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    timer.Cancel();
    if (timer.fired()) co_return deadline_error();
    co_return absl::OkStatus();
  } else {
    T result = co_await std::move(task);
    timer.Cancel();
    if constexpr (std::is_same_v<T, absl::Status> ||
                  !std::is_same_v<typename internal::TimeoutResult<T>::type,
                                  absl::StatusOr<T>>) {
      // A Status-returning task that succeeded while the deadline fired
      // finished its work: report the success.
      if (timer.fired() && !result.ok()) co_return deadline_error();
    } else {
      if (timer.fired()) co_return deadline_error();
    }
    co_return result;
  }
}

}  // namespace coverbs

#endif  // COVERBS_CORE_TIMEOUT_H_
