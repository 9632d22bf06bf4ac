// Medium messages (above the eager limit, up to landing_buffer_size) into
// landing buffers granted ahead of time (protocol 5).
//
// Why: the rendezvous costs a round trip (RTS -> CTS) before the data can
// move, and a registration on each side per message; just above the eager
// limit that made a message several times dearer than one just below it.
// Here the receiver registers buffers before they are needed and grants
// them in credit messages; the sender WRITEs into the oldest grant and posts
// a kLanded header behind it (one post, RC ordering puts the data first),
// so a medium message costs one one-way trip, as an eager one does.
//
// Safety, as for the rendezvous: each grant's registration serves exactly
// one message. The receiver deregisters it when the kLanded naming it
// arrives -- a later WRITE with that rkey fails with a remote access error
// -- hands the memory to the application as the Message, and registers a
// fresh buffer for the next grant. The sender's payload is copied into a
// registered staging buffer of the Worker (local access only), so no
// registration happens on its side (a caller's own registered buffer goes
// straight from there).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"

namespace coverbs::cm::internal {
namespace {

// Staging buffers per Worker: one is held only from the copy to the
// WRITE's completion.
constexpr size_t kLandingStagingBuffers = 16;

}  // namespace

// --- Sender.

Task<absl::Status> ConnectionImpl::SendBig(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, uint64_t total) {
  std::optional<transport::BufferPool::Buffer> buf;
  // Turn, credit and header buffer without AcquireSend's three nested
  // coroutines when all are free, as SendSmall does: that path was ~600
  // instructions of the landed message's extra cost (callgrind).
  if (!TryAcquireSend(buf)) {
    auto got = co_await AcquireSend();
    if (!got.ok()) co_return got.status();
    buf = *std::move(got);
  }
  // Grants only ever arrive while we wait, so what is seen here holds.
  if (!grants_.empty() && total <= grants_.front().size) {
    co_return co_await SendLanded(parts, registered, total, *buf);
  }
  co_return co_await SendLarge(parts, registered, *buf);
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::GetLandingStaging() {
  auto pool = PoolOf(options_.landing_buffer_size, kLandingStagingBuffers);
  if (!pool.ok()) co_return pool.status();
  if (auto b = (*pool)->TryGet()) co_return std::move(*b);
  co_return co_await (*pool)->Get();
}

Task<absl::Status> ConnectionImpl::SendLanded(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, uint64_t total,
    transport::BufferPool::Buffer& buf) {
  // We hold the send turn and a credit (the kLanded header spends it).
  std::optional<transport::BufferPool::Buffer> staging;
  LocalBuffer src;
  if (registered != nullptr) {
    src = *registered;
  } else {
    // A free staging buffer without a coroutine (the common case).
    auto pool = PoolOf(options_.landing_buffer_size, kLandingStagingBuffers);
    if (pool.ok()) staging = (*pool)->TryGet();
  }
  if (registered == nullptr && !staging) {
    // Staging buffers are held only by posted WRITEs, which complete:
    // waiting for one in the turn cannot deadlock.
    auto st = co_await GetLandingStaging();
    if (!st.ok() || !status_.ok()) {
      AbandonTurn();
      co_return st.ok() ? CheckUp("send")
                        : OpError("send (landing staging buffer)", st.status());
    }
    staging.emplace(std::move(*st));
  }
  if (staging) {
    CopyParts(staging->data(), parts);
    src = staging->Local(static_cast<uint32_t>(total));
  }
  GrantPayload g = grants_.front();
  grants_.pop_front();
  uint32_t seq = grant_seq_++;
  WireHeader h;
  FillHeader(h, kLanded, static_cast<uint32_t>(total), seq, 0);
  std::memcpy(buf.data(), &h, kHeaderSize);
  transport::SendBatch batch;
  batch.AddWrite(src, RemoteRegion{g.addr, total, g.rkey});
  batch.AddSend(buf.Local(kHeaderSize));
  send_turn_.Release(1);
  auto wc = co_await qp_->PostBatch(batch);
  if (!wc.ok()) co_return OpError("send (landing write)", wc.status());
  ++stats_.landed_sent;
  ++stats_.messages_sent;
  stats_.bytes_sent += total;
  co_return absl::OkStatus();
}

bool ConnectionImpl::TakeGrants(const RecvSlot* slot, const WireHeader& h) {
  uint32_t n = h.length / kGrantSize;
  if (n == 0) return true;
  if (grants_.size() + n > kMaxGrantsHeld) {
    Protocol(absl::StrFormat("%d landing grants held, more than %d",
                             grants_.size() + n, kMaxGrantsHeld));
    return false;
  }
  for (uint32_t i = 0; i < n; ++i) {
    GrantPayload g;
    std::memcpy(&g, slot->data + kHeaderSize + i * kGrantSize, kGrantSize);
    if (g.size == 0) {
      Protocol("an empty landing grant");
      return false;
    }
    grants_.push_back(g);
  }
  return true;
}

// --- Receiver.

void ConnectionImpl::NoteMediumSize(uint64_t length) {
  if (options_.landing_buffers == 0 || length > options_.landing_buffer_size) {
    return;
  }
  landing_on_ = true;
  TopUpGrants();
}

bool ConnectionImpl::GrantsDue() const {
  if (grants_unsent_ == 0) return false;
  uint32_t quarter = std::max<uint32_t>(1, options_.landing_buffers / 4);
  return grants_unsent_ >= quarter ||
         granted_.size() - grants_unsent_ <= quarter;
}

void ConnectionImpl::TopUpGrants() {
  if (!landing_on_ || !status_.ok() || closing_) return;
  while (granted_.size() < options_.landing_buffers) {
    // Out of memory or registrations: medium messages take the
    // rendezvous, which refuses per message instead.
    LargeBuffer* lb = NewRendezvousBuffer(
        static_cast<uint32_t>(options_.landing_buffer_size));
    if (lb == nullptr) break;
    granted_.push_back(lb);
    ++grants_unsent_;
  }
  MaybeSendCredits();
}

size_t ConnectionImpl::WriteGrants(std::span<std::byte> out) {
  uint32_t n =
      std::min<uint32_t>({grants_unsent_, kMaxGrantsPerMessage,
                          static_cast<uint32_t>(out.size() / kGrantSize)});
  size_t first = granted_.size() - grants_unsent_;
  for (uint32_t i = 0; i < n; ++i) {
    const LargeBuffer* lb = granted_[first + i];
    GrantPayload g{reinterpret_cast<uint64_t>(lb->mem), lb->mr.rkey(),
                   static_cast<uint32_t>(lb->size)};
    std::memcpy(out.data() + i * kGrantSize, &g, kGrantSize);
  }
  grants_unsent_ -= n;
  return n * kGrantSize;
}

bool ConnectionImpl::OnLanded(RecvSlot* slot, const WireHeader& h) {
  // The header's receive is ours again at once; the data is in the grant.
  Consume(slot);
  size_t announced = granted_.size() - grants_unsent_;
  if (announced == 0 || h.cookie != landing_seq_) {
    Protocol(absl::StrFormat(
        "landed message names grant %d; the oldest granted is %d (%d "
        "announced)",
        h.cookie, landing_seq_, announced));
    return false;
  }
  LargeBuffer* lb = granted_.front();
  if (h.length > lb->size) {
    Protocol(absl::StrFormat("landed message of %d bytes in a %d-byte grant",
                             h.length, lb->size));
    return false;
  }
  granted_.pop_front();
  ++landing_seq_;
  // This grant's rkey ends with its message.
  lb->mr.Deregister();
  lb->size = h.length;
  ++stats_.landed_received;
  ++stats_.messages_received;
  stats_.bytes_received += h.length;
  Incoming in;
  in.ready = true;
  in.large = lb;
  incoming_.push_back(std::move(in));
  Pump();
  TopUpGrants();
  return true;
}

}  // namespace coverbs::cm::internal
