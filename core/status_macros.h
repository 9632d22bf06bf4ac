// Returning a failed status from a coroutine, without the boilerplate.
//
//   Task<absl::Status> Echo(cm::Connection& conn) {
//     CO_ASSIGN_OR_RETURN(cm::Message m, co_await conn.Recv());
//     CO_RETURN_IF_ERROR(co_await conn.Send(m.data()));
//     co_return absl::OkStatus();
//   }
//
// Both work in coroutines returning Task<absl::Status> or
// Task<absl::StatusOr<T>> (a failed Status converts to either), and take
// any expression, co_await included. The expression is evaluated once.
#ifndef COVERBS_CORE_STATUS_MACROS_H_
#define COVERBS_CORE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace coverbs::internal {
inline const absl::Status& ToStatus(const absl::Status& s) { return s; }
inline absl::Status ToStatus(absl::Status&& s) { return std::move(s); }
template <typename T>
absl::Status ToStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
template <typename T>
absl::Status ToStatus(absl::StatusOr<T>&& s) {
  return std::move(s).status();
}
}  // namespace coverbs::internal

#define COVERBS_STATUS_CONCAT_INNER(a, b) a##b
#define COVERBS_STATUS_CONCAT(a, b) COVERBS_STATUS_CONCAT_INNER(a, b)

// `expr` yields absl::Status or absl::StatusOr<T>; on failure the enclosing
// coroutine co_returns that status.
#define CO_RETURN_IF_ERROR(expr)                                           \
  do {                                                                     \
    auto coverbs_status_ = (expr);                                         \
    if (!coverbs_status_.ok()) {                                           \
      co_return ::coverbs::internal::ToStatus(std::move(coverbs_status_)); \
    }                                                                      \
  } while (0)

// `expr` yields absl::StatusOr<T>; on success its value is moved into
// `lhs` (a declaration such as `auto conn` or an existing variable), else
// the enclosing coroutine co_returns the status.
#define CO_ASSIGN_OR_RETURN(lhs, expr) \
  COVERBS_CO_ASSIGN_OR_RETURN_IMPL(    \
      COVERBS_STATUS_CONCAT(coverbs_statusor_, __LINE__), lhs, expr)
#define COVERBS_CO_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) co_return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

#endif  // COVERBS_CORE_STATUS_MACROS_H_
