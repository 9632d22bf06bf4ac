// Timestamps for per-operation latency samples.
//
// Every latency sample is two clock reads. steady_clock is a vDSO call that
// costs tens of nanoseconds on a host with a TSC clocksource, but in a
// guest whose clocksource is the HPET (the qemu/TCG VM of tests/vm) each
// read is a system call plus an emulated MMIO read: about a microsecond,
// and part of it lands inside the interval it measures. perftest times
// with the TSC (get_cycles) and so does this on x86-64, converting with a
// rate measured once against steady_clock; elsewhere it is steady_clock.
// Run totals (calls/s, bandwidth) keep using steady_clock.
#ifndef COVERBS_BENCH_SAMPLE_CLOCK_H_
#define COVERBS_BENCH_SAMPLE_CLOCK_H_

#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace coverbs::bench {

// Nanoseconds per tick. Measured over ~20 ms on first use against
// steady_clock: call it once before a run (before any SampleTicks), so that
// no sample pays for it.
double SampleNsPerTick();

namespace internal {
// Set by the first SampleNsPerTick: false where the TSC is absent or did
// not advance with steady_clock (the ticks are then steady_clock's, 1 ns).
extern bool tsc_usable;
}  // namespace internal

// Ticks of the sample clock: comparable only with each other.
inline int64_t SampleTicks() {
#if defined(__x86_64__)
  if (internal::tsc_usable) return static_cast<int64_t>(__rdtsc());
#endif
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The length of [t0, t1] in nanoseconds.
inline int64_t SampleNs(int64_t t0, int64_t t1) {
  return static_cast<int64_t>(static_cast<double>(t1 - t0) * SampleNsPerTick());
}

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_SAMPLE_CLOCK_H_
