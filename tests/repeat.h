// Repetition counts that the VM harness can scale down.
//
// Under qemu's TCG emulation (tests/vm) a repetition costs 50-100 times what
// it costs on the host, so tests/vm/vm_test.sh sets
// COVERBS_TEST_REPEAT_PERCENT=10 there: tests that repeat one path many
// times (10,000 pipelined calls) repeat it a tenth as often. Every path
// still runs: a floor per count keeps what the test needs (e.g. enough calls
// to fill every in-flight slot several times). Unset, the count is the full
// one; above 100 it is a soak. tests/README.md lists the scaled counts.
#ifndef COVERBS_TESTS_REPEAT_H_
#define COVERBS_TESTS_REPEAT_H_

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "gtest/gtest.h"

namespace coverbs::testing {

// `full` scaled by COVERBS_TEST_REPEAT_PERCENT, never below `floor`. A value
// that is not a positive integer fails the test (and runs the full count).
inline int Repeat(int full, int floor) {
  const char* env = std::getenv("COVERBS_TEST_REPEAT_PERCENT");
  if (env == nullptr || *env == '\0') return full;
  char* end = nullptr;
  errno = 0;
  long percent = std::strtol(env, &end, 10);
  if (errno != 0 || *end != '\0' || percent <= 0 || percent > 99999) {
    ADD_FAILURE() << "COVERBS_TEST_REPEAT_PERCENT=" << env
                  << " is not a percentage in 1..99999";
    return full;
  }
  int64_t scaled = int64_t{full} * percent / 100;
  return static_cast<int>(std::max<int64_t>(floor, scaled));
}

}  // namespace coverbs::testing

#endif  // COVERBS_TESTS_REPEAT_H_
