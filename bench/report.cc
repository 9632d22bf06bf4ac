#include "bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace coverbs::bench {

const char* TestName(Test t) {
  switch (t) {
    case Test::kSendBw: return "send_bw";
    case Test::kWriteBw: return "write_bw";
    case Test::kReadBw: return "read_bw";
    case Test::kSendLat: return "send_lat";
    case Test::kRpcRate: return "rpc_rate";
    case Test::kRpcLat: return "rpc_lat";
  }
  return "?";
}

bool IsLatencyTest(Test t) { return t == Test::kSendLat || t == Test::kRpcLat; }

absl::StatusOr<std::vector<Test>> ParseTests(std::string_view s) {
  std::vector<Test> out;
  for (absl::string_view part : absl::StrSplit(std::string(s), ',', absl::SkipEmpty())) {
    std::string name = absl::AsciiStrToLower(absl::StripAsciiWhitespace(part));
    if (name == "all") {
      out.assign(std::begin(kAllTests), std::end(kAllTests));
      continue;
    }
    bool found = false;
    for (Test t : kAllTests) {
      if (name == TestName(t)) {
        out.push_back(t);
        found = true;
      }
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown test '", name,
          "' (send_bw, write_bw, read_bw, send_lat, rpc_rate, rpc_lat or all)"));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("no test given");
  return out;
}

namespace {

absl::StatusOr<uint64_t> ParseSize(std::string_view s) {
  std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(std::string(s)));
  uint64_t mult = 1;
  if (!t.empty()) {
    switch (t.back()) {
      case 'K': mult = 1ull << 10; break;
      case 'M': mult = 1ull << 20; break;
      case 'G': mult = 1ull << 30; break;
      default: break;
    }
    if (mult != 1) t.pop_back();
  }
  uint64_t v;
  if (t.empty() || !absl::SimpleAtoi(t, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("bad size '", std::string(s), "'"));
  }
  if (v > (1ull << 40) / mult) {
    return absl::InvalidArgumentError(absl::StrCat("size '", std::string(s), "' is too large"));
  }
  return v * mult;
}

}  // namespace

absl::StatusOr<std::vector<uint64_t>> ParseSizes(std::string_view s) {
  std::vector<uint64_t> out;
  for (absl::string_view part : absl::StrSplit(std::string(s), ',', absl::SkipEmpty())) {
    std::string p(part);
    size_t dots = p.find("..");
    if (dots == std::string::npos) {
      auto v = ParseSize(p);
      if (!v.ok()) return v.status();
      out.push_back(*v);
      continue;
    }
    auto lo = ParseSize(p.substr(0, dots));
    auto hi = ParseSize(p.substr(dots + 2));
    if (!lo.ok()) return lo.status();
    if (!hi.ok()) return hi.status();
    if (*lo == 0 || *lo > *hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad size range '", p, "': need 0 < low <= high"));
    }
    // Every power of two in [lo, hi], starting at lo rounded up.
    uint64_t v = 1;
    while (v < *lo) v <<= 1;
    for (; v <= *hi; v <<= 1) out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError("no size given");
  return out;
}

std::string FormatTable(const std::vector<Result>& results) {
  std::string out = absl::StrFormat(
      "%-9s %10s %10s %4s %5s %10s %10s %8s %9s %9s %9s %9s %9s %9s %9s %s\n", "#test",
      "bytes", "iters", "conn", "depth", "BW Gb/s", "BW MB/s", "Mpps", "lat min",
      "p50", "p99", "p999", "max(us)", "cpu cli", "cpu srv", "(cpu: us/msg)");
  for (const Result& r : results) {
    auto cpu = [](double v) {
      return v < 0 ? std::string("-") : absl::StrFormat("%.2f", v);
    };
    absl::StrAppendFormat(
        &out, "%-9s %10d %10d %4d %5d %10.3f %10.2f %8.4f %9.2f %9.2f %9.2f %9.2f %9.2f %9s %9s%s\n",
        TestName(r.test), r.size, r.iterations, r.connections, r.depth, r.Gbps(), r.MBps(),
        r.Mpps(), r.lat_min, r.lat_p50, r.lat_p99, r.lat_p999, r.lat_max, cpu(r.cpu_us_client),
        cpu(r.cpu_us_server),
        r.errors + r.mismatches > 0
            ? absl::StrFormat("  FAILED: %d errors, %d mismatches", r.errors, r.mismatches)
            : std::string(r.verified ? "  verified" : ""));
  }
  return out;
}

namespace {
std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}
std::string Num(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.6g", v);
}
}  // namespace

