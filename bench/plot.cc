#include "bench/plot.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace coverbs::bench {

std::string FormatSvg(const RunInfo& info, const std::vector<Result>& results) {
  // Series per test; x = log2(size) (size 0 is drawn at x = 0).
  std::map<std::string, std::vector<const Result*>> series;
  double xmin = 1e9, xmax = -1e9, bwmax = 0, ratemax = 0;
  for (const Result& r : results) {
    series[TestName(r.test)].push_back(&r);
    double x = r.size == 0 ? 0 : std::log2(static_cast<double>(r.size));
    xmin = std::min(xmin, x);
    xmax = std::max(xmax, x);
    bwmax = std::max(bwmax, r.MBps());
    ratemax = std::max(ratemax, r.Mpps());
  }
  if (results.empty()) xmin = 0, xmax = 1;
  if (xmax - xmin < 1) xmax = xmin + 1;
  if (bwmax <= 0) bwmax = 1;
  if (ratemax <= 0) ratemax = 1;
  const int W = 760, H = 300, L = 80, R = 150, T = 40, B = 40;
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
      "height=\"100%%\" fill=\"white\"/>\n<text x=\"%d\" y=\"20\" font-size=\"14\">coverbs_bench: "
      "%s, %s, poll %s</text>\n",
      W, 2 * H + 20, L, info.provider, info.mode, info.poll);
  auto chart = [&](int y0, const char* title, double ymax, auto value) {
    const int pw = W - L - R, ph = H - T - B;
    auto px = [&](double x) { return L + (x - xmin) / (xmax - xmin) * pw; };
    auto py = [&](double v) { return y0 + T + ph - v / ymax * ph; };
    absl::StrAppendFormat(&out,
                          "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" "
                          "stroke=\"#444\"/>\n<text x=\"%d\" y=\"%d\">%s</text>\n",
                          L, y0 + T, pw, ph, L, y0 + T - 8, title);
    for (int i = 0; i <= 4; ++i) {
      double v = ymax * i / 4;
      absl::StrAppendFormat(&out,
                            "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                            "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.3g</text>\n",
                            L, L + pw, py(v), py(v), L - 6, py(v) + 4, v);
    }
    for (int x = static_cast<int>(std::ceil(xmin)); x <= static_cast<int>(xmax); ++x) {
      std::string label = x >= 20   ? absl::StrCat(1 << (x - 20), "M")
                          : x >= 10 ? absl::StrCat(1 << (x - 10), "K")
                                    : absl::StrCat(1 << x);
      absl::StrAppendFormat(&out,
                            "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n",
                            px(x), y0 + T + ph + 16, label);
    }
    int k = 0;
    for (const auto& [name, rs] : series) {
      const char* color = colors[k % 6];
      std::string pts;
      for (const Result* r : rs) {
        double x = r->size == 0 ? 0 : std::log2(static_cast<double>(r->size));
        absl::StrAppendFormat(&pts, "%.1f,%.1f ", px(x), py(value(*r)));
      }
      absl::StrAppendFormat(&out,
                            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
                            "points=\"%s\"/>\n<text x=\"%d\" y=\"%d\" fill=\"%s\">%s</text>\n",
                            color, pts, L + pw + 10, y0 + T + 14 + 16 * k, color, name);
      ++k;
    }
    absl::StrAppendFormat(&out, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">message size "
                                "(bytes)</text>\n",
                          L + pw / 2, y0 + H - 4);
  };
  chart(20, "throughput (MB/s)", bwmax * 1.05, [](const Result& r) { return r.MBps(); });
  chart(20 + H, "message rate (Mpps)", ratemax * 1.05, [](const Result& r) { return r.Mpps(); });
  out += "</svg>\n";
  return out;
}

}  // namespace coverbs::bench
