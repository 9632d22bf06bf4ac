// The soft provider's early-transmit decision (transport/soft/
// early_tx_gate.h) driven with made-up host samples, and the parser of
// /proc/loadavg's text it samples.
#include "transport/soft/early_tx_gate.h"

#include <string>

#include "gtest/gtest.h"

namespace coverbs::transport::soft {
namespace {

TEST(ParseLoadavgRunnable, TakesTheCountBeforeTheSlash) {
  EXPECT_EQ(ParseLoadavgRunnable("0.52 0.58 0.59 3/512 12345\n"), 3);
  EXPECT_EQ(ParseLoadavgRunnable("12.00 9.10 8.00 17/2048 99"), 17);
  EXPECT_EQ(ParseLoadavgRunnable("0.00 0.00 0.00 0/1 1"), 0);
}

TEST(ParseLoadavgRunnable, RefusesOtherShapesWithZero) {
  for (const char* text :
       {"", "0.52", "0.52 0.58 0.59", "0.52 0.58 0.59 ", "0.52 0.58 0.59 x/5",
        "0.52 0.58 0.59 3", "0.52 0.58 0.59 /512", "a b c 99999999999/1"}) {
    EXPECT_EQ(ParseLoadavgRunnable(text), 0) << '"' << text << '"';
  }
}

// Calls MayOverlap as the posting thread would, kSampleEvery times per
// sample, and says what the last call decided.
bool RunSamples(EarlyTxGate& gate, int cpus, int runnable, int samples) {
  bool overlap = false;
  for (int i = 0; i < samples * static_cast<int>(EarlyTxGate::kSampleEvery);
       ++i) {
    overlap = gate.MayOverlap(cpus, [runnable] { return runnable; });
  }
  return overlap;
}

TEST(EarlyTxGate, OneCpuNeverOverlapsAndNeverSamples) {
  EarlyTxGate gate;
  int sampled = 0;
  for (int i = 0; i < 200; ++i) {
    EXPECT_FALSE(gate.MayOverlap(1, [&] {
      ++sampled;
      return 0;
    }));
  }
  EXPECT_EQ(sampled, 0);
}

TEST(EarlyTxGate, SamplesEveryKSampleEveryThCheck) {
  EarlyTxGate gate;
  int sampled = 0;
  for (uint32_t i = 0; i < 3 * EarlyTxGate::kSampleEvery + 1; ++i) {
    gate.MayOverlap(2, [&] {
      ++sampled;
      return 1;
    });
  }
  EXPECT_EQ(sampled, 4);  // checks 0, 64, 128 and 192
}

TEST(EarlyTxGate, AQuietHostOverlaps) {
  EarlyTxGate gate;
  // Runnable tasks up to the CPUs the process may use (itself and its peer
  // on two) are not busy.
  EXPECT_TRUE(RunSamples(gate, 2, 2, 50));
  EXPECT_TRUE(RunSamples(gate, 8, 8, 50));
}

TEST(EarlyTxGate, OneBusySampleStopsEarlyTransmitsForAWhile) {
  EarlyTxGate gate;
  ASSERT_TRUE(RunSamples(gate, 2, 1, 10));
  // One busy sample (3 runnable on 2 CPUs) puts the score at 16: off.
  EXPECT_FALSE(RunSamples(gate, 2, 3, 1));
  // One quiet sample decays it to 12 (below a quarter): on again.
  EXPECT_TRUE(RunSamples(gate, 2, 1, 1));
}

TEST(EarlyTxGate, ABusyHostStaysOffUntilMostRecentSamplesAreQuiet) {
  EarlyTxGate gate;
  EXPECT_FALSE(RunSamples(gate, 2, 4, 20));  // score 62 (of 64)
  // 62 -> 46 -> 34 -> 25 -> 18 -> 13: the fifth quiet sample turns it on.
  for (int quiet = 1; quiet <= 4; ++quiet) {
    EXPECT_FALSE(RunSamples(gate, 2, 0, 1)) << quiet;
  }
  EXPECT_TRUE(RunSamples(gate, 2, 0, 1));
}

TEST(EarlyTxGate, AHalfBusyHostStaysOff) {
  // Busy and quiet samples alternating: from the second pair on the score
  // stays between 18 and 37 (settling near 27 and 36), above a quarter.
  EarlyTxGate gate;
  RunSamples(gate, 2, 3, 1);  // 16
  RunSamples(gate, 2, 0, 1);  // 12: on, after one busy sample of two
  for (int i = 0; i < 20; ++i) {
    EXPECT_FALSE(RunSamples(gate, 2, 3, 1)) << i;
    EXPECT_FALSE(RunSamples(gate, 2, 0, 1)) << i;
  }
}

}  // namespace
}  // namespace coverbs::transport::soft
