#include "bench/report.h"

#include <algorithm>

#include "bench/plot.h"
#include "gtest/gtest.h"

namespace coverbs::bench {
namespace {

TEST(ParseSizes, ListsRangesAndSuffixes) {
  auto v = ParseSizes("2..8M");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), 23u);
  EXPECT_EQ(v->front(), 2u);
  EXPECT_EQ(v->back(), 8u << 20);
  v = ParseSizes("0,64,4K,1m,3..16");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<uint64_t>{0, 64, 4096, 1 << 20, 4, 8, 16}));
}

TEST(ParseSizes, RejectsGarbage) {
  EXPECT_FALSE(ParseSizes("").ok());
  EXPECT_FALSE(ParseSizes("abc").ok());
  EXPECT_FALSE(ParseSizes("8..2").ok());
  EXPECT_FALSE(ParseSizes("0..4").ok());
  EXPECT_FALSE(ParseSizes("99999999999G").ok());
}

TEST(ParseTests, NamesAndAll) {
  auto t = ParseTests("send_bw,rpc_lat");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, (std::vector<bench::Test>{bench::Test::kSendBw,
                                          bench::Test::kRpcLat}));
  t = ParseTests("all");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->size(), 6u);
  EXPECT_FALSE(ParseTests("send_bandwidth").ok());
}

Result Sample() {
  Result r;
  r.test = bench::Test::kWriteBw;
  r.size = 1 << 20;
  r.iterations = 1000;
  r.seconds = 0.5;
  r.lat_min = 1;
  r.lat_p50 = 2;
  r.lat_p99 = 3;
  r.lat_p999 = 4;
  r.lat_max = 5;
  r.cpu_us_client = 1.5;
  return r;
}

TEST(Report, Figures) {
  Result r = Sample();
  EXPECT_DOUBLE_EQ(r.MBps(), (1 << 20) * 1000 / 0.5 / 1e6);
  EXPECT_DOUBLE_EQ(r.Gbps(), r.MBps() * 8 / 1000);
  EXPECT_DOUBLE_EQ(r.Mpps(), 2000 / 1e6);
}

TEST(Report, TableJsonCsvSvg) {
  std::vector<Result> rs = {Sample()};
  rs.push_back(Sample());
  rs[1].size = 4096;
  rs[1].mismatches = 2;
  std::string table = FormatTable(rs);
  EXPECT_NE(table.find("BW Gb/s"), std::string::npos);
  EXPECT_NE(table.find("write_bw"), std::string::npos);
  EXPECT_NE(table.find("FAILED: 0 errors, 2 mismatches"), std::string::npos);

  RunInfo info;
  info.provider = "soft";
  info.mode = "loopback";
  info.host = "h\"x";
  std::string json = FormatJson(info, rs);
  EXPECT_NE(json.find("\"host\": \"h\\\"x\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"bytes\": 1048576"), std::string::npos);
  EXPECT_NE(
      json.find("\"cpu_us_per_msg\": {\"client\": 1.5, \"server\": null}"),
      std::string::npos)
      << json;
  EXPECT_NE(json.find("\"mismatches\": 2"), std::string::npos);

  std::string csv = FormatCsv(rs);
  EXPECT_EQ(csv.substr(0, csv.find(',')), "test");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 3);

  std::string svg = FormatSvg(info, rs);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("polyline"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
}

TEST(Plot, ReadableTickLabels) {
  EXPECT_EQ(SizeLabel(0), "0");
  EXPECT_EQ(SizeLabel(64), "64");
  EXPECT_EQ(SizeLabel(1000), "1000");
  EXPECT_EQ(SizeLabel(1024), "1K");
  EXPECT_EQ(SizeLabel(1536), "1.5K");
  EXPECT_EQ(SizeLabel(65536), "64K");
  EXPECT_EQ(SizeLabel(1 << 20), "1M");
  EXPECT_EQ(SizeLabel(8.0 * (1 << 30)), "8G");
  EXPECT_EQ(LatencyLabel(0.1), "100 ns");
  EXPECT_EQ(LatencyLabel(10), "10 µs");
  EXPECT_EQ(LatencyLabel(1000), "1 ms");
  EXPECT_EQ(LatencyLabel(2500), "2.5 ms");
  EXPECT_EQ(LatencyLabel(2e6), "2 s");
  EXPECT_EQ(BandwidthLabel(0), "0 B/s");
  EXPECT_EQ(BandwidthLabel(0.5), "500 KB/s");
  EXPECT_EQ(BandwidthLabel(250), "250 MB/s");
  EXPECT_EQ(BandwidthLabel(1500), "1.5 GB/s");
  EXPECT_EQ(RateLabel(0), "0/s");
  EXPECT_EQ(RateLabel(500), "500/s");
  EXPECT_EQ(RateLabel(50000), "50k/s");
  EXPECT_EQ(RateLabel(1.5e6), "1.5M/s");
  EXPECT_EQ(RateLabel(999.7), "1000/s");  // rounding never prints "1e+03"
}

TEST(Plot, ThreePanelsWithLatencyPercentiles) {
  std::vector<Result> rs;
  for (uint64_t size : {64u, 4096u, 1u << 20}) {
    Result r = Sample();
    r.size = size;
    r.lat_p50 = size / 100.0 + 5;  // 5.64 µs .. 10.5 ms
    r.lat_p99 = 2 * r.lat_p50;
    rs.push_back(r);
  }
  RunInfo info;
  info.provider = "soft";
  std::string svg = FormatSvg(info, rs);
  for (const char* want :
       {">throughput<", ">message rate (messages per second)<",
        ">latency: p50 solid, p99 dashed (log scale)<", ">1 µs<", ">10 ms<",
        ">100 ms<", ">64<", ">4K<", ">1M<", "stroke-dasharray"}) {
    EXPECT_NE(svg.find(want), std::string::npos) << want;
  }
  // One solid and one dashed line in the latency panel, one line in each
  // of the two others; a marker per point.
  size_t lines = 0, markers = 0;
  for (size_t at = 0; (at = svg.find("<polyline", at)) != std::string::npos;
       ++at)
    ++lines;
  for (size_t at = 0; (at = svg.find("<circle", at)) != std::string::npos; ++at)
    ++markers;
  EXPECT_EQ(lines, 4u);
  EXPECT_EQ(markers,
            3u * 3 + 3 * 2);  // p99 markers are drawn hollow (2 shapes)
  EXPECT_EQ(svg.find("e+0"), std::string::npos) << "exponent in a label";
}

}  // namespace
}  // namespace coverbs::bench
