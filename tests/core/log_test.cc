#include "core/log.h"

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace coverbs {
namespace {

struct Captured {
  // std::mutex, not absl::Mutex: Debian's prebuilt absl is not built with
  // TSan, so TSan cannot see absl::Mutex's happens-before edges.
  std::mutex mu;
  std::vector<std::string> lines;
};

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = MinLogLevel();
    SetLogSink([this](const LogRecord& r) {
      std::lock_guard<std::mutex> lock(cap_.mu);
      cap_.lines.push_back(std::string(r.component) + "|" +
                           LogLevelName(r.level) + "|" +
                           std::string(r.message));
    });
  }
  void TearDown() override {
    SetLogSink(nullptr);
    SetMinLogLevel(saved_);
  }
  std::vector<std::string> Lines() {
    std::lock_guard<std::mutex> lock(cap_.mu);
    return cap_.lines;
  }
  Captured cap_;
  LogLevel saved_;
};

TEST_F(LogTest, SinkGetsRecordsAtOrAboveTheMinimumLevel) {
  SetMinLogLevel(LogLevel::kWarning);
  int formatted = 0;
  auto count = [&formatted]() {
    ++formatted;
    return 7;
  };
  COVERBS_LOG(kInfo, "cm", "dropped %d", count());
  COVERBS_LOG(kWarning, "cm", "kept %d", count());
  COVERBS_LOG(kError, "rpc", "also kept");
  // A dropped record is not even formatted.
  EXPECT_EQ(formatted, 1);
  EXPECT_EQ(Lines(),
            (std::vector<std::string>{"cm|W|kept 7", "rpc|E|also kept"}));
  SetMinLogLevel(LogLevel::kOff);
  COVERBS_LOG(kError, "rpc", "off");
  EXPECT_EQ(Lines().size(), 2u);
}

TEST_F(LogTest, ManyThreadsLogWhileTheSinkIsReplaced) {
  SetMinLogLevel(LogLevel::kInfo);
  std::atomic<int> other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 500; ++i) COVERBS_LOG(kInfo, "t", "line %d", i);
    });
  }
  for (int i = 0; i < 50; ++i) {
    SetLogSink([&other](const LogRecord&) { other.fetch_add(1); });
  }
  for (auto& th : threads) th.join();
  // Every record went to exactly one of the sinks.
  EXPECT_EQ(static_cast<int>(Lines().size()) + other.load(), 4 * 500);
}

TEST(LogLimiterTest, OnePerIntervalAndCountsTheRest) {
  LogLimiter limiter(absl::Milliseconds(200));
  uint64_t suppressed = 99;
  EXPECT_TRUE(limiter.Allow(&suppressed));
  EXPECT_EQ(suppressed, 0u);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Allow(&suppressed));
  absl::SleepFor(absl::Milliseconds(250));
  EXPECT_TRUE(limiter.Allow(&suppressed));
  EXPECT_EQ(suppressed, 5u);
}

}  // namespace
}  // namespace coverbs
