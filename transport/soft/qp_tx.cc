// QpCore's requester side and transmit path (progress thread): building a
// batch of frames -- HELLO, queued responses, then requests from the send
// ring within the READ/atomic credit -- into the arena and user-buffer
// iovecs, sending it with sendmsg under a per-iteration budget, and
// completing send WRs in order (ACKs, responses, local errors, flushes all
// end in CompleteWqe).
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>

#include "absl/strings/str_format.h"
#include "transport/provider.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/qp_internal.h"

namespace coverbs::transport::soft {
namespace {

constexpr int kTxRounds = 8;  // batches per QP per iteration
// Bytes handed to sendmsg per QP per iteration: small enough that a reader
// on the same host copies them out while they are still in cache.
constexpr size_t kTxBudget = 384 * 1024;
constexpr uint32_t kMaxRdAtomic = 128;  // outstanding READ/atomics

}  // namespace

// ---------------------------------------------------------------------------
// Progress thread: requester completions

bool QpCore::IsRdAtomic(const SendWqe& w) const {
  return w.opcode == IBV_WR_RDMA_READ || IsAtomic(w.opcode);
}

uint64_t QpCore::ReadHead() {
  std::lock_guard<std::mutex> lock(mu_);
  head_cache_ = sq_head_;
  return head_cache_;
}

void QpCore::PublishTail() {
  std::lock_guard<std::mutex> lock(mu_);
  sq_tail_ = comp_ptr_;
}

void QpCore::PushSendWc(const SendWqe& w, uint8_t status) {
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = WcOpcode(static_cast<ibv_wr_opcode>(w.opcode));
  wc.byte_len = IsAtomic(w.opcode) ? 8 : static_cast<uint32_t>(w.total);
  wc.qp_num = qp_num();
  wc.src_qp = peer_qpn_;
  if (!cfg_.send_cq->Push(wc)) {
    EnterError(Cause::kFault, "send CQ overrun");
  }
}

void QpCore::CompleteWqe(uint64_t i, uint8_t status) {
  SendWqe& w = Wqe(i);
  if (IsRdAtomic(w) && i < send_ptr_ && rd_atomic_out_ > 0) --rd_atomic_out_;
  ++comp_ptr_;
  if (status != IBV_WC_SUCCESS || w.signaled) {
    // The slots are free before the poster can see the completion.
    PublishTail();
    PushSendWc(w, status);
  }
}

bool QpCore::AckBefore(uint64_t end) {
  if (end <= comp_ptr_) return true;
  if (end > send_ptr_) {
    ProtocolError(absl::StrFormat("ACK for request %u never sent", end - 1));
    return false;
  }
  while (comp_ptr_ < end) {
    if (IsRdAtomic(Wqe(comp_ptr_))) {
      ProtocolError("ACK passes an unanswered READ or atomic");
      return false;
    }
    CompleteWqe(comp_ptr_, IBV_WC_SUCCESS);
  }
  PublishTail();
  Activate();
  return true;
}

// ---------------------------------------------------------------------------
// Progress thread: transmit

void QpCore::ResetTx() {
  for (size_t i = 0; i < nsegs_; ++i) segs_[i].mr.reset();
  nsegs_ = seg_idx_ = seg_off_ = 0;
  arena_used_ = 0;
}

void QpCore::AppendHeader(const wire::Header& h, const char* extra,
                          size_t n) {
  char* p = arena_.get() + arena_used_;
  wire::Encode(h, p);
  if (n > 0) std::memcpy(p + wire::kHeaderSize, extra, n);
  size_t len = wire::kHeaderSize + n;
  arena_used_ += len;
  if (nsegs_ > 0) {
    Seg& last = segs_[nsegs_ - 1];
    if (!last.mr && last.p + last.len == p) {
      last.len += len;
      return;
    }
  }
  Seg& s = segs_[nsegs_++];
  s.p = p;
  s.len = len;
  s.mr.reset();
  s.slot = -1;
}

void QpCore::AppendUser(const char* p, size_t n,
                        const std::shared_ptr<MrEntry>& mr, int64_t slot) {
  Seg& s = segs_[nsegs_++];
  s.p = p;
  s.len = n;
  s.mr = mr;
  s.slot = slot;
}

bool QpCore::Build() {
  ResetTx();
  // Whatever ACK a batch held back goes out now.
  if (ack_held_.load(std::memory_order_relaxed)) {
    ack_held_.store(false, std::memory_order_relaxed);
  }
  constexpr size_t kFrameRoom = wire::kHeaderSize + 256 + 16;
  auto room = [&](size_t segs) {
    return arena_used_ + kFrameRoom <= kArenaSize &&
           nsegs_ + segs + 1 <= kMaxSegs;
  };
  if (!hello_sent_) {
    wire::Header h;
    h.opcode = wire::kHello;
    h.addr = wire::kHelloMagic;
    h.dma_len = wire::kVersion;
    h.qpn = qp_num();
    AppendHeader(h, nullptr, 0);
    hello_sent_ = true;
  }
  bool fault = false;
  while (!ctrl_.empty() && room(1)) {
    Ctrl& c = ctrl_.front();
    if (inline_ && c.op == wire::kReadResp && c.len > 0 && !c.mr->Usable()) {
      need_engine_ = true;  // the fault is the progress thread's to handle
      return nsegs_ > 0;
    }
    wire::Header h;
    h.opcode = c.op;
    h.seq = c.seq;
    h.syndrome = c.syndrome;
    if (c.op == wire::kReadResp) {
      if (c.len > 0 && !c.mr->Usable()) {
        h.opcode = wire::kNak;
        h.syndrome = IBV_WC_REM_ACCESS_ERR;
        AppendHeader(h, nullptr, 0);
        fault = true;
      } else {
        h.payload_len = c.len;
        AppendHeader(h, nullptr, 0);
        if (c.len > 0) {
          AppendUser(reinterpret_cast<const char*>(c.addr), c.len, c.mr, -1);
        }
      }
    } else if (c.op == wire::kAtomicResp) {
      char v[8];
      wire::PutLe64(c.value, v);
      h.payload_len = 8;
      AppendHeader(h, v, 8);
    } else {
      AppendHeader(h, nullptr, 0);
    }
    ctrl_.pop_front();
    if (fault) break;
  }
  if (fault) {
    // Refused with REM_ACCESS_ERR, as at the READ's arrival: an access
    // violation on this (the responder's) QP.
    EnterError(Cause::kFault, "source of an RDMA READ response deregistered",
               IBV_EVENT_QP_ACCESS_ERR);
  }
  if (err_ || rnr_wait_ || fd_ < 0) return nsegs_ > 0;

  uint64_t head = ReadHead();
  while (send_ptr_ < head && room(max_send_sge_)) {
    uint64_t seq = send_ptr_;
    SendWqe& w = Wqe(seq);
    if (IsRdAtomic(w) && rd_atomic_out_ >= kMaxRdAtomic) break;
    size_t base = (seq % sq_cap_) * max_send_sge_;
    if (w.status == IBV_WC_SUCCESS && !w.inlined) {
      for (uint32_t k = 0; k < w.num_sge; ++k) {
        if (sq_mr_[base + k] && !sq_mr_[base + k]->Usable()) {
          w.status = IBV_WC_LOC_PROT_ERR;
        }
      }
    }
    if (w.status != IBV_WC_SUCCESS) {
      if (inline_) {
        need_engine_ = true;  // completing it and the error state: engine
        break;
      }
      // Completed in order: only once every earlier WR has completed.
      if (seq == comp_ptr_) {
        uint8_t st = w.status;
        CompleteWqe(seq, st);  // never sent: no READ/atomic credit to return
        ++send_ptr_;
        EnterError(Cause::kFault,
                   absl::StrFormat("work request %u failed locally: %s", seq,
                                   WcStatusName(st)));
      }
      break;
    }
    wire::Header h;
    h.seq = seq;
    h.flags = w.solicited ? wire::kFlagSolicited : 0;
    const char* extra = nullptr;
    size_t extra_len = 0;
    char atomic_args[wire::kAtomicReqSize];
    switch (w.opcode) {
      case IBV_WR_SEND:
        h.opcode = wire::kSend;
        break;
      case IBV_WR_SEND_WITH_IMM:
        h.opcode = wire::kSendImm;
        h.imm = w.imm;
        break;
      case IBV_WR_SEND_WITH_INV:
        h.opcode = wire::kSend;
        h.flags |= wire::kFlagInvalidate;  // h.rkey: the window to end
        break;
      case IBV_WR_BIND_MW:
      case IBV_WR_LOCAL_INV:
        // Done at post (qp_post.cc); an empty WRITE keeps the sequence.
        h.opcode = wire::kWrite;
        break;
      case IBV_WR_RDMA_WRITE:
        h.opcode = wire::kWrite;
        break;
      case IBV_WR_RDMA_WRITE_WITH_IMM:
        h.opcode = wire::kWriteImm;
        h.imm = w.imm;
        break;
      case IBV_WR_RDMA_READ:
        h.opcode = wire::kReadReq;
        h.dma_len = static_cast<uint32_t>(w.total);
        break;
      case IBV_WR_ATOMIC_CMP_AND_SWP:
      case IBV_WR_ATOMIC_FETCH_AND_ADD:
        h.opcode = w.opcode == IBV_WR_ATOMIC_CMP_AND_SWP ? wire::kCmpSwap
                                                          : wire::kFetchAdd;
        wire::PutLe64(w.compare_add, atomic_args);
        wire::PutLe64(w.swap, atomic_args + 8);
        extra = atomic_args;
        extra_len = sizeof(atomic_args);
        h.payload_len = wire::kAtomicReqSize;
        break;
    }
    if (w.opcode != IBV_WR_SEND && w.opcode != IBV_WR_SEND_WITH_IMM) {
      h.addr = w.remote_addr;
      h.rkey = w.rkey;
    }
    bool carries_data = h.opcode == wire::kSend || h.opcode == wire::kSendImm ||
                        h.opcode == wire::kWrite || h.opcode == wire::kWriteImm;
    if (carries_data) {
      h.payload_len = static_cast<uint32_t>(w.total);
      if (w.inlined) {
        extra = sq_inline_.data() + (seq % sq_cap_) * max_inline_;
        extra_len = w.total;
      }
    }
    AppendHeader(h, extra, extra_len);
    if (carries_data && !w.inlined) {
      for (uint32_t k = 0; k < w.num_sge; ++k) {
        const ibv_sge& sge = sq_sge_[base + k];
        if (sge.length == 0) continue;
        AppendUser(reinterpret_cast<const char*>(sge.addr), sge.length,
                   sq_mr_[base + k], static_cast<int64_t>(seq));
      }
    }
    if (IsRdAtomic(w)) ++rd_atomic_out_;
    // The first outstanding request starts the transport timer.
    if (comp_ptr_ == send_ptr_) progress_at_ = std::chrono::steady_clock::now();
    ++send_ptr_;
    ArmAckTimer();
  }
  return nsegs_ > 0;
}

bool QpCore::SendPending(size_t* budget) {
  iovec iov[kMaxSegs];
  int n = 0;
  size_t want = 0;
  for (size_t i = seg_idx_; i < nsegs_ && want < *budget; ++i) {
    const Seg& s = segs_[i];
    if (s.mr && !s.mr->Usable()) {
      if (inline_) {
        need_engine_ = true;
        return false;
      }
      // A source region vanished mid-frame: the stream cannot be completed.
      int64_t slot = s.slot;
      ResetTx();
      if (slot >= 0 && static_cast<uint64_t>(slot) >= comp_ptr_) {
        while (comp_ptr_ < static_cast<uint64_t>(slot)) {
          CompleteWqe(comp_ptr_, IBV_WC_WR_FLUSH_ERR);
        }
        CompleteWqe(comp_ptr_, IBV_WC_LOC_PROT_ERR);
        PublishTail();
      }
      if (!err_) {
        EnterError(Cause::kFault,
                   "a registered source buffer was deregistered while being "
                   "sent");
      }
      CloseNow();
      return false;
    }
    size_t off = i == seg_idx_ ? seg_off_ : 0;
    iov[n].iov_base = const_cast<char*>(s.p + off);
    iov[n].iov_len = std::min(s.len - off, *budget - want);
    want += iov[n].iov_len;
    ++n;
  }
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  ssize_t sent = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (sent < 0 && inline_) {
    // EAGAIN, EINTR or an error: the progress thread sends the batch (again)
    // and sees the same condition (POLLOUT, the error state).
    need_engine_ = true;
    return false;
  }
  if (sent < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      tx_blocked_ = true;
      engine_->WatchOut(this);
      return false;
    }
    if (errno == EINTR) {
      engine_->Activate(this);
      return false;
    }
    if (err_) {
      ResetTx();
      CloseNow();
    } else {
      ConnectionLost(absl::StrFormat("send failed: %s", strerror(errno)));
    }
    return false;
  }
  size_t left = static_cast<size_t>(sent);
  if (left > 0) NoteProgress();
  *budget -= left;
  while (left > 0 && seg_idx_ < nsegs_) {
    size_t in_seg = segs_[seg_idx_].len - seg_off_;
    if (left >= in_seg) {
      left -= in_seg;
      segs_[seg_idx_].mr.reset();
      ++seg_idx_;
      seg_off_ = 0;
    } else {
      seg_off_ += left;
      left = 0;
    }
  }
  if (seg_idx_ == nsegs_) {
    ResetTx();
    return true;
  }
  if (inline_) {
    // Budget spent or the socket full: the rest is the progress thread's
    // backlog (it arms POLLOUT if the socket is still full).
    need_engine_ = true;
    return false;
  }
  if (static_cast<size_t>(sent) == want) {
    // This turn's budget is spent, the socket is not full: let the rest of
    // the loop (the peer's receive, on loopback) run first.
    engine_->Activate(this);
    return false;
  }
  tx_blocked_ = true;
  engine_->WatchOut(this);
  return false;
}

