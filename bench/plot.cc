#include "bench/plot.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace coverbs::bench {
namespace {

// `v` in the largest of `units` (each `base` times the one before) that
// keeps it >= 1, with up to `digits` significant digits: 1536 -> "1.5K".
std::string Scaled(double v, double base, const char* const* units, int n,
                   int digits, const char* sep) {
  if (v == 0) return absl::StrCat("0", sep, units[0]);
  int i = 0;
  while (i + 1 < n && std::abs(v) >= base) {
    v /= base;
    ++i;
  }
  std::string s = absl::StrFormat("%.*g", digits, v);
  // Rounding may carry into the next unit (999.7 -> "1e+03").
  if (s.find('e') != std::string::npos) s = absl::StrFormat("%.0f", v);
  return absl::StrCat(s, sep, units[i]);
}

// A step of 1, 2, 2.5 or 5 times a power of ten, so that about `ticks`
// steps cover [0, max].
double NiceStep(double max, int ticks) {
  double raw = max / ticks;
  double mag = std::pow(10, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c",
                                   "#9467bd", "#ff7f0e", "#8c564b"};
constexpr int kWidth = 820, kPanel = 270, kLeft = 90, kRight = 150, kTop = 36,
              kBottom = 40;

double X(const Result& r) {
  return r.size == 0 ? 0 : std::log2(static_cast<double>(r.size));
}

// One chart: the frame, the size axis, the y ticks and one line per series.
class Panel {
 public:
  Panel(std::string* out, int y0, double xmin, double xmax)
      : out_(out), y0_(y0), xmin_(xmin), xmax_(xmax) {}

  double px(double x) const {
    return kLeft + (x - xmin_) / (xmax_ - xmin_) * pw_;
  }
  // `frac` of the height, from the bottom.
  double py(double frac) const { return y0_ + kTop + ph_ - frac * ph_; }

  void Frame(const std::string& title) {
    absl::StrAppendFormat(
        out_,
        "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" "
        "stroke=\"#444\"/>\n<text x=\"%d\" y=\"%d\" font-size=\"13\" "
        "font-weight=\"bold\">%s</text>\n",
        kLeft, y0_ + kTop, pw_, ph_, kLeft, y0_ + kTop - 8, title);
    // A label at every power of two, or every 2nd, 4th... when they would
    // crowd (at most about 12 across).
    const int first = static_cast<int>(std::ceil(xmin_));
    const int last = static_cast<int>(std::floor(xmax_));
    int every = 1;
    while ((last - first) / every > 12) every *= 2;
    for (int x = first; x <= last; ++x) {
      const bool label = (x - first) % every == 0;
      absl::StrAppendFormat(out_,
                            "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" "
                            "stroke=\"%s\"/>\n",
                            px(x), px(x), y0_ + kTop, y0_ + kTop + ph_,
                            label ? "#ddd" : "#f2f2f2");
      if (label) {
        absl::StrAppendFormat(
            out_,
            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n",
            px(x), y0_ + kTop + ph_ + 16, SizeLabel(std::exp2(x)));
      }
    }
    absl::StrAppendFormat(
        out_,
        "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#444\">"
        "message size (bytes)</text>\n",
        kLeft + pw_ / 2, y0_ + kTop + ph_ + 32);
  }

  void YTick(double frac, const std::string& label, bool major = true) {
    absl::StrAppendFormat(
        out_,
        "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>\n",
        kLeft, kLeft + pw_, py(frac), py(frac), major ? "#ddd" : "#f2f2f2");
    if (!label.empty()) {
      absl::StrAppendFormat(
          out_, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
          kLeft - 6, py(frac) + 4, label);
    }
  }

  // A line through (x, frac) points, each marked; `legend` beside the chart
  // in row `row`.
  void Series(const std::vector<std::pair<double, double>>& pts,
              const char* color, bool dashed, const std::string& legend,
              int row) {
    std::string line;
    for (const auto& [x, f] : pts)
      absl::StrAppendFormat(&line, "%.1f,%.1f ", px(x), py(f));
    absl::StrAppendFormat(
        out_,
        "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s "
        "points=\"%s\"/>\n",
        color, dashed ? " stroke-dasharray=\"6,4\"" : "", line);
    for (const auto& [x, f] : pts) {
      absl::StrAppendFormat(
          out_, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
          px(x), py(f), dashed ? "white" : color);
      if (dashed) {
        absl::StrAppendFormat(
            out_,
            "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"none\" "
            "stroke=\"%s\"/>\n",
            px(x), py(f), color);
      }
    }
    if (!legend.empty()) {
      const int ly = y0_ + kTop + 14 + 18 * row;
      absl::StrAppendFormat(
          out_,
          "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"%s\" "
          "stroke-width=\"2\"%s/><text x=\"%d\" y=\"%d\" fill=\"%s\">%s"
          "</text>\n",
          kLeft + pw_ + 10, kLeft + pw_ + 34, ly - 4, ly - 4, color,
          dashed ? " stroke-dasharray=\"6,4\"" : "", kLeft + pw_ + 40, ly,
          color, legend);
    }
  }

 private:
  std::string* out_;
  int y0_;
  double xmin_, xmax_;
  int pw_ = kWidth - kLeft - kRight;
  int ph_ = kPanel - kTop - kBottom;
};

}  // namespace

std::string SizeLabel(double bytes) {
  static constexpr const char* kUnits[] = {"", "K", "M", "G", "T"};
  return Scaled(bytes, 1024, kUnits, 5, 4, "");
}

std::string LatencyLabel(double us) {
  static constexpr const char* kUnits[] = {"ns", "µs", "ms", "s"};
  return Scaled(us * 1e3, 1000, kUnits, 4, 3, " ");
}

std::string BandwidthLabel(double mb_per_s) {
  static constexpr const char* kUnits[] = {"B/s", "KB/s", "MB/s", "GB/s",
                                           "TB/s"};
  return Scaled(mb_per_s * 1e6, 1000, kUnits, 5, 3, " ");
}

std::string RateLabel(double per_s) {
  static constexpr const char* kUnits[] = {"/s", "k/s", "M/s", "G/s"};
  return Scaled(per_s, 1000, kUnits, 4, 3, "");
}

std::string FormatSvg(const RunInfo& info, const std::vector<Result>& results) {
  // Series per test, in the order of the results.
  std::map<std::string, std::vector<const Result*>> series;
  std::vector<std::string> order;
  double xmin = 1e9, xmax = -1e9, bwmax = 0, ratemax = 0;
  double latmin = 1e18, latmax = 0;
  for (const Result& r : results) {
    const std::string name = TestName(r.test);
    if (series.find(name) == series.end()) order.push_back(name);
    series[name].push_back(&r);
    xmin = std::min(xmin, X(r));
    xmax = std::max(xmax, X(r));
    bwmax = std::max(bwmax, r.MBps());
    ratemax = std::max(ratemax, r.Mpps() * 1e6);
    for (double v : {r.lat_p50, r.lat_p99}) {
      if (v > 0) {
        latmin = std::min(latmin, v);
        latmax = std::max(latmax, v);
      }
    }
  }
  if (results.empty()) xmin = 0, xmax = 1;
  if (xmax - xmin < 1) {
    xmin -= 0.5;
    xmax += 0.5;
  }
  if (latmax <= 0) latmin = 1, latmax = 10;

  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
      "height=\"100%%\" fill=\"white\"/>\n<text x=\"%d\" y=\"20\" "
      "font-size=\"14\">"
      "coverbs_bench: %s, %s, poll %s, %d thread(s)%s%s</text>\n",
      kWidth, 3 * kPanel + 30, kLeft, info.provider, info.mode, info.poll,
      info.threads, info.host.empty() ? "" : ", ", info.host);
  if (!info.time.empty()) {
    absl::StrAppendFormat(
        &out,
        "<text x=\"%d\" y=\"20\" text-anchor=\"end\" fill=\"#666\">"
        "%s</text>\n",
        kWidth - 10, info.time);
  }

