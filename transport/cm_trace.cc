#include "transport/cm_trace.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace coverbs::transport::cm_trace {

bool TraceOn() {
  static const bool on = [] {
    const char* v = std::getenv("COVERBS_TRACE");
    return v != nullptr &&
           (std::strstr(v, "cm") != nullptr || std::strcmp(v, "all") == 0);
  }();
  return on;
}

void TraceLine(absl::string_view line) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  // One write per line so lines from several threads do not interleave.
  std::string out =
      absl::StrCat("coverbs-trace ", ts.tv_sec, ".",
                   absl::Dec(ts.tv_nsec / 1000, absl::kZeroPad6), " t",
                   static_cast<long>(syscall(SYS_gettid)), " ", line, "\n");
  fwrite(out.data(), 1, out.size(), stderr);
}

}  // namespace coverbs::transport::cm_trace
