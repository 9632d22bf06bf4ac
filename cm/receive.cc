// Receiving: completions of receives (header validation, credits and acks,
// dispatch by message type) and delivery in arrival order.

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "cm/recv_buffers.h"
#include "cm/srq_pool.h"
#include "cm/worker_shared.h"
#include "transport/errors.h"

namespace coverbs::cm::internal {

void ConnectionImpl::Protocol(absl::string_view what) {
  Fail(CloseCause::kProtocolViolation, absl::DataLossError(what));
}

void ConnectionImpl::OnRecv(RecvSlot* slot, const ibv_wc& wc) {
  OnRecvBody(slot, wc);
}

// Here, with OnRecv's body inlined (once per message received).
void RecvSlot::OnRecv(const ibv_wc& wc) {
  if (pool != nullptr) {
    pool->OnRecv(this, wc);
  } else if (ring->conn != nullptr) {
    ring->conn->OnRecvBody(this, wc);
  }
}

[[gnu::always_inline]] inline void ConnectionImpl::OnRecvBody(
    RecvSlot* slot, const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    OnRecvFailed(wc);
    return;
  }
  if (!status_.ok()) return;
  if (!may_send_.is_set()) may_send_.Set();
  if (!peer_spoke_.is_set()) peer_spoke_.Set();
  ++rx_count_;
  // WRITE_WITH_IMM: the end of a rendezvous; no header travelled.
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    if (peer_closed_) {
      Protocol(
          "a rendezvous finished (WRITE_WITH_IMM) after the peer's "
          "GOODBYE: nothing may follow it");
      return;
    }
    OnRendezvousImm(slot, wc);
    return;
  }
  WireHeader h;
  if (!TakeHeader(slot, wc, h)) return;
  // Nothing follows a GOODBYE (PROTOCOL.md 3.7): a message that spends a
  // credit after it -- data, above all, which would be handed out as if
  // sent before the close -- ends the connection. CREDIT and CTS messages
  // use the reserve receives and may still be on their way.
  if (peer_closed_ && h.type != kCredit && h.type != kCts) {
    static constexpr const char* kNames[] = {"?",     "DATA",    "CREDIT",
                                             "RTS",   "CTS",     "DONE",
                                             "HELLO", "GOODBYE", "LANDED"};
    Protocol(absl::StrFormat(
        "a %s message after the peer's GOODBYE: nothing may follow it",
        h.type < std::size(kNames) ? kNames[h.type] : "?"));
    return;
  }
  bool ok = true;
  switch (h.type) {
    case kData:
      OnData(slot, h);
      break;
    case kCredit:
      // Not a credit-bearing receive: repost without counting it (after
      // reading the grants it carries).
      ++credit_msgs_seen_;
      ok = TakeGrants(slot, h);
      if (!ok) break;
      Repost(slot);
      if (h.flags & kFlagPing) SpawnInternal(SendKeepalive(0));
      break;
    case kHello:
      Consume(slot);
      break;
    case kGoodbye:
      Consume(slot);
      peer_closed_ = true;
      // Decided now, not when the teardown's flush arrives: a Recv that
      // reports the close may run first, and must name the same cause.
      if (cause_ == CloseCause::kNone) cause_ = CloseCause::kPeerClosed;
      Pump();
      break;
    case kRts:
      Consume(slot);
      ok = OnRts(h);
      break;
    case kCts:
      ok = OnCts(slot, h);
      break;
    case kDone:
      Consume(slot);
      ok = OnDone(h);
      break;
    case kLanded:
      ok = OnLanded(slot, h, wc);
      break;
    default:
      Protocol(absl::StrFormat("unknown message type %d", h.type));
      ok = false;
  }
  if (ok) MaybeSendCreditsBody();
}

void ConnectionImpl::OnRecvFailed(const ibv_wc& wc) {
  if (!status_.ok()) return;
  if (peer_closed_) {
    Fail(CloseCause::kPeerClosed, absl::UnavailableError("closed by the peer"));
    return;
  }
  if (closing_) {
    Fail(CloseCause::kLocalClose, absl::UnavailableError("closed locally"));
    return;
  }
  // A message sent inline that failed (its completion goes to the QP, and
  // comes before the flushes it causes) is the reason, not the flush.
  if (const absl::Status& sent = qp_->inline_send_error(); !sent.ok()) {
    Fail(CauseOfWc(sent),
         absl::Status(sent.code(),
                      absl::StrCat("send failed: ", sent.message())));
    return;
  }
  if (wc.status == IBV_WC_WR_FLUSH_ERR) {
    // The QP went to error under us with no goodbye from the peer and no
    // failed operation of ours in front: the link ended (the peer's
    // process died, or its host). A failed operation completing later
    // replaces this (OpError).
    Fail(CloseCause::kPeerGone,
         absl::UnavailableError(absl::StrCat(
             "the link ended without the peer closing the connection "
             "(receive completed with ",
             transport::WcStatusName(wc.status), ")")));
    status_is_flush_ = true;
    return;
  }
  Fail(CauseOfWcStatus(wc.status),
       absl::UnavailableError(absl::StrCat(
           "receive completed with ", transport::WcStatusName(wc.status))));
}