std::string FormatJson(const RunInfo& info, const std::vector<Result>& results) {
  std::string out = absl::StrCat(
      "{\n  \"tool\": \"coverbs_bench\",\n  \"provider\": ", JsonString(info.provider),
      ",\n  \"mode\": ", JsonString(info.mode), ",\n  \"poll\": ", JsonString(info.poll),
      ",\n  \"threads\": ", info.threads, ",\n  \"host\": ", JsonString(info.host),
      ",\n  \"time\": ", JsonString(info.time), ",\n  \"results\": [");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    absl::StrAppend(
        &out, i == 0 ? "\n" : ",\n", "    {\"test\": ", JsonString(TestName(r.test)),
        ", \"bytes\": ", r.size, ", \"iterations\": ", r.iterations,
        ", \"connections\": ", r.connections, ", \"depth\": ", r.depth,
        ", \"seconds\": ", Num(r.seconds), ", \"bw_gbps\": ", Num(r.Gbps()),
        ", \"bw_mbps\": ", Num(r.MBps()), ", \"mpps\": ", Num(r.Mpps()),
        ", \"lat_us\": {\"min\": ", Num(r.lat_min), ", \"p50\": ", Num(r.lat_p50),
        ", \"p99\": ", Num(r.lat_p99), ", \"p999\": ", Num(r.lat_p999),
        ", \"max\": ", Num(r.lat_max), "}");
    absl::StrAppend(&out, ", \"cpu_us_per_msg\": {\"client\": ",
                    r.cpu_us_client < 0 ? "null" : Num(r.cpu_us_client), ", \"server\": ",
                    r.cpu_us_server < 0 ? "null" : Num(r.cpu_us_server), "}",
                    ", \"errors\": ", r.errors, ", \"mismatches\": ", r.mismatches,
                    ", \"verified\": ", r.verified ? "true" : "false", "}");
  }
  absl::StrAppend(&out, "\n  ]\n}\n");
  return out;
}

std::string FormatCsv(const std::vector<Result>& results) {
  std::string out =
      "test,bytes,iterations,connections,depth,seconds,bw_gbps,bw_mbps,mpps,lat_min_us,"
      "lat_p50_us,lat_p99_us,lat_p999_us,lat_max_us,cpu_us_per_msg_client,"
      "cpu_us_per_msg_server,errors,mismatches,verified\n";
  for (const Result& r : results) {
    absl::StrAppend(&out, TestName(r.test), ",", r.size, ",", r.iterations, ",",
                    r.connections, ",", r.depth, ",", Num(r.seconds), ",", Num(r.Gbps()),
                    ",", Num(r.MBps()), ",", Num(r.Mpps()), ",", Num(r.lat_min), ",",
                    Num(r.lat_p50), ",", Num(r.lat_p99), ",", Num(r.lat_p999), ",",
                    Num(r.lat_max), ",", r.cpu_us_client < 0 ? "" : Num(r.cpu_us_client),
                    ",", r.cpu_us_server < 0 ? "" : Num(r.cpu_us_server), ",", r.errors,
                    ",", r.mismatches, ",", r.verified ? 1 : 0, "\n");
  }
  return out;
}

absl::Status WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot open ", path, " for writing"));
  f.write(contents.data(), contents.size());
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace coverbs::bench
