// The process's stall watchdog (internal to core/reactor.cc): one thread
// that looks at every registered reactor a few times per stall threshold
// and flags a task that has been running without yielding for longer than
// its reactor's threshold. The reactor reports the stall itself when the
// task returns (Reactor::RunReady), so the hot path costs two relaxed
// stores and one load per resumption, and no clock read.
#ifndef COVERBS_CORE_STALL_WATCHDOG_H_
#define COVERBS_CORE_STALL_WATCHDOG_H_

#include <atomic>
#include <cstdint>

namespace coverbs::internal {

// Shared between a reactor (writer of seq) and the watchdog (writer of
// flagged / since_ns).
struct StallState {
  // Bumped before and after each task resumption: odd while one runs.
  std::atomic<uint64_t> seq{0};
  // The watchdog's verdict: the odd seq of the task that has run for at
  // least the threshold (0: none), and when the watchdog first saw it
  // running (steady clock, ns; set before `flagged`, read after it).
  std::atomic<uint64_t> flagged{0};
  std::atomic<int64_t> since_ns{0};
  int64_t threshold_ns = 0;  // > 0; fixed while registered
  // Watchdog thread only.
  uint64_t last_seq = 0;
  int64_t first_seen_ns = 0;
};

// Any thread. A state is watched from Add until Remove returns (Remove
// waits for a look in progress to finish).
void AddStallWatch(StallState* s);
void RemoveStallWatch(StallState* s);

// Steady clock in ns (the watchdog's time base).
int64_t StallClockNs();

}  // namespace coverbs::internal

#endif  // COVERBS_CORE_STALL_WATCHDOG_H_
