#include "cm/connection_setup.h"

#include "absl/status/status.h"
#include "cm/handshake.h"

namespace coverbs::cm::internal {

absl::StatusOr<std::unique_ptr<ConnectionSetup>> ConnectionSetup::Create(
    Context& ctx, const ConnectionOptions& options, bool active_side) {
  auto qos = Connection::QpOptionsFor(ctx, options);
  if (!qos.ok()) return qos.status();
  std::unique_ptr<ConnectionSetup> s(
      new ConnectionSetup(ctx, options, active_side));
  s->qp_options_ = *qos;
  return s;
}

absl::StatusOr<std::string> ConnectionSetup::Adopt(
    std::unique_ptr<transport::QueuePair> qp) {
  conn_.reset();
  auto conn =
      Connection::CreateUnstarted(ctx_, std::move(qp), options_, active_);
  if (!conn.ok()) return conn.status();
  conn_ = *std::move(conn);
  if (!raw_.empty()) return raw_;
  Handshake h = conn_->LocalHandshake();
  h.app_data = app_data_;
  return EncodeHandshake(h);
}

absl::StatusOr<std::unique_ptr<Connection>> ConnectionSetup::Start(
    PeerInfo peer, std::unique_ptr<transport::ConnectionLink> link) {
  if (conn_ == nullptr) {
    return absl::InternalError("connection setup: no QP was adopted");
  }
  absl::Status s = conn_->Start(std::move(peer), std::move(link));
  if (!s.ok()) return s;
  return std::move(conn_);
}

}  // namespace coverbs::cm::internal
