// Receiving: completions of receives (header validation, credits and acks,
// dispatch by message type) and delivery in arrival order.
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "cm/context_shared.h"
#include "transport/errors.h"

namespace coverbs::cm::internal {

void ConnectionImpl::Protocol(absl::string_view what) {
  Fail(absl::DataLossError(
      absl::StrCat("protocol violation by the peer: ", what)));
}

void ConnectionImpl::OnRecv(RecvSlot* slot, const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (status_.ok()) {
      if (peer_closed_ || closing_) {
        Fail(absl::UnavailableError(peer_closed_ ? "closed by the peer"
                                                 : "closed locally"));
      } else {
        Fail(absl::UnavailableError(
            absl::StrCat("connection lost: receive completed with ",
                         transport::WcStatusName(wc.status))));
      }
    }
    return;
  }
  if (!status_.ok()) return;
  if (!may_send_.is_set()) may_send_.Set();
  // WRITE_WITH_IMM: the end of a rendezvous; no header travelled.
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    uint32_t cookie = ntohl(wc.imm_data);
    bool found = false;
    for (Incoming& in : incoming_) {
      if (!in.ready && in.large != nullptr && in.cookie == cookie) {
        if (wc.byte_len != in.large->size) {
          Protocol(absl::StrFormat("rendezvous %d wrote %d bytes, announced %d",
                                   cookie, wc.byte_len, in.large->size));
          return;
        }
        in.ready = true;
        found = true;
        break;
      }
    }
    if (!found) {
      Protocol(
          absl::StrFormat("WRITE_WITH_IMM for unknown rendezvous %d", cookie));
      return;
    }
    // In place of a DONE: spends a credit (no header, so no low flag).
    if (!Spent(false)) return;
    // Nothing to keep: repost now.
    if (!qp_->in_error() && Repost(slot)) Replenish();
    Pump();
    MaybeSendCredits();
    return;
  }
  if (wc.byte_len < kHeaderSize) {
    Protocol(absl::StrFormat("%d-byte message is shorter than the header",
                             wc.byte_len));
    return;
  }
  WireHeader h;
  std::memcpy(&h, slot->data, kHeaderSize);
  absl::Status v = ValidateHeader(h, wc.byte_len, slot_size_);
  if (!v.ok()) {
    Protocol(v.message());
    return;
  }
  // Credits and credit-message acks piggyback on every header.
  if (h.credit_acks - credit_msgs_acked_ <=
      credit_msgs_sent_ - credit_msgs_acked_) {
    credit_msgs_acked_ = h.credit_acks;
  } else {
    Protocol("acknowledged credit messages never sent");
    return;
  }
  if (h.credits > 0) {
    if (credits_.available() + h.credits > peer_.handshake.max_credits) {
      Protocol(absl::StrFormat("returned %d credits beyond the %d announced",
                               h.credits, peer_.handshake.max_credits));
      return;
    }
    credits_.Release(h.credits);
  }
  if (h.type != kCredit && h.type != kCts &&
      !Spent((h.flags & kFlagCreditLow) != 0)) {
    return;
  }
  auto consume = [&] {
    // Internal messages give their slot back at once.
    if (Repost(slot)) Replenish();
  };
  switch (h.type) {
    case kData: {
      ++stats_.messages_received;
      Incoming in;
      in.ready = true;
      in.msg.data_ = slot->data + kHeaderSize;
      in.msg.size_ = h.length;
      in.msg.owner_ = slot;
      if (pool_ != nullptr) {
        slot->held = true;
        slot->conn_id = id_;
        ++pool_->held;
        ++held_;
      } else {
        ++ring_->held;
      }
      incoming_.push_back(std::move(in));
      Pump();
      break;
    }
    case kCredit: {
      // Not a credit-bearing receive: repost without counting it.
      ++credit_msgs_seen_;
      Repost(slot);
      break;
    }
    case kHello:
      consume();
      break;
    case kGoodbye:
      consume();
      peer_closed_ = true;
      Pump();
      break;
    case kRts: {
      consume();
      if (h.length > options_.max_message_size) {
        Protocol(
            absl::StrFormat("rendezvous of %d bytes exceeds our maximum %d",
                            h.length, options_.max_message_size));
        return;
      }
      ++stats_.rendezvous_received;
      auto* lb = new LargeBuffer();
      lb->size = h.length;
      lb->cache = ctx_.shared().large_memory;
      LargeMemoryCache::Block block = lb->cache->Get(h.length);
      lb->mem = block.mem;
      lb->capacity = block.capacity;
      std::vector<std::byte> cts(kCtsSize);
      uint16_t flags = 0;
      absl::Status reg;
      if (lb->mem == nullptr) {
        reg = absl::ResourceExhaustedError("out of memory");
      } else {
        auto mr = ctx_.pd().Register(
            lb->mem, h.length,
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        if (mr.ok()) {
          lb->mr = std::move(*mr);
        } else {
          reg = mr.status();
        }
      }
      if (!reg.ok()) {
        delete lb;
        flags = kFlagRefused;
      } else {
        CtsPayload p{reinterpret_cast<uint64_t>(lb->mem), lb->mr.rkey(), 0};
        std::memcpy(cts.data(), &p, kCtsSize);
        Incoming in;
        in.cookie = h.cookie;
        in.large = lb;
        incoming_.push_back(std::move(in));
      }
      SpawnInternal(SendCts(h.cookie, flags, std::move(cts)));
      break;
    }
    case kCts: {
      CtsPayload p;
      std::memcpy(&p, slot->data + kHeaderSize, kCtsSize);
      // One of our kCtsReserve receives: repost it (after reading it) without
      // returning a credit, and let the next rendezvous ask.
      Repost(slot);
      rts_window_.Release(1);
      if (!pending_rts_.empty() && pending_rts_.front()->cookie == h.cookie) {
        PendingRts* pr = pending_rts_.front();
        pending_rts_.pop_front();
        pr->granted = !(h.flags & kFlagRefused);
        pr->refused = (h.flags & kFlagRefused) != 0;
        pr->addr = p.addr;
        pr->rkey = p.rkey;
        pr->cts.Set();
        break;
      }
      auto it = std::find(abandoned_.begin(), abandoned_.end(), h.cookie);
      if (it == abandoned_.end()) {
        Protocol(absl::StrFormat("CTS for unknown rendezvous %d", h.cookie));
        return;
      }
      abandoned_.erase(it);
      if (!(h.flags & kFlagRefused)) {
        // The Send gave up: release the receiver's buffer.
        SpawnInternal(SendControl(kDone, h.cookie, kFlagAborted, {}));
      }
      break;
    }
    case kDone: {
      consume();
      bool found = false;
      for (auto it = incoming_.begin(); it != incoming_.end(); ++it) {
        if (!it->ready && it->large != nullptr && it->cookie == h.cookie) {
          found = true;
          if (h.flags & kFlagAborted) {
            delete it->large;
            incoming_.erase(it);
          } else {
            it->ready = true;
          }
          break;
        }
      }
      if (!found) {
        Protocol(absl::StrFormat("DONE for unknown rendezvous %d", h.cookie));
        return;
      }
      Pump();
      break;
    }
    default:
      Protocol(absl::StrFormat("unknown message type %d", h.type));
      return;
  }
  MaybeSendCredits();
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
    }
    ready_.push_back(std::move(in.msg));
    ready_count_.Release(1);
  }
  if (peer_closed_ && incoming_.empty()) {
    ready_count_.Release(1);  // wakes a Recv to report the close
  }
}

Task<absl::StatusOr<Message>> ConnectionImpl::Recv() {
  for (;;) {
    if (!ready_.empty() && ready_count_.TryAcquire(1)) {
      Message m = std::move(ready_.front());
      ready_.pop_front();
      co_return m;
    }
    if (!status_.ok()) co_return CheckUp("recv");
    if (peer_closed_ && incoming_.empty() && ready_.empty()) {
      co_return absl::UnavailableError(
          absl::StrCat("recv on ", name_, ": closed by the peer"));
    }
    if (!started_) co_return CheckUp("recv");
    absl::Status s = co_await ready_count_.Acquire(1);
    if (!s.ok()) co_return s;
    if (!ready_.empty()) {
      Message m = std::move(ready_.front());
      ready_.pop_front();
      co_return m;
    }
    // A wake-up for a close or failure: loop to report it.
    if (status_.ok() && !peer_closed_) continue;
    if (!status_.ok()) co_return CheckUp("recv");
  }
}

}  // namespace coverbs::cm::internal
