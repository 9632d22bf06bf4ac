// Large messages: RTS, the receiver's CTS with (addr, rkey), RDMA WRITE(s)
// and DONE (or WRITE_WITH_IMM) in one post.
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"

namespace coverbs::cm::internal {

Task<absl::Status> ConnectionImpl::SendLarge(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered) {
  // The payload goes straight from the caller's memory: registered for this
  // Send only (a cache keyed by address could outlive a free/reuse of the
  // memory and send stale pages).
  std::vector<MemoryRegion> regs;
  std::vector<LocalBuffer> sges;
  uint64_t total = 0;
  if (registered != nullptr) {
    sges.push_back(*registered);
    total = registered->length;
  } else {
    for (auto p : parts) {
      if (p.empty()) continue;
      auto mr =
          ctx_.pd().Register(const_cast<std::byte*>(p.data()), p.size(), 0);
      if (!mr.ok())
        co_return OpError("send (registering the payload)", mr.status());
      sges.push_back(mr->Local());
      regs.push_back(std::move(*mr));
      total += p.size();
    }
  }
  PendingRts pr;
  pr.cookie = next_cookie_++;
  absl::Status s_reserved;
  // Gives the reserved completion credit back when no completion is sent.
  auto unreserve = [this]() {
    if (status_.ok()) credits_.Release(1);
  };
  {
    // The RTS; its position in the credit queue fixes the message order.
    auto buf = co_await AcquireSend();
    if (!buf.ok()) co_return buf.status();
    // Reserve, in the same turn, the credit the completion (DONE or
    // WRITE_WITH_IMM, both consume a receive) will need: taken later, it
    // could wait forever behind messages that the receiver queued after
    // this rendezvous and cannot hand out until it completes.
    s_reserved = co_await TakeCredit();
    if (!s_reserved.ok()) {
      send_turn_.Release(1);
      co_return s_reserved;
    }
    // At most kCtsReserve of our RTS wait for their CTS, which the peer
    // sends into our reserve receives without credits. Waiting here, inside
    // the send turn, keeps messages in Send order; a CTS always comes (the
    // peer consumes RTS at once and needs nothing from us to answer).
    absl::Status w = co_await rts_window_.Acquire(1);
    if (w.ok()) w = CheckUp("send");
    if (!w.ok()) {
      unreserve();
      if (status_.ok()) credits_.Release(1);  // the RTS's own credit
      send_turn_.Release(1);
      co_return w;
    }
    WireHeader h;
    FillHeader(h, kRts, static_cast<uint32_t>(total), pr.cookie, 0);
    std::memcpy(buf->data(), &h, kHeaderSize);
    pending_rts_.push_back(&pr);
    transport::SendOptions so;
    so.inline_data = kHeaderSize <= qp_->max_inline_data();
    send_turn_.Release(1);
    auto wc = co_await qp_->Send(buf->Local(kHeaderSize), so);
    if (!wc.ok()) {
      auto it = std::find(pending_rts_.begin(), pending_rts_.end(), &pr);
      if (it != pending_rts_.end()) pending_rts_.erase(it);
      unreserve();
      co_return OpError("send (rendezvous request)", wc.status());
    }
  }
  absl::Status s = co_await pr.cts.Wait();
  if (!s.ok() || !pr.cts.is_set()) {
    // Cancelled: the receiver may already hold a buffer for us; tell it.
    auto it = std::find(pending_rts_.begin(), pending_rts_.end(), &pr);
    if (it != pending_rts_.end()) {
      pending_rts_.erase(it);
      abandoned_.push_back(pr.cookie);
    }
    unreserve();
    co_return s.ok() ? absl::CancelledError("send cancelled") : s;
  }
  if (!status_.ok()) co_return CheckUp("send");
  if (pr.refused) {
    unreserve();
    co_return absl::ResourceExhaustedError(absl::StrFormat(
        "send on %s: the peer could not provide a %d-byte buffer", name_,
        total));
  }
  // RDMA WRITE(s) into the receiver's buffer, then DONE -- one post, one
  // completion; RC ordering places the data before DONE is delivered. The
  // credit was reserved with the RTS; no send turn is needed (the DONE names
  // its message by cookie).
  auto buf = co_await GetSendBuffer();
  if (!buf.ok()) {
    unreserve();
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
  co_return absl::OkStatus();
}

}  // namespace coverbs::cm::internal
