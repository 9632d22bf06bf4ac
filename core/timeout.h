// Deadlines for any Task.
//
//   absl::StatusOr<int> r = co_await WithTimeout(ReadSomething(), absl::Milliseconds(5));
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

struct DeadlineTimer final : TimerNode {
  Reactor* reactor = nullptr;
  std::stop_source* source = nullptr;
  bool fired = false;
  void OnTimer() override {
    fired = true;
    source->request_stop();
  }
  ~DeadlineTimer() {
    if (reactor != nullptr && armed()) reactor->CancelTimer(this);
  }
};

struct StopForwarder {
  std::stop_source* source;
  void operator()() const noexcept { source->request_stop(); }
};

}  // namespace internal

template <typename T>
Task<typename internal::TimeoutResult<T>::type> WithTimeout(
    Task<T> task, absl::Duration timeout) {
  Reactor* reactor = Reactor::Current();
  std::stop_source source;
  std::stop_token parent = co_await CurrentStopToken();
  std::optional<std::stop_callback<internal::StopForwarder>> link;
  if (parent.stop_possible()) {
    link.emplace(parent, internal::StopForwarder{&source});
  }
  internal::DeadlineTimer timer;
  timer.reactor = reactor;
  timer.source = &source;
  timer.deadline = SteadyAfter(timeout);
  reactor->AddTimer(&timer);
  task.SetStopToken(source.get_token());
  auto deadline_error = [&timeout]() {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline of ", absl::FormatDuration(timeout),
                     " exceeded; the operation was cancelled"));
  };
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    reactor->CancelTimer(&timer);
    if (timer.fired) co_return deadline_error();
    co_return absl::OkStatus();
  } else {
    T result = co_await std::move(task);
    reactor->CancelTimer(&timer);
    if constexpr (std::is_same_v<T, absl::Status> ||
                  !std::is_same_v<typename internal::TimeoutResult<T>::type,
                                  absl::StatusOr<T>>) {
      // A Status-returning task that succeeded while the deadline fired
      // finished its work: report the success.
      if (timer.fired && !result.ok()) co_return deadline_error();
    } else {
      if (timer.fired) co_return deadline_error();
    }
    co_return result;
  }
}

}  // namespace coverbs

#endif  // COVERBS_CORE_TIMEOUT_H_
