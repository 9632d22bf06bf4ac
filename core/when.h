// Structured concurrency on one reactor: run several Tasks at once and wait.
//
//   auto [a, b] = co_await WhenAll(conn1.Recv(), conn2.Recv());
//   std::vector<absl::Status> all = co_await WhenAll(std::move(sends));
//   WhenAnyResult<absl::Status> first = co_await WhenAny(std::move(tasks));
//
// Contract:
//  - The tasks start in order when the combinator is awaited, on the
//    awaiting coroutine's reactor, and run concurrently (each until its
//    first suspension, then interleaved by the reactor). Must be awaited on
//    a reactor thread.
//  - Every task inherits the awaiting coroutine's stop token: cancelling
//    the caller cancels them all.
//  - WhenAll completes when every task completed; results come in argument
//    order (void tasks give std::monostate).
//  - WhenAny completes when the first task completes: it requests stop on
//    the others and waits until they have unwound (every coverbs awaitable
//    honours the stop token), so no task outlives the call. It yields the
//    index and result of the first to finish. At least one task is needed.
//  - No allocation beyond the tasks' frames and the result storage.
#ifndef COVERBS_CORE_WHEN_H_
#define COVERBS_CORE_WHEN_H_

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <cstdlib>
#include <optional>
#include <stop_token>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

template <typename T>
struct WhenAnyResult {
  size_t index = 0;  // of the task that finished first
  T value;
};

namespace internal {

template <typename T>
using WhenValue = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// Counts finished children; the last one schedules the parent. Starts at
// n + 1: the starter holds one count until every child was started, so a
// child that finishes synchronously never resumes the parent early.
struct WhenCounter {
  std::atomic<size_t> remaining{0};
  std::coroutine_handle<> parent;
  Reactor* reactor = nullptr;
  void Arrive() {
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      reactor->Schedule(parent);
    }
  }
};

template <typename T>
Task<void> WhenChild(Task<T> task, std::optional<WhenValue<T>>* out,
                     WhenCounter* counter) {
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    out->emplace();
  } else {
    out->emplace(co_await std::move(task));
  }
  counter->Arrive();
}

// Starts every child from the parent's await_suspend and suspends the
// parent unless they all finished already.
struct StartChildren {
  std::vector<Task<void>>* children;
  WhenCounter* counter;
  std::stop_token token;  // handed to the children; empty = the parent's
  bool use_parent_token = true;
  bool await_ready() const noexcept { return children->empty(); }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> parent) {
    counter->parent = parent;
    counter->reactor = Reactor::Current();
    counter->remaining.store(children->size() + 1, std::memory_order_relaxed);
    std::stop_token t = use_parent_token ? StopTokenOf(parent) : token;
    for (Task<void>& c : *children) {
      c.SetStopToken(t);
      ResumeOnTrampoline(c.handle());
    }
    // Drop the starter's count; if that was the last, nothing is pending.
    return counter->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1;
  }
  void await_resume() const noexcept {}
};

template <typename T>
struct AnyState {
  std::stop_source stop;
  std::optional<size_t> winner;
};

template <typename T>
Task<void> AnyChild(Task<T> task, size_t index, std::optional<T>* out,
                    AnyState<T>* st, WhenCounter* counter) {
  T v = co_await std::move(task);
  if (!st->winner.has_value()) {
    st->winner = index;
    out->emplace(std::move(v));
    st->stop.request_stop();
  }
  counter->Arrive();
}

struct ForwardStop {
  std::stop_source* to;
  void operator()() const noexcept { to->request_stop(); }
};

}  // namespace internal

template <typename... Ts>
Task<std::tuple<internal::WhenValue<Ts>...>> WhenAll(Task<Ts>... tasks) {
  std::tuple<std::optional<internal::WhenValue<Ts>>...> results;
  internal::WhenCounter counter;
  std::vector<Task<void>> children;
  children.reserve(sizeof...(Ts));
  std::apply(
      [&](auto&... slot) {
        (children.push_back(
             internal::WhenChild(std::move(tasks), &slot, &counter)),
         ...);
      },
      results);
  internal::StartChildren start{&children, &counter};  // named: see WhenAny
  co_await start;
  co_return std::apply(
      [](auto&... slot) {
        return std::tuple<internal::WhenValue<Ts>...>(std::move(*slot)...);
      },
      results);
}

// Homogeneous form. For Task<void>, yields nothing.
template <typename T>
Task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> WhenAll(
    std::vector<Task<T>> tasks) {
  std::vector<std::optional<internal::WhenValue<T>>> results(tasks.size());
  internal::WhenCounter counter;
  std::vector<Task<void>> children;
  children.reserve(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    children.push_back(
        internal::WhenChild(std::move(tasks[i]), &results[i], &counter));
  }
  internal::StartChildren start{&children, &counter};  // named: see WhenAny
  co_await start;
  if constexpr (!std::is_void_v<T>) {
    std::vector<T> out;
    out.reserve(results.size());
    for (auto& r : results) out.push_back(std::move(*r));
    co_return out;
  }
}

template <typename T>
Task<WhenAnyResult<T>> WhenAny(std::vector<Task<T>> tasks) {
  static_assert(!std::is_void_v<T>,
                "WhenAny needs a result type (use Task<absl::Status>)");
  if (tasks.empty()) std::abort();  // precondition: at least one task
  internal::AnyState<T> st;
  std::optional<T> value;
  // The caller's cancellation reaches the children through st.stop.
  std::stop_token parent = co_await CurrentStopToken();
  std::optional<std::stop_callback<internal::ForwardStop>> link;
  if (parent.stop_possible()) {
    link.emplace(parent, internal::ForwardStop{&st.stop});
  }
  internal::WhenCounter counter;
  std::vector<Task<void>> children;
  children.reserve(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    children.push_back(
        internal::AnyChild(std::move(tasks[i]), i, &value, &st, &counter));
  }
  // A named awaiter: gcc 12 destroys some temporaries with non-trivial
  // destructors twice when they sit inside a co_await expression.
  internal::StartChildren start{&children, &counter, st.stop.get_token(),
                                /*use_parent_token=*/false};
  co_await start;
  co_return WhenAnyResult<T>{*st.winner, std::move(*value)};
}

template <typename T, typename... Rest>
requires(std::is_same_v<Task<T>, Rest>&&...) Task<WhenAnyResult<T>> WhenAny(
    Task<T> first, Rest... rest) {
  std::vector<Task<T>> v;
  v.reserve(1 + sizeof...(Rest));
  v.push_back(std::move(first));
  (v.push_back(std::move(rest)), ...);
  return WhenAny(std::move(v));
}

}  // namespace coverbs

#endif  // COVERBS_CORE_WHEN_H_
