// QpCore: posting, the error state, connection and destruction. The
// execution of one work request is in qp_exec.cc.
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/loop/qp.h"

namespace coverbs::transport::loop {

QpCore::QpCore(QpConfig cfg, std::shared_ptr<Wire> wire)
    : cfg_(std::move(cfg)),
      wire_(std::move(wire)),
      rq_(cfg_.srq ? 1 : std::max<uint32_t>(cfg_.init.max_recv_wr, 1),
          cfg_.init.max_recv_sge) {}

absl::Status QpCore::Connect(QpCore* a, QpCore* b) {
  if (a->wire_ != b->wire_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: connect qp %u and qp %u: not created on one wire", a->qp_num(),
        b->qp_num()));
  }
  std::lock_guard<std::mutex> lock(a->wire_->mu);
  if (a->state() != IBV_QPS_INIT || b->state() != IBV_QPS_INIT ||
      a->destroyed_ || b->destroyed_ || a->wire_->end[0] != nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "loop: connect qp %u and qp %u: both must be new (state INIT)",
        a->qp_num(), b->qp_num()));
  }
  a->wire_->end[0] = a;
  a->wire_->end[1] = b;
  a->side_ = 0;
  b->side_ = 1;
  a->state_.store(IBV_QPS_RTS, std::memory_order_release);
  b->state_.store(IBV_QPS_RTS, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status QpCore::CheckSendWr(const ibv_send_wr& wr) const {
  const char* why = nullptr;
  switch (wr.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_RDMA_READ:
      break;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      if (wr.num_sge != 1) why = "an atomic needs exactly one SGE";
      break;
    default:
      why = "opcode not supported by the loop provider (no memory windows, "
            "no SEND_WITH_INV)";
  }
  if (why == nullptr &&
      (wr.num_sge < 0 ||
       static_cast<uint32_t>(wr.num_sge) > cfg_.init.max_send_sge ||
       (wr.num_sge > 0 && wr.sg_list == nullptr))) {
    why = "num_sge exceeds max_send_sge (or a null sg_list)";
  }
  if (why == nullptr && (wr.send_flags & IBV_SEND_INLINE) != 0) {
    if (wr.opcode == IBV_WR_RDMA_READ ||
        wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP ||
        wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
      why = "IBV_SEND_INLINE on an operation that reads into local memory";
    } else {
      uint64_t total = 0;
      for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
      if (total > cfg_.init.max_inline_data) why = "inline data too long";
    }
  }
  if (why == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("loop: post send on qp %u: %s WR (wr_id 0x%x): %s "
                      "(EINVAL)",
                      qp_num(), WrOpcodeName(wr.opcode), wr.wr_id, why));
}

absl::Status QpCore::PostSend(ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> lock(wire_->mu);
  const ibv_qp_state st = state();
  if (st == IBV_QPS_INIT || destroyed_) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: post send on qp %u: QP is not connected (EINVAL)", qp_num()));
  }
  for (; wr != nullptr; wr = wr->next) {
    absl::Status s = CheckSendWr(*wr);
    if (s.ok() && pending_.size() >= cfg_.init.max_send_wr) {
      s = absl::ResourceExhaustedError(absl::StrFormat(
          "loop: post send on qp %u: send queue full (%u WRs) (ENOMEM)",
          qp_num(), cfg_.init.max_send_wr));
    }
    if (!s.ok()) {
      if (bad) *bad = wr;
      return s;
    }
    if (state() == IBV_QPS_ERR) {
      CompleteSendLocked(*wr, IBV_WC_WR_FLUSH_ERR, 0);
      continue;
    }
    PostOneLocked(*wr);
  }
  return absl::OkStatus();
}

void QpCore::PostOneLocked(const ibv_send_wr& wr) {
  if (!pending_.empty()) {  // behind a held SEND (RC order)
    SavePendingLocked(wr);
    return;
  }
  Outcome o = ExecuteLocked(wr, nullptr);
  if (o.kind == Outcome::kHeld) {
    SavePendingLocked(wr);
    return;
  }
  FinishLocked(wr, o);
}

