// What the scope attacks of issue 27 share, in process (expose_scope_test)
// and across processes (tests/hostile/scope_attacks.cc): the rule an
// attack's failure must meet, and the soft provider's former key schedule
// that a peer could invert to predict keys.
#ifndef COVERBS_TESTS_CM_KEY_ATTACKS_H_
#define COVERBS_TESTS_CM_KEY_ATTACKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace coverbs::testing {

// The attack's own failure: the operation's remote access error
// (PERMISSION_DENIED), or the loss of the attacker's connection
// (UNAVAILABLE), which cm reports instead once it has seen the receives
// that the failed QP flushed. The message names the cause first
// ("protection error on this connection: ..."), then the operation `op`.
inline bool Refused(const absl::Status& s, const char* op) {
  return !s.ok() && s.message().find(op) != absl::string_view::npos &&
         (s.code() == absl::StatusCode::kPermissionDenied ||
          s.code() == absl::StatusCode::kUnavailable);
}

// The soft provider's former key schedule (lowbias32 of a counter) and its
// inverse: from one key a peer computed the counter, hence every other key.
inline uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
inline uint32_t InverseOdd(uint32_t a) {
  uint32_t x = a;  // Newton: each step doubles the correct low bits
  for (int i = 0; i < 5; ++i) x *= 2 - a * x;
  return x;
}
inline uint32_t Unmix(uint32_t x) {
  x ^= x >> 16;
  x *= InverseOdd(0x846ca68bU);
  x ^= (x >> 15) ^ (x >> 30);
  x *= InverseOdd(0x7feb352dU);
  x ^= x >> 16;
  return x;
}

}  // namespace coverbs::testing

#endif  // COVERBS_TESTS_CM_KEY_ATTACKS_H_
