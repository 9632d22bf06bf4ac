// Large messages (rendezvous): the sender's RTS, the receiver's CTS with
// (addr, rkey) for a buffer registered for this transfer only, the sender's
// RDMA WRITE(s) and DONE (or WRITE_WITH_IMM) in one post. Medium messages
// take this path only until landing buffers are granted (landing.cc).
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"

namespace coverbs::cm::internal {

// --- Sender.

Task<absl::Status> ConnectionImpl::SendLarge(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, transport::BufferPool::Buffer& buf) {
  std::vector<MemoryRegion> regs;  // until the WRITEs completed
  std::vector<LocalBuffer> sges;
  uint64_t total = 0;
  absl::Status s = PayloadSges(parts, registered, regs, sges, total);
  if (!s.ok()) {
    AbandonTurn();
    co_return s;
  }
  PendingRts pr;
  pr.cookie = next_cookie_++;
  s = co_await PostRts(pr, total, buf);
  if (!s.ok()) co_return s;
  // Until the CTS came, a cancelled Send abandons the rendezvous (AwaitCts
  // tells the receiver). From then on the receiver holds a buffer and
  // delivers nothing after this message until its DONE: the rest runs to
  // its end whatever the caller's stop token says (bounded by the
  // transport, like any posted send).
  s = co_await AwaitCts(pr, total);
  if (!s.ok()) co_return s;
  co_return co_await coverbs::internal::Unstoppable(
      WriteRendezvous(pr, sges, total));
}

absl::Status ConnectionImpl::PayloadSges(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, std::vector<MemoryRegion>& regs,
    std::vector<LocalBuffer>& sges, uint64_t& total) {
  if (registered != nullptr) {
    sges.push_back(*registered);
    total = registered->length;
    return absl::OkStatus();
  }
  // The payload goes straight from the caller's memory: registered for this
  // Send only (a cache keyed by address could outlive a free/reuse of the
  // memory and send stale pages).
  for (auto p : parts) {
    if (p.empty()) continue;
    auto mr = ctx_.pd().Register(const_cast<std::byte*>(p.data()), p.size(), 0);
    if (!mr.ok()) return OpError("send (registering the payload)", mr.status());
    sges.push_back(mr->Local());
    regs.push_back(std::move(*mr));
    total += p.size();
  }
  return absl::OkStatus();
}

void ConnectionImpl::Unreserve() {
  if (status_.ok()) credits_.Release(1);
}

Task<absl::Status> ConnectionImpl::PostRts(PendingRts& pr, uint64_t total,
                                           transport::BufferPool::Buffer& buf) {
  // The RTS, in the send turn the caller holds with its credit: its place
  // in that turn fixes the message order. Reserve, in the same turn, the
  // credit the completion (DONE or WRITE_WITH_IMM, both consume a receive)
  // will need: taken later, it could wait forever behind messages that the
  // receiver queued after this rendezvous and cannot hand out until it
  // completes.
  absl::Status s = co_await TakeCredit();
  if (!s.ok()) {
    send_turn_.Release(1);
    co_return s;
  }
  // At most kCtsReserve of our RTS wait for their CTS, which the peer
  // sends into our reserve receives without credits. Waiting here, inside
  // the send turn, keeps messages in Send order; a CTS always comes (the
  // peer consumes RTS at once and needs nothing from us to answer).
  s = co_await rts_window_.Acquire(1);
  if (s.ok()) s = CheckUp("send");
  if (!s.ok()) {
    Unreserve();
    AbandonTurn();  // and the RTS's own credit
    co_return s;
  }
  WireHeader h;
  FillHeader(h, kRts, static_cast<uint32_t>(total), pr.cookie, 0);
  std::memcpy(buf.data(), &h, kHeaderSize);
  pending_rts_.push_back(&pr);
  transport::SendOptions so;
  so.inline_data = kHeaderSize <= qp_->max_inline_data();
  // Once posted, the RTS goes: cancelling it would move the QP to the
  // error state and fail the connection for everyone (as SendSmall).
  so.ignore_stop = true;
  send_turn_.Release(1);
  auto wc = co_await qp_->Send(buf.Local(kHeaderSize), so);
  if (!wc.ok()) {
    auto it = std::find(pending_rts_.begin(), pending_rts_.end(), &pr);
    if (it != pending_rts_.end()) pending_rts_.erase(it);
    Unreserve();
    co_return OpError("send (rendezvous request)", wc.status());
  }
  co_return absl::OkStatus();
}

Task<absl::Status> ConnectionImpl::AwaitCts(PendingRts& pr, uint64_t total) {
  absl::Status s = co_await pr.cts.Wait();
  if (!s.ok() || !pr.cts.is_set()) {
    // Cancelled: the receiver may already hold a buffer for us; tell it.
    auto it = std::find(pending_rts_.begin(), pending_rts_.end(), &pr);
    if (it != pending_rts_.end()) {
      pending_rts_.erase(it);
      abandoned_.push_back(pr.cookie);
    }
    Unreserve();
    co_return s.ok() ? absl::CancelledError("send cancelled") : s;
  }
  if (!status_.ok()) co_return CheckUp("send");
  if (pr.refused) {
    Unreserve();
    co_return absl::ResourceExhaustedError(absl::StrFormat(
        "send on %s: the peer could not provide a %d-byte buffer", name_,
        total));
  }
  co_return absl::OkStatus();
}

Task<absl::Status> ConnectionImpl::WriteRendezvous(
    const PendingRts& pr, std::span<const LocalBuffer> sges, uint64_t total) {
  // RDMA WRITE(s) into the receiver's buffer, then DONE -- one post, one
  // completion; RC ordering places the data before DONE is delivered. The
  // credit was reserved with the RTS; no send turn is needed (the DONE names
  // its message by cookie).
  auto buf = co_await GetSendBuffer();
  if (!buf.ok()) {
    Unreserve();
    co_return OpError("send", buf.status());
  }
  transport::SendBatch batch;
  uint64_t off = 0;
  RemoteRegion remote{pr.addr, total, pr.rkey};
  // A WRITE_WITH_IMM completion reports only its own WRITE's byte count, and
  // the receiver checks it against the announced size: finish by immediate
  // data only when one WRITE carries the whole message, else by DONE.
  const bool by_imm = use_imm_ && sges.size() == 1;
  for (size_t i = 0; i < sges.size(); ++i) {
    bool last = i + 1 == sges.size();
    std::optional<uint32_t> imm;
    if (last && by_imm) imm = pr.cookie;
    batch.AddWrite(sges[i], remote.Slice(off, sges[i].length), imm);
    off += sges[i].length;
  }
  if (!by_imm) {
    WireHeader h;
    FillHeader(h, kDone, 0, pr.cookie, 0);
    std::memcpy(buf->data(), &h, kHeaderSize);
    batch.AddSend(buf->Local(kHeaderSize));
  }
  auto wc = co_await qp_->PostBatch(batch);
  if (!wc.ok()) co_return OpError("send (rendezvous write)", wc.status());
  ++stats_.rendezvous_sent;
  ++stats_.messages_sent;
  stats_.bytes_sent += total;
  co_return absl::OkStatus();
}

bool ConnectionImpl::OnCts(RecvSlot* slot, const WireHeader& h) {
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
    return true;
  }
  auto it = std::find(abandoned_.begin(), abandoned_.end(), h.cookie);
  if (it == abandoned_.end()) {
    Protocol(absl::StrFormat("CTS for unknown rendezvous %d", h.cookie));
    return false;
  }
  abandoned_.erase(it);
  if (!(h.flags & kFlagRefused)) {
    // The Send gave up: release the receiver's buffer.
    SpawnInternal(SendControl(kDone, h.cookie, kFlagAborted, {}));
  }
  return true;
}

