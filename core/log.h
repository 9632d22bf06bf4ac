// The library's log sink. coverbs never prints: every layer reports through
// Log(), and the application decides where lines go.
//
//   coverbs::SetLogSink([](const coverbs::LogRecord& r) { MyLogger(r); });
//   coverbs::SetMinLogLevel(coverbs::LogLevel::kWarning);
//   COVERBS_LOG(kInfo, "cm", "accepted %s", conn_name);
//
// Contract:
//  - One process-wide sink; the default writes one line per record to
//    stderr ("coverbs[cm] W: message"). SetLogSink(nullptr) restores it.
//  - Records below the minimum level are dropped before their message is
//    formatted (COVERBS_LOG checks LogEnabled first). The initial minimum is
//    kInfo, or COVERBS_LOG_LEVEL from the environment (debug, info, warning,
//    error, off) read at the first use.
//  - Thread-safe: any thread may log, set the sink or the level at any time.
//    A sink may be called from several threads at once and must not call
//    SetLogSink itself.
//  - No dependency beyond Abseil: every layer (the providers included) may
//    use it.
#ifndef COVERBS_CORE_LOG_H_
#define COVERBS_CORE_LOG_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string_view>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace coverbs {

enum class LogLevel : int {
  kDebug = 0,
  kInfo = 1,
  kWarning = 2,
  kError = 3,
  kOff = 4
};
const char* LogLevelName(LogLevel l);

struct LogRecord {
  LogLevel level;
  std::string_view component;  // "cm", "rpc", "transport", "soft", "verbs"...
  std::string_view message;    // one line, no trailing newline
  const char* file;
  int line;
};

using LogSink = std::function<void(const LogRecord&)>;

// Replaces the sink (nullptr: the default stderr sink).
void SetLogSink(LogSink sink);
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
bool LogEnabled(LogLevel level);

void Log(LogLevel level, std::string_view component, std::string_view message,
         const char* file = "", int line = 0);

// At most one record per `interval` gets through; the records suppressed in
// between are counted and reported with the next one that passes ("(and 12
// more like it)"). For bursts of one kind of event: an accept loop that
// keeps hitting EMFILE logs once per interval, not once per attempt.
// Thread-safe.
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration interval) : interval_(interval) {}
  // True if a record may go out now; *suppressed is the number dropped
  // since the last one that went out.
  bool Allow(uint64_t* suppressed);

 private:
  absl::Duration interval_;
  std::atomic<int64_t> next_ns_{0};
  std::atomic<uint64_t> dropped_{0};
};

}  // namespace coverbs

// COVERBS_LOG(kWarning, "cm", "format %s", args...): formats only when the
// level is enabled.
#define COVERBS_LOG(level, component, ...)                                \
  do {                                                                    \
    if (::coverbs::LogEnabled(::coverbs::LogLevel::level)) {              \
      ::coverbs::Log(::coverbs::LogLevel::level, component,               \
                     ::absl::StrFormat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                     \
  } while (0)

#endif  // COVERBS_CORE_LOG_H_
