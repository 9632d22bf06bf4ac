// The seam between connection establishment (rdma_cm, or the soft
// provider's TCP setup) and messaging on the established connection (cm).
#ifndef COVERBS_TRANSPORT_CONNECTION_LINK_H_
#define COVERBS_TRANSPORT_CONNECTION_LINK_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/task.h"

namespace coverbs::transport {

// The connection-management side of one established connection: the
// rdma_cm id (verbs) or the setup socket (soft). Owned by the Connection,
// destroyed after its QueuePair (the QP is created on the cm_id).
class ConnectionLink {
 public:
  virtual ~ConnectionLink() = default;

  // Starts an orderly disconnect (rdma_disconnect; soft: the QP is moved to
  // error, which closes its socket). Idempotent. The QP goes to the error
  // state: everything outstanding is flushed.
  virtual void Disconnect() = 0;

  // Completes once the link is down: DISCONNECTED (and TIMEWAIT_EXIT where
  // the transport reports it) seen, or the soft socket closed. Bounded by
  // `timeout` (DeadlineExceeded). Safe to call more than once.
  virtual Task<absl::Status> WaitDown(absl::Duration timeout) = 0;

  // Registers the callback run on the context's reactor when the link goes
  // down without a local Disconnect (peer disconnect, peer process death
  // seen by the cm, DEVICE_REMOVAL, QP fatal async event). At most once.
  // The Connection uses it to fail its waiters and move the QP to error:
  // on siw, WRs posted after a peer TERMINATE never complete, so the
  // connection must stop posting as soon as the cm knows.
  virtual void OnDown(std::function<void(absl::Status)> fn) = 0;

  // "10.0.0.1:4791 -> 10.0.0.2:7471" style description for errors.
  virtual std::string Describe() const = 0;
};

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_CONNECTION_LINK_H_
