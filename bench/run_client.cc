#include "bench/run_client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/client.h"
#include "bench/driver.h"
#include "bench/flags.h"
#include "bench/plot.h"
#include "bench/report.h"

namespace coverbs::bench {
namespace {

Result Aggregate(Test test, uint64_t size, int conns, int depth, bool verify,
                 std::vector<ConnRun>& runs, double wall_seconds) {
  Result r;
  r.test = test;
  r.size = size;
  r.connections = conns;
  r.depth = IsLatencyTest(test) ? 1 : depth;
  r.verified = verify;
  r.seconds = wall_seconds;
  std::vector<int64_t> lat;
  for (ConnRun& c : runs) {
    r.iterations += c.ops;
    r.errors += c.errors;
    r.mismatches += c.mismatches;
    lat.insert(lat.end(), c.lat_ns.begin(), c.lat_ns.end());
  }
  std::sort(lat.begin(), lat.end());
  auto q = [&](double p) -> double {
    if (lat.empty()) return 0;
    size_t idx = std::min(lat.size() - 1,
                          static_cast<size_t>(p * (lat.size() - 1) + 0.5));
    return lat[idx] / 1e3;
  };
  r.lat_min = q(0);
  r.lat_p50 = q(0.5);
  r.lat_p99 = q(0.99);
  r.lat_p999 = q(0.999);
  r.lat_max = q(1);
  return r;
}

}  // namespace

int RunClient(Side* side, const std::string& address, uint16_t port,
              uint16_t rpc_port, const std::string& mode, int64_t corrupt) {
  auto tests = ParseTests(absl::GetFlag(FLAGS_test));
  auto sizes = ParseSizes(absl::GetFlag(FLAGS_sizes));
  if (!tests.ok() || !sizes.ok()) {
    std::fprintf(
        stderr, "coverbs_bench: %s\n",
        (!tests.ok() ? tests.status() : sizes.status()).ToString().c_str());
    return 2;
  }
  const int depth = absl::GetFlag(FLAGS_depth);
  const int conns = absl::GetFlag(FLAGS_connections);
  const int64_t iters = absl::GetFlag(FLAGS_iters);
  if (depth < 1 || depth > 4096 || conns < 1 || iters < 1) {
    std::fprintf(
        stderr,
        "coverbs_bench: need 1 <= --depth <= 4096, --connections >= 1, "
        "--iters >= 1\n");
    return 2;
  }
  for (uint64_t s : *sizes) {
    if (s > (64ull << 20) - 64) {
      std::fprintf(
          stderr, "coverbs_bench: size %llu exceeds the 64 MiB message limit\n",
          static_cast<unsigned long long>(s));
      return 2;
    }
  }
  std::string prog = absl::GetFlag(FLAGS_progress);
  const bool progress = prog == "on" || (prog == "auto" && isatty(2));

  Client client(side, address, port, rpc_port);
  if (absl::Status s = client.Connect(conns); !s.ok()) {
    std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  RunInfo info;
  info.provider = side->device->Describe();
  info.mode = mode;
  info.poll = absl::GetFlag(FLAGS_poll);
  info.threads = static_cast<int>(side->pool().size());
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  info.host = host;
  info.time = absl::FormatTime(absl::Now(), absl::UTCTimeZone());
  std::printf(
      "coverbs_bench: %s, provider %s, server %s:%u, %d connection(s), depth "
      "%d, "
      "%d thread(s), poll %s%s\n",
      mode.c_str(), info.provider.c_str(), address.c_str(), port, conns, depth,
      info.threads, info.poll.c_str(),
      absl::GetFlag(FLAGS_verify) ? ", verify on" : "");
  std::vector<Result> results;
  bool header = false;
  for (Test test : *tests) {
    if (test == Test::kRpcRate || test == Test::kRpcLat) {
      if (absl::Status s = client.ConnectRpc(); !s.ok()) {
        std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    for (uint64_t size : *sizes) {
      if ((test == Test::kWriteBw || test == Test::kReadBw) && size == 0)
        continue;
      if ((test == Test::kRpcRate || test == Test::kRpcLat) &&
          size > (64ull << 20) - 64) {
        continue;
      }
      RunSpec spec{test,
                   size,
                   static_cast<uint64_t>(iters),
                   depth,
                   absl::GetFlag(FLAGS_verify),
                   corrupt,
                   {}};
      const std::string label = absl::StrCat(TestName(test), " ", size);
      if (const int64_t warm = absl::GetFlag(FLAGS_warmup); warm > 0) {
        RunSpec w = spec;
        w.iters = warm;
        w.corrupt_message = -1;
        std::vector<ConnRun> discard;
        if (!client.RunBatch(w, &discard, false, label + " (warm-up)")) {
          std::fprintf(stderr, "coverbs_bench: %s: warm-up did not finish\n",
                       label.c_str());
          return 1;
        }
        for (const ConnRun& c : discard) {
          if (c.errors + c.mismatches > 0) {
            std::fprintf(stderr, "coverbs_bench: %s: warm-up failed: %s\n",
                         label.c_str(), c.first_error.c_str());
            return 1;
          }
        }
      }
      double srv0 = 0, srv1 = 0;
      absl::Status cs = client.ServerCpu(kOpCpuBegin, &srv0);
      const double cli0 = PoolCpuBlocking(side->pool());
      std::vector<ConnRun> runs;
      double wall = 0;
      const auto deadline = Clock::now() + absl::ToChronoNanoseconds(
                                               absl::GetFlag(FLAGS_duration));
      bool ok = true;
      do {
        size_t first = runs.size();
        ok = client.RunBatch(spec, &runs, progress, label);
        Clock::time_point s0 = runs[first].start, e0 = runs[first].end;
        for (size_t k = first; k < runs.size(); ++k) {
          s0 = std::min(s0, runs[k].start);
          e0 = std::max(e0, runs[k].end);
        }
        wall += std::chrono::duration<double>(e0 - s0).count();
      } while (ok && Clock::now() < deadline);
      const double cli1 = PoolCpuBlocking(side->pool());
      if (cs.ok() && ok) cs = client.ServerCpu(kOpCpuEnd, &srv1);
      Result r = Aggregate(test, size, conns, depth, spec.verify, runs, wall);
      if (r.iterations > 0) {
        r.cpu_us_client = (cli1 - cli0) * 1e6 / r.iterations;
        if (cs.ok()) r.cpu_us_server = srv1 * 1e6 / r.iterations;
      }
      if (!ok) ++r.errors;
      for (const ConnRun& c : runs) {
        if (!c.first_error.empty()) {
          std::fprintf(stderr, "coverbs_bench: %s: %s\n", label.c_str(),
                       c.first_error.c_str());
          break;
        }
      }
      std::string table = FormatTable({r});
      if (!header) {
        std::fputs(table.c_str(), stdout);
        header = true;
      } else {
        std::fputs(table.substr(table.find('\n') + 1).c_str(), stdout);
      }
      std::fflush(stdout);
      results.push_back(r);
      if (!ok) break;  // a connection may be unusable now
    }
  }
  int rc = 0;
  for (const Result& r : results) {
    if (r.errors + r.mismatches > 0) rc = 1;
  }
  auto write = [&](const std::string& flag, const std::string& contents) {
    if (flag.empty()) return;
    absl::Status s = WriteFile(flag, contents);
    if (!s.ok()) {
      std::fprintf(stderr, "coverbs_bench: %s\n", s.ToString().c_str());
      rc = 1;
    }
  };
  write(absl::GetFlag(FLAGS_json), FormatJson(info, results));
  write(absl::GetFlag(FLAGS_csv), FormatCsv(results));
  write(absl::GetFlag(FLAGS_plot), FormatSvg(info, results));
  if (rc != 0)
    std::fprintf(stderr,
                 "coverbs_bench: FAILED (errors or mismatches above)\n");
  return rc;
}

}  // namespace coverbs::bench
