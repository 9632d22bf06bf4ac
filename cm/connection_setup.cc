#include "cm/connection_setup.h"

#include <algorithm>
#include <atomic>
#include <bit>

#include "absl/status/status.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"
#include "cm/handshake.h"
#include "cm/srq_pool.h"
#include "cm/wire.h"

namespace coverbs::cm::internal {

namespace {
std::atomic<int64_t> passive_start_delay_ns{0};
}  // namespace

void SetPassiveStartDelayForTest(absl::Duration delay) {
  passive_start_delay_ns.store(absl::ToInt64Nanoseconds(delay));
}
absl::Duration PassiveStartDelayForTest() {
  return absl::Nanoseconds(passive_start_delay_ns.load());
}

absl::StatusOr<transport::QpOptions> QpOptionsFor(Worker& ctx,
                                                  const ConnectionOptions& o) {
  transport::QpOptions q = o.qp;
  if (o.use_srq) {
    auto pool = SrqPool::For(ctx);
    if (!pool.ok()) return pool.status();
    q.srq = (*pool)->srq->provider();
  }
  const transport::DeviceCaps& caps = ctx.device().caps();
  // The send queue only bounds how much is posted at once (the QueuePair
  // queues the rest); credits bound what the peer must absorb.
  uint32_t send = SendDepth(o) + kCreditReserve + kCtsReserve + 4;
  uint32_t recv = o.recv_credits + kCreditReserve + kCtsReserve;
  if (caps.max_qp_wr != 0) {
    send = std::min(send, caps.max_qp_wr);
    recv = std::min(recv, caps.max_qp_wr);
  }
  q.max_send_wr = send;
  q.max_recv_wr = recv;
  q.max_send_sge = std::max<uint32_t>(q.max_send_sge, 2);
  if (caps.max_sge != 0)
    q.max_send_sge = std::min(q.max_send_sge, caps.max_sge);
  q.max_recv_sge = 1;
  return q;
}

absl::StatusOr<std::unique_ptr<ConnectionSetup>> ConnectionSetup::Create(
    Worker& ctx, const ConnectionOptions& options, bool active_side) {
  auto qos = QpOptionsFor(ctx, options);
  if (!qos.ok()) return qos.status();
  std::unique_ptr<ConnectionSetup> s(
      new ConnectionSetup(ctx, options, active_side));
  s->qp_options_ = *qos;
  return s;
}

ConnectionSetup::~ConnectionSetup() = default;

transport::CompletionQueue& ConnectionSetup::cq() {
  if (cq_ != nullptr) return *cq_;
  // Devices round queue depths up (rxe to 2^k - 1, siw to 2^k): ask for
  // room for the rounded depths, so that the QP's reservation fits.
  auto rounded = [](uint32_t n) {
    return static_cast<int>(std::bit_ceil(n + 1));
  };
  int need = rounded(qp_options_.max_send_wr) +
             (options_.use_srq ? 0 : rounded(qp_options_.max_recv_wr));
  auto cq = CqWithRoom(ctx_, need);
  // None: the first CQ, whose reservation then fails with the reason.
  cq_ = cq.ok() ? *cq : &ctx_.cq();
  if (!cq.ok()) cq_error_ = cq.status();
  return *cq_;
}

absl::StatusOr<std::string> ConnectionSetup::Adopt(
    std::unique_ptr<transport::QueuePair> qp) {
  conn_.reset();
  // Posts the receive ring (or promises SRQ receives) before the handshake
  // announces the credits.
  auto impl =
      std::make_shared<ConnectionImpl>(ctx_, std::move(qp), options_, active_);
  absl::Status s = impl->Init();
  if (!s.ok()) return s;
  Handshake h = impl->LocalHandshake();
  h.app_data = app_data_;
  impl->set_local_handshake(h);
  conn_.reset(new Connection(std::move(impl)));
  if (!raw_.empty()) return raw_;
  return EncodeHandshake(h);
}

absl::StatusOr<std::unique_ptr<Connection>> ConnectionSetup::Start(
    PeerInfo peer, std::unique_ptr<transport::ConnectionLink> link) {
  if (conn_ == nullptr) {
    return absl::InternalError("connection setup: no QP was adopted");
  }
  absl::Status s = conn_->impl_->Start(std::move(peer), std::move(link));
  if (!s.ok()) return s;
  return std::move(conn_);
}

Task<absl::Status> ConnectionSetup::WaitPeerSpoke(Connection& conn,
                                                  absl::Time deadline) {
  return conn.impl_->WaitPeerSpoke(deadline);
}

}  // namespace coverbs::cm::internal
