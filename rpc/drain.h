// How a draining server refuses a call, and how a client recognises it.
//
// While rpc::Server::Shutdown(drain) drains, calls already running finish
// and every new request is answered with UNAVAILABLE whose message starts
// with kServerDraining: the handler never ran, so the caller may send the
// call to another server (rpc::ClientPool does so by itself).
#ifndef COVERBS_RPC_DRAIN_H_
#define COVERBS_RPC_DRAIN_H_

#include "absl/status/status.h"
#include "absl/strings/match.h"

namespace coverbs::rpc {

inline constexpr char kServerDraining[] = "server draining";

// True for the status of a call a draining server refused without running
// it (the client may prefix the message with the method's name).
inline bool IsServerDraining(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable &&
         absl::StrContains(s.message(), kServerDraining);
}

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_DRAIN_H_
