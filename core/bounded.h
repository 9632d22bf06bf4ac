// Bounded concurrency: run N tasks, at most K at once, on one reactor.
//
//   // 1,000 Puts, 16 in flight:
//   std::vector<absl::Status> done = co_await ForEachBounded(
//       1000, 16, [&](size_t i) { return Put(client, keys[i]); });
//
// Contract:
//  - make(i) is called for i = 0, 1, ..., n-1 in order, each when a slot
//    frees (so a task's arguments need to live only while it runs); at
//    most `limit` (>= 1; 0 counts as 1) of the tasks it returns run at
//    once. Results come back in index order; T = void gives nothing.
//  - Every task runs to completion: a failing one does not stop the others
//    (the caller inspects the results). The tasks inherit the awaiting
//    coroutine's stop token: cancelling the caller stops them all, and
//    tasks not yet made are then still made and see the stop at once.
//  - Must be awaited on a reactor thread; the tasks run on that reactor.
#ifndef COVERBS_CORE_BOUNDED_H_
#define COVERBS_CORE_BOUNDED_H_

#include <algorithm>
#include <cstddef>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/task.h"
#include "core/when.h"

namespace coverbs {

namespace internal {
template <typename T>
struct TaskValue;
template <typename T>
struct TaskValue<Task<T>> {
  using type = T;
};
}  // namespace internal

template <typename F, typename T = typename internal::TaskValue<
                          std::invoke_result_t<F&, size_t>>::type>
Task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>>
ForEachBounded(size_t n, size_t limit, F make) {
  limit = std::clamp<size_t>(limit, 1, std::max<size_t>(n, 1));
  size_t next = 0;
  // Each lane takes the next index until none is left: at most `limit`
  // tasks exist at once, and no task waits for a slow one ahead of it.
  if constexpr (std::is_void_v<T>) {
    auto lane = [](size_t n, size_t* next, F* make) -> Task<void> {
      while (*next < n) co_await (*make)((*next)++);
    };
    std::vector<Task<void>> lanes;
    for (size_t i = 0; i < limit && n > 0; ++i) {
      lanes.push_back(lane(n, &next, &make));
    }
    co_await WhenAll(std::move(lanes));
  } else {
    std::vector<std::optional<T>> slots(n);
    auto lane = [](size_t n, size_t* next, F* make,
                   std::vector<std::optional<T>>* slots) -> Task<void> {
      while (*next < n) {
        const size_t i = (*next)++;
        (*slots)[i].emplace(co_await (*make)(i));
      }
    };
    std::vector<Task<void>> lanes;
    for (size_t i = 0; i < limit && n > 0; ++i) {
      lanes.push_back(lane(n, &next, &make, &slots));
    }
    co_await WhenAll(std::move(lanes));
    std::vector<T> out;
    out.reserve(n);
    for (auto& s : slots) out.push_back(std::move(*s));
    co_return out;
  }
}

}  // namespace coverbs

#endif  // COVERBS_CORE_BOUNDED_H_
