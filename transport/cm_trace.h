// Opt-in tracing of connection management (the connectors and the cm layer)
// to stderr, for diagnosing setup and
// teardown on a real device: COVERBS_TRACE=cm prints every rdma_cm event,
// connect retry, connection failure and Close step, one line each with a
// monotonic timestamp and the thread. Off (one branch on a cached flag) when
// the variable is unset; never on the data path.
#ifndef COVERBS_TRANSPORT_CM_TRACE_H_
#define COVERBS_TRANSPORT_CM_TRACE_H_

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace coverbs::transport::cm_trace {

bool TraceOn();
void TraceLine(absl::string_view line);

// CM_TRACE("connect ", ep, ": attempt ", n): the arguments are only
// evaluated when tracing is on.
#define COVERBS_CM_TRACE(...)                                               \
  do {                                                                      \
    if (::coverbs::transport::cm_trace::TraceOn()) {                        \
      ::coverbs::transport::cm_trace::TraceLine(absl::StrCat(__VA_ARGS__)); \
    }                                                                       \
  } while (0)

}  // namespace coverbs::transport::cm_trace

#endif  // COVERBS_TRANSPORT_CM_TRACE_H_
