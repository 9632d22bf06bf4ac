// coverbs_bench's configuration parsing and result output (table, JSON,
// CSV, SVG plot). Separate from the runner so the formats are unit-tested.
#ifndef COVERBS_BENCH_REPORT_H_
#define COVERBS_BENCH_REPORT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace coverbs::bench {

enum class Test { kSendBw, kWriteBw, kReadBw, kSendLat, kRpcRate, kRpcLat };
inline constexpr Test kAllTests[] = {Test::kSendBw,  Test::kWriteBw, Test::kReadBw,
                                     Test::kSendLat, Test::kRpcRate, Test::kRpcLat};
const char* TestName(Test t);
// "send_bw,rpc_lat" or "all".
absl::StatusOr<std::vector<Test>> ParseTests(std::string_view s);
bool IsLatencyTest(Test t);

// Sizes: "4096", "64,4K,1M" (K/M/G are binary) or "2..8M" (every power of
// two from 2 to 8 MiB); the forms combine: "0,2..64".
absl::StatusOr<std::vector<uint64_t>> ParseSizes(std::string_view s);

struct Result {
  Test test = Test::kSendBw;
  uint64_t size = 0;
  uint64_t iterations = 0;  // messages / operations / calls, all connections
  int connections = 1;
  int depth = 1;
  double seconds = 0;
  // Latency in microseconds. send_lat: half the round trip (as perftest's
  // ib_send_lat); rpc_lat: the whole call; bandwidth tests: each
  // operation's time from post to completion (queueing included).
  double lat_min = 0, lat_p50 = 0, lat_p99 = 0, lat_p999 = 0, lat_max = 0;
  // CPU of each side's reactor threads (getrusage RUSAGE_THREAD) per
  // message, in microseconds; -1 when not measured.
  double cpu_us_client = -1, cpu_us_server = -1;
  uint64_t errors = 0;      // failed operations
  uint64_t mismatches = 0;  // --verify: corrupted or misordered data
  bool verified = false;

  double MBps() const { return seconds > 0 ? size * iterations / seconds / 1e6 : 0; }
  double Gbps() const { return MBps() * 8 / 1e3; }
  double Mpps() const { return seconds > 0 ? iterations / seconds / 1e6 : 0; }
};

struct RunInfo {
  std::string provider;  // "soft", "verbs (rxe0)"
  std::string mode;      // loopback | client
  std::string poll;
  int threads = 1;
  std::string host;
  std::string time;
};

// perftest-like table, one row per result.
std::string FormatTable(const std::vector<Result>& results);
std::string FormatJson(const RunInfo& info, const std::vector<Result>& results);
std::string FormatCsv(const std::vector<Result>& results);
absl::Status WriteFile(const std::string& path, std::string_view contents);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_REPORT_H_
