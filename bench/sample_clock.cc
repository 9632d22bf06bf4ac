#include "bench/sample_clock.h"

#include <chrono>
#include <thread>

namespace coverbs::bench {

namespace internal {
bool tsc_usable = false;
}  // namespace internal

namespace {

double Calibrate() {
#if defined(__x86_64__)
  using Steady = std::chrono::steady_clock;
  // Sleep, not spin: the bench may share its core with the peer process.
  // The clock reads at either end are ~1 us at worst against 20 ms.
  const Steady::time_point s0 = Steady::now();
  const int64_t t0 = static_cast<int64_t>(__rdtsc());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const Steady::time_point s1 = Steady::now();
  const int64_t t1 = static_cast<int64_t>(__rdtsc());
  const double ns = std::chrono::duration<double, std::nano>(s1 - s0).count();
  // A TSC that did not advance (or went back) cannot time anything: no
  // such machine is expected; steady_clock then takes its place.
  if (t1 <= t0 || ns <= 0) return 1.0;
  internal::tsc_usable = true;
  return ns / static_cast<double>(t1 - t0);
#else
  return 1.0;
#endif
}

}  // namespace

double SampleNsPerTick() {
  static const double rate = Calibrate();
  return rate;
}

}  // namespace coverbs::bench
