// coverbs_bench --plot: the results drawn as an SVG chart, so that a run (or
// a before / after pair of runs) can be taken in at one look.
#ifndef COVERBS_BENCH_PLOT_H_
#define COVERBS_BENCH_PLOT_H_

#include <string>
#include <vector>

#include "bench/report.h"

namespace coverbs::bench {

// Three charts stacked, against message size (log2 axis), one colour per
// test: throughput, message rate, and latency p50 (solid) / p99 (dashed) on
// a log axis. Every point is marked, so a single size still shows.
std::string FormatSvg(const RunInfo& info, const std::vector<Result>& results);

// Axis labels that read at a glance (never "2.63e+03"):
// sizes 0, 64, 1K, 64K, 1M (binary); latencies 100 ns, 10 µs, 1 ms, 2 s;
// bandwidth 500 KB/s, 250 MB/s, 1.5 GB/s (decimal, as the table's MB/s);
// message rates 500/s, 50k/s, 1.5M/s.
std::string SizeLabel(double bytes);
std::string LatencyLabel(double us);
std::string BandwidthLabel(double mb_per_s);
std::string RateLabel(double per_s);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_PLOT_H_
