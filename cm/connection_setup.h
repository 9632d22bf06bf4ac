// Internal: what the connect and the accept path do with the QP a
// transport::Connector creates -- wrap it in an unstarted Connection (its
// receives posted, so the credits in the handshake are real), hand back the
// handshake as private data, and start the Connection once established.
#ifndef COVERBS_CM_CONNECTION_SETUP_H_
#define COVERBS_CM_CONNECTION_SETUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "transport/connector.h"

namespace coverbs::cm::internal {

// ConnectionOptions::send_depth with its default (0) resolved.
inline uint32_t SendDepth(const ConnectionOptions& o) {
  if (o.send_depth != 0) return o.send_depth;
  return o.use_srq ? 16 : 64;
}

// Tests: the passive side waits this long between the connector's accept
// and Start, as when rdma_cm's ESTABLISHED comes late (a lost RTU on a
// lossy wire) while the peer, established already, sends. Zero: off.
void SetPassiveStartDelayForTest(absl::Duration delay);
absl::Duration PassiveStartDelayForTest();

// The QP options a connection with `options` needs (depths, SRQ). Creates
// the Worker's SRQ on first use.
absl::StatusOr<transport::QpOptions> QpOptionsFor(
    Worker& ctx, const ConnectionOptions& options);

class ConnectionSetup final : public transport::QpSetup {
 public:
  ~ConnectionSetup() override;
  // Fails when `options` cannot be met on `ctx` (no SRQ for use_srq, ...).
  static absl::StatusOr<std::unique_ptr<ConnectionSetup>> Create(
      Worker& ctx, const ConnectionOptions& options, bool active_side);

  // The active side's application data, shown to the listener.
  void set_app_data(std::string app_data) { app_data_ = std::move(app_data); }
  // Tests: private data sent instead of the encoded handshake.
  void set_raw_private_data(std::string raw) { raw_ = std::move(raw); }

  transport::ProtectionDomain& pd() override { return ctx_.pd(); }
  // A CQ with room for this connection's QP, picked when the connector
  // creates the QP (CqWithRoom); the shared receive queue's CQ for its
  // receives.
  transport::CompletionQueue& cq() override;
  // Why no CQ had room (then the QP's creation failed on the first CQ).
  const absl::Status& cq_error() const { return cq_error_; }
  transport::CompletionQueue& recv_cq() override {
    return options_.use_srq ? ctx_.cq() : cq();
  }
  const transport::QpOptions& qp_options() override { return qp_options_; }
  absl::StatusOr<std::string> Adopt(
      std::unique_ptr<transport::QueuePair> qp) override;
  void Discard() override {
    conn_.reset();
    cq_ = nullptr;  // a retry picks again
  }

  // The connection is established: validates the peer's handshake against
  // ours and starts messaging.
  absl::StatusOr<std::unique_ptr<Connection>> Start(
      PeerInfo peer, std::unique_ptr<transport::ConnectionLink> link);
  // The passive side: until `conn`'s peer sent its first message (see
  // ConnectionImpl::WaitPeerSpoke).
  static Task<absl::Status> WaitPeerSpoke(Connection& conn,
                                          absl::Time deadline);

 private:
  ConnectionSetup(Worker& ctx, const ConnectionOptions& options, bool active)
      : ctx_(ctx), options_(options), active_(active) {}

  Worker& ctx_;
  ConnectionOptions options_;
  bool active_;
  transport::QpOptions qp_options_;
  transport::CompletionQueue* cq_ = nullptr;
  absl::Status cq_error_;
  std::string app_data_;
  std::string raw_;
  std::unique_ptr<Connection> conn_;
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CONNECTION_SETUP_H_