  // A linear chart from 0 with nicely spaced ticks.
  auto linear = [&](int y0, const std::string& title, double max,
                    const std::function<double(const Result&)>& value,
                    std::string (*label)(double)) {
    Panel p(&out, y0, xmin, xmax);
    p.Frame(title);
    if (max <= 0) max = 1;
    const double step = NiceStep(max, 4);
    const double top = std::ceil(max * 1.02 / step) * step;
    for (double v = 0; v <= top * (1 + 1e-9); v += step)
      p.YTick(v / top, label(v));
    int row = 0;
    for (const std::string& name : order) {
      std::vector<std::pair<double, double>> pts;
      for (const Result* r : series[name])
        pts.push_back({X(*r), value(*r) / top});
      p.Series(pts, kColors[row % 6], false, name, row);
      ++row;
    }
  };
  linear(
      30, "throughput", bwmax, [](const Result& r) { return r.MBps(); },
      BandwidthLabel);
  linear(
      30 + kPanel, "message rate (messages per second)", ratemax,
      [](const Result& r) { return r.Mpps() * 1e6; }, RateLabel);

  // Latency on a log axis from the decade below the smallest p50 to the
  // decade above the largest p99.
  Panel p(&out, 30 + 2 * kPanel, xmin, xmax);
  p.Frame("latency: p50 solid, p99 dashed (log scale)");
  const double lo = std::floor(std::log10(latmin));
  double hi = std::ceil(std::log10(latmax));
  if (hi <= lo) hi = lo + 1;
  auto frac = [&](double us) {
    return (std::log10(std::max(us, std::pow(10, lo))) - lo) / (hi - lo);
  };
  for (double d = lo; d <= hi; ++d) {
    p.YTick(frac(std::pow(10, d)), LatencyLabel(std::pow(10, d)));
    if (d < hi) {
      for (int m : {2, 5}) {
        p.YTick(frac(m * std::pow(10, d)),
                hi - lo <= 2 ? LatencyLabel(m * std::pow(10, d)) : "", false);
      }
    }
  }
  int row = 0;
  for (const std::string& name : order) {
    std::vector<std::pair<double, double>> p50, p99;
    for (const Result* r : series[name]) {
      p50.push_back({X(*r), frac(r->lat_p50)});
      p99.push_back({X(*r), frac(r->lat_p99)});
    }
    p.Series(p50, kColors[row % 6], false, name, row);
    p.Series(p99, kColors[row % 6], true, "", row);
    ++row;
  }
  out += "</svg>\n";
  return out;
}

}  // namespace coverbs::bench
