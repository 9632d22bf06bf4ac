// ASSERT for coroutine test bodies: gtest's ASSERT_* use `return`, which a
// coroutine cannot; these record the failure and co_return.
//   CO_ASSERT_OK(expr)   expr yields absl::Status or absl::StatusOr<T>
//   CO_ASSERT_TRUE(cond)
#ifndef COVERBS_TESTS_CO_ASSERT_H_
#define COVERBS_TESTS_CO_ASSERT_H_

#include "absl/status/status.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

#define CO_ASSERT_OK(expr)                                    \
  do {                                                        \
    absl::Status _st = ::coverbs::internal::ToStatus((expr)); \
    if (!_st.ok()) {                                          \
      ADD_FAILURE() << #expr << ": " << _st;                  \
      co_return;                                              \
    }                                                         \
  } while (0)
#define CO_ASSERT_TRUE(cond)               \
  do {                                     \
    if (!(cond)) {                         \
      ADD_FAILURE() << "false: " << #cond; \
      co_return;                           \
    }                                      \
  } while (0)

#endif  // COVERBS_TESTS_CO_ASSERT_H_