// TakeHeader and OnData always inline (only OnRecv calls them, once per
// received message; each call and its prologue were ~15 instructions).
[[gnu::always_inline]] inline bool ConnectionImpl::TakeHeader(RecvSlot* slot,
                                                              const ibv_wc& wc,
                                                              WireHeader& h) {
  if (wc.byte_len < kHeaderSize) {
    Protocol(absl::StrFormat("%d-byte message is shorter than the header",
                             wc.byte_len));
    return false;
  }
  std::memcpy(&h, slot->data, kHeaderSize);
  // A data message's checks as a bool first (wire.h); anything else, and
  // what is wrong, ValidateHeader says.
  if (!IsValidDataHeader(h, wc.byte_len, slot_size_)) {
    absl::Status v = ValidateHeader(h, wc.byte_len, slot_size_);
    if (!v.ok()) {
      Protocol(v.message());
      return false;
    }
  }
  // Credits and credit-message acks piggyback on every header.
  if (h.credit_acks - credit_msgs_acked_ >
      credit_msgs_sent_ - credit_msgs_acked_) {
    Protocol("acknowledged credit messages never sent");
    return false;
  }
  credit_msgs_acked_ = h.credit_acks;
  if (h.credits > 0) {
    if (credits_.available() + h.credits > peer_.handshake.max_credits) {
      Protocol(absl::StrFormat("returned %d credits beyond the %d announced",
                               h.credits, peer_.handshake.max_credits));
      return false;
    }
    credits_.Release(h.credits);
  }
  if (h.type == kCredit || h.type == kCts) return true;
  return SpentBody((h.flags & kFlagCreditLow) != 0);
}

void ConnectionImpl::Consume(RecvSlot* slot) {
  // Internal messages give their slot back at once.
  if (Repost(slot)) Replenish();
}

[[gnu::always_inline]] inline void ConnectionImpl::OnData(RecvSlot* slot,
                                                          const WireHeader& h) {
  ++stats_.messages_received;
  stats_.bytes_received += h.length;
  Message msg;
  msg.data_ = slot->data + kHeaderSize;
  msg.size_ = h.length;
  msg.owner_ = slot;
  if (pool_ != nullptr) {
    slot->held = true;
    slot->conn_id = id_;
    ++pool_->held;
    ++held_;
  } else {
    ++ring_->held;
  }
  if (incoming_.empty() && !peer_closed_) {
    // Nothing ahead of it in arrival order (no rendezvous under way): it
    // is deliverable now, without a stop in incoming_ and a Pump.
    ready_.push_back(std::move(msg));
    ready_count_.Release(1);
    return;
  }
  Incoming in;
  in.ready = true;
  in.msg = std::move(msg);
  incoming_.push_back(std::move(in));
  Pump();
}

void ConnectionImpl::Pump() {
  while (!incoming_.empty() && incoming_.front().ready) {
    Incoming in = std::move(incoming_.front());
    incoming_.pop_front();
    if (in.large != nullptr) {
      // The transfer is over: the rkey dies now, the memory stays.
      in.large->mr.Deregister();
      in.msg.data_ = in.large->mem;
      in.msg.size_ = in.large->size;
      in.msg.owner_ = in.large;
      // Held against the budget until Recv takes it (SettleReady).
      rdv_ready_.push_back({ready_.pushed(), Pinned(in.size)});
      if (rdv_deferred_ > 0) WatchRendezvous();
    } else if (in.landed_bytes > 0) {
      rdv_ready_.push_back({ready_.pushed(), in.landed_bytes});
    }
    ready_.push_back(std::move(in.msg));
    ready_count_.Release(1);
  }
  if (peer_closed_ && incoming_.empty()) {
    ready_count_.Release(1);  // wakes a Recv to report the close
  }
}

absl::Status ConnectionImpl::RecvError() const {
  if (!status_.ok() || !peer_closed_) {
    absl::Status s = CheckUp("recv");
    if (!s.ok()) return s;
  }
  // As DownError words it once the connection is down: the cause first.
  return absl::UnavailableError(
      absl::StrCat("closed by the peer (recv on ", name_, ")"));
}

}  // namespace coverbs::cm::internal

namespace coverbs::cm {

bool Connection::RecvAwaiter::TakeNow() {
  internal::ConnectionImpl& c = *impl_;
  if (!c.ready_.empty() && c.ready_count_.TryAcquire(1)) {
    msg_ = c.ready_.pop_front();
    got_ = true;
    return true;
  }
  // Nothing to wait for: down, not started, or closed by the peer with
  // nothing left (Finish says which).
  return !c.status_.ok() || !c.started_ ||
         (c.peer_closed_ && c.incoming_.empty() && c.ready_.empty());
}

Semaphore* Connection::RecvAwaiter::ReadyCount() const {
  return &impl_->ready_count_;
}

absl::StatusOr<Message> Connection::RecvAwaiter::Finish() {
  internal::ConnectionImpl& c = *impl_;
  if (wait_.has_value()) {
    absl::Status s = wait_->await_resume();
    if (!s.ok()) return s;  // cancelled, nothing taken
    if (!c.ready_.empty()) {
      return c.ready_.pop_front();
    }
    // A permit without a message: Fail released every receiver, or the
    // peer closed (Pump releases one). Pass the close on, so that a Recv
    // parked behind this one wakes to report it too.
    if (c.status_.ok() && c.peer_closed_) c.ready_count_.Release(1);
  }
  return c.RecvError();
}

}  // namespace coverbs::cm
