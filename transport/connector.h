// Connection establishment, one interface for every provider.
//
// A Connector makes RC connections for one Device on one Reactor: actively
// (Connect) or passively (Listen -> PassiveEndpoint -> IncomingRequest ->
// Accept / Reject). Each provider implements it the way its peers expect:
//   verbs: rdma_cm (rdma_connector.cc): the reactor watches the rdma_cm event
//          channel; address and route resolution, connect, listen, accept
//          and reject with private data, DISCONNECTED / TIMEWAIT handling;
//   soft:  a TCP connection with setup frames carrying the private data
//          (tcp_connector.cc), then the socket is handed to the soft QP;
//   loop:  a process-wide table of listening ports (loop_connector.cc);
//          the two in-process QPs are joined directly.
// OpenConnector() picks the implementation from the Device at run time; the
// layer above (cm) never names a provider.
//
// The connector knows nothing of what the private data means. It creates
// each connection's QP where the caller says (QpSetup: PD, CQ, options) and
// hands it to QpSetup::Adopt before anything leaves, so that the caller can
// post receives and then give the private data to send: the credits it
// announces are real before the peer can send.
//
// Errors name the step, the address and the port: resolve timeouts and an
// unanswered connect -> DeadlineExceeded; address / route resolution
// failures, an unreachable peer and a port with no listener -> Unavailable
// ("unreachable" / "connection refused"); a reject carrying a reason ->
// PermissionDenied with that reason; device removal -> Aborted.
#ifndef COVERBS_TRANSPORT_CONNECTOR_H_
#define COVERBS_TRANSPORT_CONNECTOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/task.h"
#include "transport/completion_queue.h"
#include "transport/connection_link.h"
#include "transport/device.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {

// Where and how a connection's QP is created, and what the layer above does
// with it before the connector sends anything.
class QpSetup {
 public:
  virtual ~QpSetup() = default;
  virtual ProtectionDomain& pd() = 0;
  // Send completions (and receive completions unless recv_cq() differs).
  virtual CompletionQueue& cq() = 0;
  // Receive completions; another CQ only for a QP on a shared receive
  // queue (qp_options().srq), whose receives are reserved on that CQ.
  virtual CompletionQueue& recv_cq() { return cq(); }
  virtual const QpOptions& qp_options() = 0;
  // Takes the connection's new QP (INIT: receives may be posted, nothing
  // can be sent yet) and returns the private data to send with the connect
  // request or the accept. The connector keeps using the QP until it
  // returns (to connect it), so the caller keeps it alive until then.
  virtual absl::StatusOr<std::string> Adopt(std::unique_ptr<QueuePair> qp) = 0;
  // The QP last adopted will not be connected (an attempt is retried with a
  // fresh one): destroy it now rather than hold its resources meanwhile.
  virtual void Discard() = 0;
};

// An established connection, as the connector hands it over: the QP (owned
// by whoever Adopt gave it to) is connected (RTS).
struct Established {
  std::unique_ptr<ConnectionLink> link;
  // The peer's private data: from its accept (Connect). Empty for Accept,
  // whose peer's private data came with the request (ReadPrivateData).
  std::string private_data;
};

struct ConnectParams {
  std::string address;  // numeric IPv4 / IPv6, or a host name
  uint16_t port = 0;
  absl::Duration resolve_timeout = absl::Seconds(2);  // address, then route
  absl::Duration connect_timeout = absl::Seconds(5);  // until established
};

class Connector;

// A connection request received by a PassiveEndpoint. Destroying it without
// Accept or Reject drops it without an answer (the layer above rejects
// explicitly).
class IncomingRequest {
 public:
  virtual ~IncomingRequest() = default;
  const std::string& peer_address() const { return peer_address_; }
  uint16_t peer_port() const { return peer_port_; }

  // The requester's private data. soft: read from the socket (bounded by
  // `deadline`); a malformed or unexpected setup frame fails. verbs: it came
  // with the request.
  virtual Task<absl::StatusOr<std::string>> ReadPrivateData(
      absl::Time deadline) = 0;
  // Sends a reject carrying `reason` (cut at kMaxRejectReason bytes); the
  // requester's Connect fails with PermissionDenied naming it.
  virtual absl::Status Reject(std::string_view reason) = 0;
  // Creates the QP as `setup` says (on `on`: the connector of the reactor
  // the connection will run on, the listener's or another one of the same
  // device), answers with Adopt's private data and waits until the
  // connection is established, at most until `deadline`. If the QP cannot be
  // set up (its creation or Adopt fails), the request is rejected with that
  // failure's message as the reason (see rejected()) and the failure is
  // returned.
  virtual Task<absl::StatusOr<Established>> Accept(Connector& on,
                                                   QpSetup& setup,
                                                   absl::Time deadline) = 0;
  // Whether a reject was sent, and its reason.
  bool rejected() const { return rejected_; }
  const std::string& reject_reason() const { return reject_reason_; }

 protected:
  void set_peer(std::string address, uint16_t port) {
    peer_address_ = std::move(address);
    peer_port_ = port;
  }
  void set_rejected(std::string_view reason) {
    rejected_ = true;
    reject_reason_ = std::string(reason);
  }

 private:
  std::string peer_address_;
  uint16_t peer_port_ = 0;
  bool rejected_ = false;
  std::string reject_reason_;
};

// A bound, listening endpoint.
class PassiveEndpoint {
 public:
  virtual ~PassiveEndpoint() = default;
  virtual uint16_t port() const = 0;
  // The next connection request; DeadlineExceeded when none came within
  // `wait` (callers loop, checking whether they still want to listen).
  // Cancellable.
  virtual Task<absl::StatusOr<std::unique_ptr<IncomingRequest>>> Next(
      absl::Duration wait) = 0;
  // Stops listening; requests already returned stay valid.
  virtual void Close() = 0;
};

class Connector {
 public:
  virtual ~Connector() = default;
  // Resolves, creates the QP as `setup` says, connects with Adopt's private
  // data, and waits until established. Cancellable (stop token).
  virtual Task<absl::StatusOr<Established>> Connect(const ConnectParams& params,
                                                    QpSetup& setup) = 0;
  // Binds and listens; port 0 picks a free port.
  virtual absl::StatusOr<std::shared_ptr<PassiveEndpoint>> Listen(
      const std::string& address, uint16_t port, int backlog) = 0;
};

// The connector for `device`'s provider; its events are handled on
// `reactor`, whose thread must run every call. select_connector.cc.
absl::StatusOr<std::unique_ptr<Connector>> OpenConnector(Device& device,
                                                         Reactor& reactor);

// The reject payload both connectors send: u32 kRejectMagic ("CVBR"),
// u16 length, then the reason (at most kMaxRejectReason bytes, so that it
// fits IB's 148-byte reject private data).
inline constexpr uint32_t kRejectMagic = 0x52425643;  // "CVBR"
inline constexpr size_t kMaxRejectReason = 140;
std::string EncodeReject(std::string_view reason);
// The reason inside a reject's private data, or "" if it is not ours.
std::string DecodeReject(std::span<const std::byte> data);

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_CONNECTOR_H_