// --- Receiver.

LargeBuffer* ConnectionImpl::NewRendezvousBuffer(uint32_t length) {
  auto* lb = new LargeBuffer();
  lb->size = length;
  lb->cache = SharedOf(ctx_).large_memory;
  LargeMemoryCache::Block block = lb->cache->Get(length);
  lb->mem = block.mem;
  lb->capacity = block.capacity;
  if (lb->mem != nullptr) {
    auto mr = ctx_.pd().Register(
        lb->mem, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (mr.ok()) {
      lb->mr = std::move(*mr);
      return lb;
    }
  }
  delete lb;
  return nullptr;
}

bool ConnectionImpl::OnRts(const WireHeader& h) {
  if (h.length > options_.max_message_size) {
    Protocol(absl::StrFormat("rendezvous of %d bytes exceeds our maximum %d",
                             h.length, options_.max_message_size));
    return false;
  }
  ++stats_.rendezvous_received;
  ++stats_.messages_received;
  stats_.bytes_received += h.length;
  // The peer sends medium messages: from now on keep landing buffers
  // granted so that the next ones skip this round trip.
  NoteMediumSize(h.length);
  std::vector<std::byte> cts(kCtsSize);
  uint16_t flags = 0;
  // Out of memory or registrations: the sender's Send fails, not the
  // connection.
  LargeBuffer* lb = NewRendezvousBuffer(h.length);
  if (lb == nullptr) {
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
  return true;
}

bool ConnectionImpl::OnDone(const WireHeader& h) {
  for (auto it = incoming_.begin(); it != incoming_.end(); ++it) {
    if (!it->ready && it->large != nullptr && it->cookie == h.cookie) {
      if (h.flags & kFlagAborted) {
        delete it->large;
        incoming_.erase(it);
      } else {
        it->ready = true;
      }
      Pump();
      return true;
    }
  }
  Protocol(absl::StrFormat("DONE for unknown rendezvous %d", h.cookie));
  return false;
}

void ConnectionImpl::OnRendezvousImm(RecvSlot* slot, const ibv_wc& wc) {
  uint32_t cookie = ntohl(wc.imm_data);
  auto it = std::find_if(
      incoming_.begin(), incoming_.end(), [cookie](const Incoming& in) {
        return !in.ready && in.large != nullptr && in.cookie == cookie;
      });
  if (it == incoming_.end()) {
    Protocol(
        absl::StrFormat("WRITE_WITH_IMM for unknown rendezvous %d", cookie));
    return;
  }
  if (wc.byte_len != it->large->size) {
    Protocol(absl::StrFormat("rendezvous %d wrote %d bytes, announced %d",
                             cookie, wc.byte_len, it->large->size));
    return;
  }
  it->ready = true;
  // In place of a DONE: spends a credit (no header, so no low flag).
  if (!Spent(false)) return;
  // Nothing to keep: repost now.
  if (!qp_->in_error() && Repost(slot)) Replenish();
  Pump();
  MaybeSendCredits();
}

}  // namespace coverbs::cm::internal
