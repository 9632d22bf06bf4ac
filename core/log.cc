#include "core/log.h"

#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"

namespace coverbs {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_min_level{kUnset};

std::mutex& SinkMu() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
// Guarded by SinkMu(); a copy is taken for each record, so a sink replaced
// while another thread is inside it stays alive until that call returns.
std::shared_ptr<const LogSink>& SinkSlot() {
  static auto* slot = new std::shared_ptr<const LogSink>;
  return *slot;
}

LogLevel LevelFromEnv() {
  const char* env = std::getenv("COVERBS_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  std::string v = absl::AsciiStrToLower(env);
  if (v == "debug") return LogLevel::kDebug;
  if (v == "info") return LogLevel::kInfo;
  if (v == "warning" || v == "warn") return LogLevel::kWarning;
  if (v == "error") return LogLevel::kError;
  if (v == "off" || v == "none") return LogLevel::kOff;
  return LogLevel::kInfo;
}

void DefaultSink(const LogRecord& r) {
  // One write(2) per line so that lines from several threads (and
  // processes sharing stderr) do not interleave.
  std::string line;
  line.reserve(r.component.size() + r.message.size() + 16);
  line.append("coverbs[").append(r.component).append("] ");
  line.append(LogLevelName(r.level)).append(": ").append(r.message);
  line.push_back('\n');
  size_t off = 0;
  while (off < line.size()) {
    ssize_t n = ::write(STDERR_FILENO, line.data() + off, line.size() - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

}  // namespace

const char* LogLevelName(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kError:
      return "E";
    case LogLevel::kOff:
      return "-";
  }
  return "?";
}

void SetLogSink(LogSink sink) {
  std::shared_ptr<const LogSink> s;
  if (sink) s = std::make_shared<const LogSink>(std::move(sink));
  std::lock_guard<std::mutex> lock(SinkMu());
  SinkSlot() = std::move(s);
}

void SetMinLogLevel(LogLevel level) {
  g_min_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel MinLogLevel() {
  int v = g_min_level.load(std::memory_order_relaxed);
  if (v == kUnset) {
    int from_env = static_cast<int>(LevelFromEnv());
    // Only the first reader sets it; a concurrent SetMinLogLevel wins.
    g_min_level.compare_exchange_strong(v, from_env, std::memory_order_relaxed);
    v = g_min_level.load(std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(v);
}

bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff &&
         static_cast<int>(level) >= static_cast<int>(MinLogLevel());
}

void Log(LogLevel level, std::string_view component, std::string_view message,
         const char* file, int line) {
  if (!LogEnabled(level)) return;
  LogRecord r{level, component, message, file, line};
  std::shared_ptr<const LogSink> sink;
  {
    std::lock_guard<std::mutex> lock(SinkMu());
    sink = SinkSlot();
  }
  if (sink) {
    (*sink)(r);
  } else {
    DefaultSink(r);
  }
}

bool LogLimiter::Allow(uint64_t* suppressed) {
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  while (now >= next) {
    if (next_ns_.compare_exchange_weak(
            next, now + absl::ToInt64Nanoseconds(interval_),
            std::memory_order_relaxed)) {
      *suppressed = dropped_.exchange(0, std::memory_order_relaxed);
      return true;
    }
  }
  dropped_.fetch_add(1, std::memory_order_relaxed);
  *suppressed = 0;
  return false;
}

}  // namespace coverbs
