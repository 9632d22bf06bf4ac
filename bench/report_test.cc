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

}  // namespace
}  // namespace coverbs::bench