QpCore::InlineTx QpCore::TxInline(bool may_hold) {
  std::unique_lock<std::mutex> lock(progress_mu_, std::try_to_lock);
  // Busy (the progress thread is serving this QP and will see the new WRs
  // through the kick) or anything but the plain idle state: kick.
  if (!lock.owns_lock() || removed_ || fd_ < 0 || closed_ || err_ ||
      !hello_sent_ || tx_blocked_ || rnr_wait_ || seg_idx_ != nsegs_ ||
      error_requested_.load()) {
    return InlineTx::kKick;
  }
  if (may_hold && reactor_rx_ && ctrl_.size() == 1 &&
      ctrl_.front().op == wire::kAck && send_ptr_ == ReadHead()) {
    // Only the ACK of what this reactor just received: its response,
    // usually posted in the next iteration, will carry it in one write.
    hold_gen_.fetch_add(1, std::memory_order_relaxed);
    ack_held_.store(true, std::memory_order_relaxed);
    return InlineTx::kHeld;
  }
  // Build and SendPending check each source region's valid flag before the
  // sendmsg reads it; the shared window makes deregistration wait for us.
  AccessEpoch::EnterShared();
  inline_ = true;
  need_engine_ = false;
  size_t budget = kTxBudget;
  if (Build()) SendPending(&budget);
  inline_ = false;
  AccessEpoch::ExitShared();
  // Left behind (no room in one batch, READ/atomic credit): the progress
  // thread goes on from there.
  if (seg_idx_ != nsegs_ || send_ptr_ < head_cache_ || !ctrl_.empty()) {
    need_engine_ = true;
  }
  return need_engine_ ? InlineTx::kKick : InlineTx::kDone;
}

void QpCore::DoTx() {
  if (fd_ < 0 || closed_) {
    if (err_) FlushSq();
    return;
  }
  if (tx_blocked_) return;
  size_t budget = kTxBudget;
  for (int round = 0; round < kTxRounds && budget > 0; ++round) {
    if (seg_idx_ < nsegs_ && !SendPending(&budget)) return;
    if (err_) {
      // Nothing of ours is on the way any more: flush the send queue.
      FlushSq();
      if (ctrl_.empty()) {
        if (!fin_sent_ && fd_ >= 0) {
          shutdown(fd_, SHUT_WR);
          fin_sent_ = true;
        }
        return;
      }
    }
    if (fd_ < 0 || !Build()) return;
  }
  engine_->Activate(this);
}

}  // namespace coverbs::transport::soft
