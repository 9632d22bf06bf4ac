// coverbs_bench --plot: the results drawn as an SVG chart.
#ifndef COVERBS_BENCH_PLOT_H_
#define COVERBS_BENCH_PLOT_H_

#include <string>
#include <vector>

#include "bench/report.h"

namespace coverbs::bench {

// Two charts stacked: throughput (MB/s) and message rate (Mpps) against
// message size (log2 axis), one line per test.
std::string FormatSvg(const RunInfo& info, const std::vector<Result>& results);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_PLOT_H_
