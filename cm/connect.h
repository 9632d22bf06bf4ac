// Connecting: co_await cm::Connect(worker, address, port[, options]).
//
//   auto conn = co_await cm::Connect(worker, "10.0.0.2", 7471);
//   if (!conn.ok()) ...  // why, naming the address, the port and the step
//
// The Worker's provider makes the connection (rdma_cm on verbs, a TCP
// setup on soft; both with the same steps and errors). Every step has a
// timeout, and every failure is a distinct Status naming the address, the
// port and the step: address / route resolution failures -> Unavailable
// "address|route resolution failed", resolve timeouts and an unanswered
// connect -> DeadlineExceeded, an unreachable peer and a port with no
// listener -> Unavailable ("unreachable" / "connection refused"), a reject
// -> PermissionDenied carrying the listener's reason (a handshake of another
// protocol version: "protocol version mismatch: ..."), device removal ->
// Aborted.
#ifndef COVERBS_CM_CONNECT_H_
#define COVERBS_CM_CONNECT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "core/task.h"

namespace coverbs::cm {

struct ConnectOptions {
  ConnectionOptions connection;
  absl::Duration resolve_timeout = absl::Seconds(2);  // address, then route
  absl::Duration connect_timeout = absl::Seconds(5);  // until ESTABLISHED
  std::string app_data;  // <= kMaxAppData bytes, shown to the listener
};

// Resolves, creates the QP on worker's CQ, connects with the handshake in the
// private data, waits for ESTABLISHED. Cancellable (stop token).
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Worker& worker, const std::string& address, uint16_t port,
    const ConnectOptions& options);
// With default options. (An overload, not a default argument: gcc 12
// mis-copies default-argument temporaries inside co_await expressions.)
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Worker& worker, const std::string& address, uint16_t port);

}  // namespace coverbs::cm

#endif  // COVERBS_CM_CONNECT_H_