void QpCore::SavePendingLocked(const ibv_send_wr& wr) {
  Pending& p = pending_.emplace_back();
  p.wr = wr;
  p.wr.next = nullptr;
  if (wr.num_sge > 0) {
    std::memcpy(p.sge, wr.sg_list, sizeof(ibv_sge) * wr.num_sge);
  }
  p.wr.sg_list = p.sge;
  if ((wr.send_flags & IBV_SEND_INLINE) != 0) {
    // The caller may reuse inline buffers as soon as PostSend returns.
    for (int i = 0; i < wr.num_sge; ++i) {
      const char* a = reinterpret_cast<const char*>(wr.sg_list[i].addr);
      p.inline_bytes.insert(p.inline_bytes.end(), a,
                            a + wr.sg_list[i].length);
    }
  }
}

void QpCore::DrainPendingLocked() {
  while (!pending_.empty() && state() == IBV_QPS_RTS) {
    Pending& p = pending_.front();
    const bool is_inline = (p.wr.send_flags & IBV_SEND_INLINE) != 0;
    Outcome o = ExecuteLocked(p.wr, is_inline ? &p.inline_bytes : nullptr);
    if (o.kind == Outcome::kHeld) return;
    const ibv_send_wr wr = p.wr;  // its SGEs are not needed any more
    pending_.pop_front();
    FinishLocked(wr, o);
  }
}

absl::Status QpCore::PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (cfg_.srq) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: post recv on qp %u: the QP receives through an SRQ (EINVAL)",
        qp_num()));
  }
  std::lock_guard<std::mutex> lock(wire_->mu);
  if (destroyed_) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: post recv on qp %u: destroyed (EINVAL)", qp_num()));
  }
  if (state() == IBV_QPS_ERR) {
    for (; wr != nullptr; wr = wr->next) {
      ibv_wc wc{};
      wc.wr_id = wr->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = qp_num();
      cfg_.recv_cq->Push(wc);
    }
    return absl::OkStatus();
  }
  absl::Status s = rq_.Post(wr, bad, "qp", qp_num());
  // A SEND the peer was holding for want of a receive goes now.
  if (QpCore* peer = state() == IBV_QPS_RTS ? PeerLocked() : nullptr) {
    peer->DrainPendingLocked();
  }
  return s;
}

void QpCore::ReleaseHeldSends() {
  std::lock_guard<std::mutex> lock(wire_->mu);
  if (destroyed_ || state() != IBV_QPS_RTS) return;
  if (QpCore* peer = PeerLocked()) peer->DrainPendingLocked();
}

void QpCore::SetError() {
  std::lock_guard<std::mutex> lock(wire_->mu);
  if (destroyed_) return;
  EnterErrorLocked(std::nullopt, std::nullopt, "SetError");
}

void QpCore::Destroy() {
  std::lock_guard<std::mutex> lock(wire_->mu);
  if (destroyed_) return;
  // The peer loses its connection; this QP completes nothing more.
  pending_.clear();
  destroyed_ = true;
  if (state() == IBV_QPS_RTS) {
    if (QpCore* peer = PeerLocked()) {
      peer->EnterErrorLocked(std::nullopt, std::nullopt, "peer QP destroyed");
    }
  }
  state_.store(IBV_QPS_ERR, std::memory_order_release);
  if (wire_->end[side_] == this) wire_->end[side_] = nullptr;
}

void QpCore::EnterErrorLocked(std::optional<ibv_event_type> event,
                              std::optional<ibv_event_type> peer_event,
                              const std::string& why) {
  if (state() == IBV_QPS_ERR) return;
  const bool connected = state() == IBV_QPS_RTS;
  state_.store(IBV_QPS_ERR, std::memory_order_release);
  if (event) RaiseLocked(*event, why);
  FlushLocked();
  if (QpCore* peer = connected ? PeerLocked() : nullptr) {
    peer->EnterErrorLocked(peer_event, std::nullopt,
                           absl::StrFormat("peer qp %u: %s", qp_num(), why));
  }
}

void QpCore::FlushLocked() {
  while (!pending_.empty()) {
    const ibv_send_wr wr = pending_.front().wr;
    pending_.pop_front();
    CompleteSendLocked(wr, IBV_WC_WR_FLUSH_ERR, 0);
  }
  while (!rq_.empty()) {
    ibv_wc wc{};
    wc.wr_id = rq_.Front().wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp_num();
    rq_.Pop();
    cfg_.recv_cq->Push(wc);
  }
}

void QpCore::RaiseLocked(ibv_event_type type, const std::string& why) {
  if (!cfg_.async) return;
  cfg_.async->Push(AsyncEvent{
      type, qp_num(), absl::StrFormat("loop: qp %u: %s", qp_num(), why)});
}

}  // namespace coverbs::transport::loop
