// Large messages (rendezvous): the sender's RTS, the receiver's CTS with
// (addr, rkey) for a buffer registered for this transfer only, the sender's
// RDMA WRITE(s) and DONE (or WRITE_WITH_IMM) in one post. Medium messages
// take this path only until landing buffers are granted (landing.cc).
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"

namespace coverbs::cm::internal {

// --- Sender.

Task<absl::Status> ConnectionImpl::SendLarge(
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* registered, transport::BufferPool::Buffer& buf) {
  std::vector<MemoryRegion> regs;  // until the WRITEs completed
  std::vector<LocalBuffer> sges;
  uint64_t total = 0;
  absl::Status s = PayloadSges(parts, registered, buf, regs, sges, total);
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
    const LocalBuffer* registered, transport::BufferPool::Buffer& buf,
    std::vector<MemoryRegion>& regs, std::vector<LocalBuffer>& sges,
    uint64_t& total) {
  if (registered != nullptr) {
    sges.push_back(*registered);
    total = registered->length;
    return absl::OkStatus();
  }
  // Small parts (an rpc header) are copied into the RTS's send buffer,
  // behind the RTS itself (which the WRITEs follow): registering 32 bytes
  // costs two system calls and a pinned page per message, and leaves the
  // device reading a scrap of the caller's memory (a coroutine frame),
  // wherever it lies, for the whole transfer.
  const LocalBuffer staging = buf.Local();
  size_t staged = kStagingOffset;
  // The rest goes straight from the caller's memory: registered for this
  // Send only (a cache keyed by address could outlive a free/reuse of the
  // memory and send stale pages).
  for (auto p : parts) {
    if (p.empty()) continue;
    if (p.size() <= kCopiedPartMax && staged + p.size() <= staging.length) {
      std::memcpy(buf.data() + staged, p.data(), p.size());
      sges.push_back(LocalBuffer{buf.data() + staged,
                                 static_cast<uint32_t>(p.size()), staging.lkey});
      staged += p.size();
      total += p.size();
      continue;
    }
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

// The budget. A request is granted at once when none waits before it and
// its bytes fit; else it keeps its place in incoming_ as a deferred entry
// and GrantDeferred answers it once enough was received and taken. CTS
// messages answer requests in their order (the sender matches them to
// its oldest request), so nothing overtakes a deferred request.

void ConnectionImpl::HoldRendezvous(int64_t bytes) {
  rdv_held_ += bytes;
  stats_.rendezvous_bytes_held_peak =
      std::max(stats_.rendezvous_bytes_held_peak, rdv_held_);
  if (detached_) return;  // the Worker is going; it counts no more
  WorkerShared& w = SharedOf(ctx_);
  w.rdv_held += bytes;
  w.rdv_held_now.store(w.rdv_held, std::memory_order_relaxed);
  if (w.rdv_held > w.rdv_held_peak.load(std::memory_order_relaxed)) {
    w.rdv_held_peak.store(w.rdv_held, std::memory_order_relaxed);
  }
}

void ConnectionImpl::SettleReady() {
  const uint64_t taken = ready_.popped();
  uint64_t settled = 0;
  while (!rdv_ready_.empty() && rdv_ready_.front().index < taken) {
    settled += rdv_ready_.front().bytes;
    rdv_ready_.pop_front();
  }
  if (settled > 0) HoldRendezvous(-static_cast<int64_t>(settled));
}

// What waits behind a deferred request -- messages that arrived after it:
// landed ones, which the sender writes into the grants it holds meanwhile
// -- cannot be taken by Recv before that request is granted and done. It
// is not counted when a request is weighed against the budgets: the
// request would otherwise wait for ever for memory that only its own grant
// can free (and with the Worker's budget, other connections' requests with
// it). What it can add is bounded apart: landing grants are renewed only
// within the budgets (TopUpGrants).
uint64_t ConnectionImpl::HeldBehindDeferred() const {
  if (rdv_deferred_ == 0) return 0;
  uint64_t behind = 0;
  bool after = false;
  for (const Incoming& in : incoming_) {
    after = after || in.deferred;
    if (!after) continue;
    behind += in.landed_bytes;
    if (in.large != nullptr) behind += Pinned(in.size);
  }
  return behind;
}

bool ConnectionImpl::FitsWorkerBudget(uint64_t pinned) {
  if (detached_) return true;
  WorkerShared& w = SharedOf(ctx_);
  const uint64_t budget = ctx_.options().rendezvous_budget;
  auto fits = [&](uint64_t held) {
    return budget == 0 || held == 0 || held + pinned <= budget;
  };
  if (fits(w.rdv_held)) return true;
  // Other connections' applications may have taken messages since their
  // connection last looked (SettleReady is lazy); what waits behind
  // deferred requests does not count (HeldBehindDeferred).
  uint64_t behind = 0;
  for (ConnectionImpl* c : w.connections) {
    c->SettleReady();
    behind += c->HeldBehindDeferred();
  }
  // (Each connection's part is within its own count; guarded all the same.)
  return fits(w.rdv_held > behind ? w.rdv_held - behind : 0);
}

uint64_t ConnectionImpl::RendezvousHeld() const {
  uint64_t held = rdv_held_;
  const uint64_t taken = ready_.popped();
  for (const ReadyLarge& r : rdv_ready_) {
    if (r.index >= taken) break;
    held -= r.bytes;
  }
  return held;
}

bool ConnectionImpl::FitsBudget(uint32_t size) {
  SettleReady();
  rdv_worker_limited_ = false;
  // With nothing held ahead of it, one message goes whatever the budget: a
  // message up to max_message_size is never refused for it. (The oldest
  // deferred request is the one weighed: GrantDeferred goes oldest first.)
  const uint64_t pinned = Pinned(size);
  const uint64_t behind = HeldBehindDeferred();
  const uint64_t held = rdv_held_ > behind ? rdv_held_ - behind : 0;
  if (held != 0 && held + pinned > options_.rendezvous_budget) {
    return false;
  }
  rdv_worker_limited_ = !FitsWorkerBudget(pinned);
  return !rdv_worker_limited_;
}

bool ConnectionImpl::GrantRendezvous(Incoming& in) {
  std::vector<std::byte> cts(kCtsSize);
  // Out of memory or registrations: the sender's Send fails, not the
  // connection.
  LargeBuffer* lb = NewRendezvousBuffer(in.size);
  if (lb == nullptr) {
    ++stats_.rendezvous_refused;
    SpawnInternal(SendCts(in.cookie, kFlagRefused, std::move(cts)));
    return false;
  }
  CtsPayload p{reinterpret_cast<uint64_t>(lb->mem), lb->mr.rkey(), 0};
  std::memcpy(cts.data(), &p, kCtsSize);
  in.large = lb;
  in.deferred = false;
  HoldRendezvous(static_cast<int64_t>(Pinned(in.size)));
  const absl::Duration timeout = options_.rendezvous_done_timeout;
  const bool timed =
      timeout > absl::ZeroDuration() && timeout != absl::InfiniteDuration();
  if (timed) {
    in.done_by = SteadyAfter(timeout);
    WatchRendezvous();
  }
  SpawnInternal(SendCts(in.cookie, 0, std::move(cts)));
  return true;
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
  Incoming in;
  in.cookie = h.cookie;
  in.size = h.length;
  if (rdv_deferred_ == 0 && FitsBudget(h.length)) {
    incoming_.push_back(std::move(in));
    if (!GrantRendezvous(incoming_.back())) incoming_.pop_back();
    return true;
  }
  // Over budget: the CTS waits. A sender has at most kCtsReserve requests
  // waiting for their CTS, and deferred ones are among them: one more is
  // a peer that ignores the rule to make us queue without end.
  if (rdv_deferred_ >= kCtsReserve) {
    ++stats_.rendezvous_budget_violations;
    SharedOf(ctx_).rendezvous_budget_violations.fetch_add(
        1, std::memory_order_relaxed);
    Protocol(absl::StrFormat(
        "rendezvous budget: rendezvous %d is request %d waiting for its CTS, "
        "a sender may have at most %d (kCtsReserve); %d bytes held of the "
        "%d-byte budget (ConnectionOptions::rendezvous_budget)",
        h.cookie, rdv_deferred_ + 1, kCtsReserve, RendezvousHeld(),
        options_.rendezvous_budget));
    return false;
  }
  in.deferred = true;
  incoming_.push_back(std::move(in));
  ++rdv_deferred_;
  ++stats_.rendezvous_deferred;
  SharedOf(ctx_).rendezvous_deferred.fetch_add(1, std::memory_order_relaxed);
  if (rdv_worker_limited_) {
    SharedOf(ctx_).rendezvous_deferred_by_worker.fetch_add(
        1, std::memory_order_relaxed);
  }
  WatchRendezvous();
  return true;
}

void ConnectionImpl::GrantDeferred() {
  if (rdv_deferred_ == 0 || !status_.ok()) return;
  bool removed = false;
  for (auto it = incoming_.begin();
       it != incoming_.end() && rdv_deferred_ > 0;) {
    if (!it->deferred) {
      ++it;
      continue;
    }
    if (!FitsBudget(it->size)) break;  // and every later one waits too
    --rdv_deferred_;
    if (GrantRendezvous(*it)) {
      ++it;
    } else {
      it = incoming_.erase(it);
      removed = true;
    }
  }
  // A refused request at the front held back what followed it.
  if (removed) Pump();
}

void ConnectionImpl::WatchRendezvous() {
  if (rdv_watch_running_) {
    if (rdv_deferred_ > 0) rdv_wake_.Set();
    return;
  }
  rdv_watch_running_ = true;
  SpawnInternal(RendezvousWatch());
}

Task<void> ConnectionImpl::RendezvousWatch() {
  // How often deferred requests look again while messages they wait for
  // sit in ready_ (Recv takes them without telling us; a DONE, an abort
  // or a refusal look at once): after 1 ms, doubling up to 64 ms while
  // nothing could be granted (an application that stopped reading costs
  // ~16 wake-ups a second, not 1,000).
  constexpr absl::Duration kFirstPoll = absl::Milliseconds(1);
  constexpr absl::Duration kMaxPoll = absl::Milliseconds(64);
  absl::Duration poll_every = kFirstPoll / 2;  // doubled before its use
  const absl::Duration timeout = options_.rendezvous_done_timeout;
  for (;;) {
    if (!status_.ok()) break;
    rdv_wake_.Reset();
    const uint32_t deferred_before = rdv_deferred_;
    GrantDeferred();
    if (!status_.ok()) break;
    poll_every = rdv_deferred_ < deferred_before
                     ? kFirstPoll
                     : std::min(poll_every * 2, kMaxPoll);
    const SteadyTime now = SteadyNow();
    std::optional<SteadyTime> next;
    const Incoming* oldest = nullptr;
    for (const Incoming& in : incoming_) {
      if (in.large == nullptr || in.ready || in.done_by == SteadyTime{}) {
        continue;
      }
      if (oldest == nullptr || in.done_by < oldest->done_by) oldest = &in;
    }
    if (oldest != nullptr) {
      if (oldest->done_by <= now) {
        ++stats_.rendezvous_done_timeouts;
        SharedOf(ctx_).rendezvous_done_timeouts.fetch_add(
            1, std::memory_order_relaxed);
        // Fail moves the QP to the error state before it frees the
        // buffers of unfinished rendezvous: the peer writes them no more.
        Fail(CloseCause::kProtocolViolation,
             absl::DeadlineExceededError(absl::StrFormat(
                 "peer sent no DONE for rendezvous %d (%d bytes) within %s "
                 "of its CTS (ConnectionOptions::rendezvous_done_timeout)",
                 oldest->cookie, oldest->size,
                 absl::FormatDuration(timeout))));
        break;
      }
      next = oldest->done_by;
    }
    // Messages this connection queued may be taken by Recv; with the
    // Worker's budget spent, other connections' may.
    if (rdv_deferred_ > 0 && (!rdv_ready_.empty() || rdv_worker_limited_)) {
      const SteadyTime poll = now + absl::ToChronoNanoseconds(poll_every);
      if (!next.has_value() || poll < *next) next = poll;
    }
    // Deferred requests with nothing in ready_ wait for a DONE (which
    // grants them), or for Pump to queue messages (which wakes us).
    if (!next.has_value() && rdv_deferred_ == 0) break;
    absl::Duration wait =
        next.has_value() ? absl::FromChrono(*next - now) : absl::Hours(1);
    auto woken = rdv_wake_.WaitFor(std::max(wait, absl::ZeroDuration()));
    (void)co_await std::move(woken);
  }
  rdv_watch_running_ = false;
}

bool ConnectionImpl::OnDone(const WireHeader& h) {
  for (auto it = incoming_.begin(); it != incoming_.end(); ++it) {
    if (!it->ready && it->large != nullptr && it->cookie == h.cookie) {
      if (h.flags & kFlagAborted) {
        HoldRendezvous(-static_cast<int64_t>(Pinned(it->size)));
        delete it->large;
        incoming_.erase(it);
      } else {
        it->ready = true;
      }
      Pump();
      GrantDeferred();
      return true;
    }
    if (it->deferred && it->cookie == h.cookie) {
      Protocol(absl::StrFormat("DONE for rendezvous %d before its CTS",
                               h.cookie));
      return false;
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
  GrantDeferred();
  MaybeSendCredits();
}

}  // namespace coverbs::cm::internal

namespace coverbs::cm {

uint64_t Worker::exposures_refused() const {
  return shared_->exposures_refused.load(std::memory_order_relaxed);
}

Worker::RendezvousUsage Worker::rendezvous_usage() const {
  RendezvousUsage u;
  const internal::WorkerShared& w = *shared_;
  if (w.large_memory != nullptr) {
    u.in_use_bytes = w.large_memory->in_use_bytes();
    u.idle_bytes = w.large_memory->idle_bytes();
  }
  u.deferred = w.rendezvous_deferred.load(std::memory_order_relaxed);
  u.budget_violations =
      w.rendezvous_budget_violations.load(std::memory_order_relaxed);
  u.done_timeouts = w.rendezvous_done_timeouts.load(std::memory_order_relaxed);
  u.held_bytes = w.rdv_held_now.load(std::memory_order_relaxed);
  u.held_bytes_peak = w.rdv_held_peak.load(std::memory_order_relaxed);
  u.deferred_by_worker =
      w.rendezvous_deferred_by_worker.load(std::memory_order_relaxed);
  return u;
}

}  // namespace coverbs::cm
