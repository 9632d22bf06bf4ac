// Medium messages (above the eager limit, up to landing_buffer_size) into
// landing buffers granted ahead of time (protocol 5).
//
// Why: the rendezvous costs a round trip (RTS -> CTS) before the data can
// move, and a registration on each side per message; just above the eager
// limit that made a message several times dearer than one just below it.
// Here the receiver registers buffers before they are needed and grants
// them in credit messages; the sender WRITEs into the oldest grant and posts
// a kLanded header behind it (one post, RC ordering puts the data first),
// so a medium message costs one one-way trip, as an eager one does; the
// payload's last size % 4096 bytes ride in the header's packet (protocol 7).
//
// Safety, as for the rendezvous: each grant's registration serves exactly
// one message. When the kLanded naming it arrives the receiver deregisters
// it (or, for a memory window, checks that the header invalidated it; the
// block's own registration gives no remote access and stays) -- a later
// WRITE with that rkey fails with a remote access error -- hands the memory
// to the application as the Message, and grants a fresh buffer. The sender's
// payload is copied into a registered staging buffer of the Worker (local
// access only), so no registration happens on its side (a caller's own
// registered buffer goes straight from there).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"
#include "core/log.h"

namespace coverbs::cm::internal {
namespace {

// Staging buffers per Worker: one is held from the copy to the WRITE's
// completion, which on soft and RoCE comes with the peer's acknowledgement
// -- about one round trip. As many as the default landing_buffers, the
// grants one connection can have in flight: with fewer (16), a connection
// with 16 calls in flight both ways waited for a buffer on most medium
// sends, in its send turn, and its sends went out one acknowledgement at a
// time (the server's reactor posted one response per loop iteration at
// 8192 B against 16 at 8160 B). 32 x landing_buffer_size (4 MiB by
// default) per Worker, registered when its first medium message is sent.
constexpr size_t kLandingStagingBuffers = 32;
// Grants by memory window per credit message (each is a bind WR posted with
// it, and the batch must fit the send queue: WriteGrants also caps it at
// the send queue's depth). 32: the default 32 grants go in one credit
// message. With 16, a second credit message of binds was often still
// unacknowledged when a reactor went busy for long (landing_test
// MixedSizes... builds 300 messages at once), and on soft, whose binds
// travel as requests that the peer's reactor acknowledges, that ran into
// the transport timer under load (issue 27 report).
constexpr uint32_t kMaxBindsPerMessage = 32;

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
  if (!FitsGrant(total)) co_return co_await SendLarge(parts, registered, *buf);
  // A landed message, in this coroutine's frame: a second frame (and its
  // resumption) per message was part of the landed path's extra cost.
  // We hold the send turn and a credit (the kLanded header spends it).
  std::optional<transport::BufferPool::Buffer> staging;
  if (registered == nullptr) {
    // A free staging buffer without a coroutine (the common case).
    if (staging_pool_ != nullptr) staging = staging_pool_->TryGet();
    if (!staging) {
      // Staging buffers are held only by posted WRITEs, which complete:
      // waiting for one in the turn cannot deadlock.
      auto st = co_await GetLandingStaging();
      if (!st.ok() || !status_.ok()) {
        AbandonTurn();
        co_return st.ok()
            ? CheckUp("send")
            : OpError("send (landing staging buffer)", st.status());
      }
      staging.emplace(std::move(*st));
    }
  }
  transport::SendBatch batch;
  BuildLanded(parts, registered, total, staging ? &*staging : nullptr, *buf,
              batch);
  send_turn_.Release(1);
  // Once posted, the message goes: a cancelled Send waits for the
  // completion rather than moving the QP to the error state, which would
  // fail the connection for everyone (as SendSmall).
  auto wc = co_await qp_->PostBatch(batch, /*ignore_stop=*/true);
  if (!wc.ok()) co_return OpError("send (landing write)", wc.status());
  ++stats_.landed_sent;
  ++stats_.messages_sent;
  stats_.bytes_sent += total;
  co_return absl::OkStatus();
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::GetLandingStaging() {
  // SendBig tried TryGet already (or the pool does not exist yet): wait for
  // one.
  if (staging_pool_ == nullptr) {
    // A staging buffer holds one medium message, usually far smaller than
    // the buffer.
    auto pool = PoolOf(options_.landing_buffer_size, kLandingStagingBuffers,
                       /*partly_used=*/true);
    if (!pool.ok()) co_return pool.status();
    staging_pool_ = *pool;
  }
  co_return co_await staging_pool_->Get();
}

void LandedSendDeleter::operator()(LandedSend* l) const { delete l; }

std::unique_ptr<LandedSend, LandedSendDeleter> ConnectionImpl::TryStartLanded(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, uint64_t total,
    std::optional<transport::BufferPool::Buffer>& buf) {
  if (total > peer_max_ || !FitsGrant(total)) return nullptr;
  std::optional<transport::BufferPool::Buffer> staging;
  if (registered == nullptr) {
    // (Before the first landed message the pool is not looked up yet:
    // SendBig does it.)
    if (staging_pool_ == nullptr) return nullptr;
    staging = staging_pool_->TryGet();
    if (!staging) return nullptr;
  }
  // Last, as it takes the turn (only when nobody waits for it: FIFO).
  if (!TryAcquireSend(buf)) return nullptr;
  std::unique_ptr<LandedSend, LandedSendDeleter> l(new LandedSend());
  l->staging = std::move(staging);
  BuildLanded(parts, registered, total, l->staging ? &*l->staging : nullptr,
              *buf, l->batch);
  return l;
}

void ConnectionImpl::BuildLanded(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, uint64_t total,
    transport::BufferPool::Buffer* staging, transport::BufferPool::Buffer& buf,
    transport::SendBatch& batch) {
  LocalBuffer src;
  if (registered != nullptr) {
    src = *registered;
  } else {
    CopyParts(staging->data(), parts);
    src = staging->Local(static_cast<uint32_t>(total));
  }
  GrantPayload g = grants_.front();
  grants_.pop_front();
  uint32_t seq = grant_seq_++;
  // The payload's tail past the last whole 4 KiB rides behind the header,
  // so the WRITE is whole packets at any path MTU (256..4096) and the
  // header's packet, which travels anyway, carries the rest: the first
  // landed size (8192 B plus the rpc header) was a WRITE of 9 packets on
  // rxe (MTU 1024) plus the header's, one packet more than its eager
  // neighbour (protocol 7).
  const uint32_t tail = LandedTail(total, buf.size());
  const uint64_t written = total - tail;
  WireHeader h;
  FillHeader(h, kLanded, static_cast<uint32_t>(total), seq, 0);
  std::memcpy(buf.data(), &h, kHeaderSize);
  std::memcpy(buf.data() + kHeaderSize,
              static_cast<const std::byte*>(src.addr) + written, tail);
  batch.AddWrite(
      LocalBuffer{src.addr, static_cast<uint32_t>(written), src.lkey},
      RemoteRegion{g.addr, written, g.rkey});
  if (g.size & kGrantInvalidate) {
    // The header ends the window: nothing can write the buffer once the
    // receiver sees it.
    batch.AddSendWithInvalidate(buf.Local(kHeaderSize + tail), g.rkey);
  } else {
    batch.AddSend(buf.Local(kHeaderSize + tail));
  }
}

uint32_t ConnectionImpl::LandedTail(uint64_t total, size_t buf_size) const {
  const uint32_t tail = static_cast<uint32_t>(total % 4096);
  // It must fit the peer's receive buffer and our header buffer, and leave
  // the WRITE something to carry (else everything goes by WRITE).
  if (tail >= total || tail > eager_max_ || kHeaderSize + tail > buf_size) {
    return 0;
  }
  return tail;
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
    if (GrantBytes(g) == 0) {
      Protocol("an empty landing grant");
      return false;
    }
    if ((g.size & kGrantInvalidate) && !qp_->caps().send_with_invalidate) {
      Protocol(absl::StrFormat(
          "a landing grant needs SEND_WITH_INV, which %s cannot send",
          qp_->caps().device_name));
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
  // What a grant would hold once landed; past the connection's or the
  // Worker's rendezvous budget no grant is renewed and medium messages
  // take the rendezvous, whose CTS waits (rendezvous.cc). The next RTS or
  // landed message looks again. Granting holds nothing yet, so one look
  // answers for every grant of this pass.
  if (granted_.size() >= options_.landing_buffers ||
      !FitsBudget(static_cast<uint32_t>(options_.landing_buffer_size))) {
    MaybeSendCredits();
    return;
  }
  while (granted_.size() < options_.landing_buffers) {
    // Out of memory or registrations: medium messages take the
    // rendezvous, which refuses per message instead.
    LargeBuffer* lb = NewLandingBuffer();
    if (lb == nullptr) break;
    granted_.push_back(lb);
    ++grants_unsent_;
  }
  MaybeSendCredits();
}

LargeBuffer* ConnectionImpl::NewLandingBuffer() {
  const auto size = static_cast<uint32_t>(options_.landing_buffer_size);
  if (!landing_windows_) return NewRendezvousBuffer(size);
  auto* lb = new LargeBuffer();
  lb->size = size;
  lb->cache = SharedOf(ctx_).landing_memory;
  LargeMemoryCache::Block block = lb->cache->Get(size);
  lb->mem = block.mem;
  lb->capacity = block.capacity;
  lb->mr = std::move(block.mr);
  if (lb->mem == nullptr) {
    delete lb;
    return nullptr;
  }
  if (!lb->mr.valid()) {
    // Once per block: no remote access but through the windows.
    auto mr = ctx_.pd().Register(lb->mem, lb->capacity,
                                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    if (!mr.ok()) {
      delete lb;
      return nullptr;
    }
    lb->mr = *std::move(mr);
  }
  if (!free_windows_.empty()) {
    lb->window = std::move(free_windows_.back());
    free_windows_.pop_back();
    return lb;
  }
  auto window = ctx_.pd().AllocateWindow();
  if (window.ok()) {
    lb->window = *std::move(window);
    return lb;
  }
  // Out of windows (max_mw): this and later grants are registrations.
  COVERBS_LOG(kWarning, "cm",
              "%s: no memory window for a landing grant (%s); granting "
              "registrations instead",
              name_, window.status().ToString());
  landing_windows_ = false;
  delete lb;
  return NewRendezvousBuffer(size);
}

size_t ConnectionImpl::WriteGrants(std::span<std::byte> out,
                                   transport::SendBatch& binds) {
  uint32_t n =
      std::min<uint32_t>({grants_unsent_, kMaxGrantsPerMessage,
                          static_cast<uint32_t>(out.size() / kGrantSize)});
  size_t first = granted_.size() - grants_unsent_;
  // Binds take send-queue slots (the batch waits for all of them at once):
  // a few per message keep it well inside the smallest send queue.
  if (landing_windows_) {
    n = std::min({n, kMaxBindsPerMessage, qp_->provider()->max_send_wr() - 1});
  }
  for (uint32_t i = 0; i < n; ++i) {
    LargeBuffer* lb = granted_[first + i];
    GrantPayload g{reinterpret_cast<uint64_t>(lb->mem), lb->mr.rkey(),
                   static_cast<uint32_t>(lb->size)};
    if (lb->window.valid()) {
      g.rkey = binds.AddBind(lb->window, lb->mr, {lb->mem, lb->size},
                             IBV_ACCESS_REMOTE_WRITE);
      g.size |= kGrantInvalidate;
    }
    std::memcpy(out.data() + i * kGrantSize, &g, kGrantSize);
  }
  grants_unsent_ -= n;
  return n * kGrantSize;
}

bool ConnectionImpl::OnLanded(RecvSlot* slot, const WireHeader& h,
                              const ibv_wc& wc) {
  // The payload's tail (LandedTail) follows the header; the rest is in the
  // grant. On a violation the connection fails and the slot stays.
  const uint32_t tail = wc.byte_len - static_cast<uint32_t>(kHeaderSize);
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
  if (lb->window.valid()) {
    // The header must have ended the window (SEND_WITH_INV naming it), or
    // the peer could still write the memory we are about to hand out.
    if (!(wc.wc_flags & IBV_WC_WITH_INV) ||
        wc.invalidated_rkey != lb->window.rkey()) {
      Protocol(absl::StrFormat(
          "landed message %d did not invalidate its grant's window (rkey "
          "0x%x; completion flags 0x%x, invalidated 0x%x)",
          h.cookie, lb->window.rkey(), wc.wc_flags,
          (wc.wc_flags & IBV_WC_WITH_INV) ? wc.invalidated_rkey : 0));
      return false;
    }
  }
  // The tail goes into place, and the header's receive is ours again.
  std::memcpy(lb->mem + (h.length - tail), slot->data + kHeaderSize, tail);
  Consume(slot);
  granted_.pop_front();
  ++landing_seq_;
  // This grant's rkey ends with its message: the peer invalidated the
  // window, which is ours to bind again; a registration ends here.
  if (lb->window.valid()) {
    free_windows_.push_back(std::move(lb->window));
  } else {
    lb->mr.Deregister();
  }
  lb->size = h.length;
  ++stats_.landed_received;
  ++stats_.messages_received;
  stats_.bytes_received += h.length;
  // Handed over as a finished Message, not as `in.large`: Pump deregisters
  // a rendezvous buffer's region, which for a window grant is the block's
  // lasting registration (no remote access) -- dropping it cost a
  // deregistration here and a registration in the next NewLandingBuffer
  // per message.
  // Held against the budgets until Recv takes it: past them no grant is
  // renewed (TopUpGrants), so a peer cannot queue landed blocks without
  // end while the application does not call Recv.
  const uint64_t block =
      Pinned(static_cast<uint32_t>(options_.landing_buffer_size));
  HoldRendezvous(static_cast<int64_t>(block));
  Incoming in;
  in.ready = true;
  in.landed_bytes = block;
  in.msg.data_ = lb->mem;
  in.msg.size_ = lb->size;
  in.msg.owner_ = lb;
  incoming_.push_back(std::move(in));
  Pump();
  TopUpGrants();
  return true;
}

}  // namespace coverbs::cm::internal
