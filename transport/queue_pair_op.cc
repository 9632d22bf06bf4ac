// internal_qp::OpBase: one operation as an awaitable in the coroutine
// frame. The work request built from its OpSpec, cancellation by stop
// token, the awaited StatusOr<WorkCompletion>, and a destructor that never
// lets the NIC complete into a destroyed frame. Posting when the coroutine
// suspends (Suspend) and the completion that resumes it (OnCompletion) are
// in queue_pair.cc, beside the QueuePair steps they inline.
#include <arpa/inet.h>

#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/log.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {
namespace internal_qp {

OpBase::OpBase(QueuePair* qp, const OpSpec& spec)
    : qp_(qp),
      is_recv_(spec.recv),
      cancellable_(spec.cancellable),
      name_(spec.name),
      qp_num_(qp->qp_num()) {
  early_ = spec.error;
  const size_t num_sges = spec.bufs.size();
  ibv_sge* sg = sge_inline_;
  if (num_sges > kInlineSges) {
    sge_heap_ = std::make_unique<ibv_sge[]>(num_sges);
    sg = sge_heap_.get();
  }
  for (size_t i = 0; i < num_sges; ++i) sg[i] = spec.bufs[i].sge();
  if (spec.batch != nullptr) {
    batch_ = spec.batch;
    slots_ = static_cast<uint32_t>(spec.batch->size());
    return;
  }
  const uint64_t wr_id =
      reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(this)) | 1;
  if (is_recv_) {
    rwr_.wr_id = wr_id;
    rwr_.next = nullptr;
    rwr_.sg_list = sg;
    rwr_.num_sge = static_cast<int>(num_sges);
    return;
  }
  swr_ = ibv_send_wr{};
  swr_.wr_id = wr_id;
  swr_.sg_list = sg;
  swr_.num_sge = static_cast<int>(num_sges);
  swr_.opcode = spec.opcode;
  swr_.send_flags = spec.send_flags | IBV_SEND_SIGNALED;
  if (spec.imm) swr_.imm_data = htonl(*spec.imm);
  switch (spec.opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_RDMA_READ:
      swr_.wr.rdma.remote_addr = spec.remote.addr;
      swr_.wr.rdma.rkey = spec.remote.rkey;
      break;
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      swr_.wr.atomic.remote_addr = spec.remote.addr;
      swr_.wr.atomic.rkey = spec.remote.rkey;
      swr_.wr.atomic.compare_add = spec.compare_add;
      swr_.wr.atomic.swap = spec.swap;
      break;
    default:
      break;
  }
}

OpBase::~OpBase() {
  cb_.reset();
  if (completed_) return;
  // The frame is being destroyed while the operation is pending (reactor
  // shutdown). Never let the NIC complete into freed memory: withdraw it if
  // it was not posted, else flush the QP and wait for this completion.
  destroying_ = true;
  if (!posted_) {
    if (linked()) {
      (is_recv_ ? qp_->recv_waiters_ : qp_->send_waiters_).erase(this);
    }
    return;
  }
  qp_->DrainSync([this] { return completed_; });
  // Still no completion (a device that lost the WR): destroying the QP is
  // the only way to be sure the NIC no longer touches this frame's buffers.
  if (!completed_) qp_->Abandon("an operation's frame was destroyed");
}

void OpBase::Canceller::operator()() const noexcept {
  op->cancelled_.store(true, std::memory_order_release);
  Reactor* r = op->reactor_;
  if (r->InLoopThread()) {
    op->qp_->CancelOp(op);
    return;
  }
  // Another thread: the op may complete meanwhile, so the posted request
  // must not touch it; flushing the QP is what cancellation means anyway.
  std::weak_ptr<QueuePair*> alive = op->qp_->alive_;
  r->Post([alive] {
    if (std::shared_ptr<QueuePair*> qp = alive.lock(); qp && *qp) {
      (*qp)->SetError("an operation was cancelled from another thread")
          .IgnoreError();
    }
  });
}

void OpBase::Fail(absl::Status s) {
  early_ = std::move(s);
  completed_ = true;
  Resume();
}

void OpBase::Resume() {
  // No waiter: posted with Post() and not waited for yet (Wait).
  if (!destroying_ && waiter_) reactor_->Schedule(waiter_);
}

absl::StatusOr<WorkCompletion> OpBase::await_resume() {
  cb_.reset();
  if (!early_.ok()) return early_;
  WorkCompletion out;
  out.opcode = wc_.opcode;
  out.byte_len = wc_.byte_len;
  if (wc_.wc_flags & IBV_WC_WITH_IMM) out.imm = ntohl(wc_.imm_data);
  if (wc_.wc_flags & IBV_WC_WITH_INV) out.invalidated_rkey = wc_.invalidated_rkey;
  out.qp_num = wc_.qp_num;
  return out;
}

}  // namespace internal_qp

}  // namespace coverbs::transport
