// The connection core: set-up (receive ring or SRQ promises, atomics
// buffers, the handshake), start, failure and teardown.
#include "cm/connection_impl.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/page_memory.h"
#include "cm/worker_shared.h"
#include "core/log.h"
#include "core/timeout.h"
#include "transport/cm_trace.h"
#include "transport/errors.h"

namespace coverbs::cm {

const char* CloseCauseName(CloseCause c) {
  switch (c) {
    case CloseCause::kNone:
      return "up";
    case CloseCause::kPeerClosed:
      return "closed by the peer";
    case CloseCause::kLocalClose:
      return "closed locally";
    case CloseCause::kPeerGone:
      return "peer gone";
    case CloseCause::kPeerUnreachable:
      return "peer unreachable (transport retries exhausted)";
    case CloseCause::kKeepalive:
      return "keepalive unanswered";
    case CloseCause::kProtectionError:
      return "protection error on this connection";
    case CloseCause::kProtocolViolation:
      return "protocol violation by the peer";
    case CloseCause::kTransportError:
      return "transport error";
    case CloseCause::kLocalError:
      return "local error";
  }
  return "?";
}

}  // namespace coverbs::cm

namespace coverbs::cm::internal {

uint64_t NextConnectionId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

CloseCause CauseOfWc(const absl::Status& s) {
  std::optional<ibv_wc_status> wc = transport::WcStatusOf(s);
  if (!wc.has_value()) return CloseCause::kLocalError;
  return CauseOfWcStatus(*wc);
}

CloseCause CauseOfWcStatus(ibv_wc_status wc) {
  switch (wc) {
    case IBV_WC_SUCCESS:
      return CloseCause::kLocalError;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return CloseCause::kPeerUnreachable;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_MW_BIND_ERR:
    case IBV_WC_REM_INV_RD_REQ_ERR:
      return CloseCause::kProtectionError;
    case IBV_WC_WR_FLUSH_ERR:
      // Flushed with no other reason known here: the QP went to error
      // under us, which (no local close, no goodbye) is the link ending.
      return CloseCause::kPeerGone;
    default:
      return CloseCause::kTransportError;
  }
}

absl::Status ConnectionImpl::InitSrq() {
  auto pool = SrqPool::For(ctx_);
  if (!pool.ok()) {
    return absl::Status(pool.status().code(),
                        absl::StrCat(name_, ": ", pool.status().message()));
  }
  // Buffers smaller than our rendezvous_threshold are fine: the handshake
  // announces their size, and the peer sends what does not fit by WRITE.
  // At least 2: a rendezvous takes the credit of its RTS and, in the same
  // turn, the one its DONE will spend; a window of 1 never holds both, the
  // RTS is never sent, and the window never grows (it grows when a message
  // says it spent the sender's last credit) -- the sender waits forever.
  if (options_.srq_initial_credits < 2 ||
      options_.srq_initial_credits > options_.recv_credits) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": srq_initial_credits must be in [2, recv_credits = ",
        options_.recv_credits, "], got ", options_.srq_initial_credits));
  }
  absl::Status s = (*pool)->Reserve(
      options_.srq_initial_credits + kCreditReserve + kCtsReserve,
      (*pool)->capacity, ctx_);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name_, ": ", s.message()));
  }
  pool_ = *pool;
  pool_->conns[id_] = this;
  pool_->by_qp[qp_num_] = this;
  slot_size_ = pool_->slot_size;
  initial_credits_ = options_.srq_initial_credits;
  return absl::OkStatus();
}

absl::Status ConnectionImpl::Init() {
  SharedOf(ctx_).qp_events->Track(qp_num_);
  if (options_.rendezvous_threshold == 0 ||
      options_.rendezvous_threshold > (1u << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": rendezvous_threshold must be in [1, 1 MiB], got ",
        options_.rendezvous_threshold));
  }
  if (options_.recv_credits < 2 || options_.recv_credits > 16384) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": recv_credits must be in [2, 16384], got ",
                     options_.recv_credits));
  }
  if (options_.landing_buffers > kMaxGrantsHeld ||
      (options_.landing_buffers > 0 &&
       (options_.landing_buffer_size <= options_.rendezvous_threshold ||
        options_.landing_buffer_size > (64u << 20)))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: landing_buffers must be at most %d and landing_buffer_size "
        "above rendezvous_threshold (%d) and at most 64 MiB; got %d x %d",
        name_, kMaxGrantsHeld, options_.rendezvous_threshold,
        options_.landing_buffers, options_.landing_buffer_size));
  }
  landing_windows_ = options_.landing_windows && qp_->caps().memory_windows;
  if (options_.rendezvous_budget == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": rendezvous_budget must be at least 1 byte"));
  }
  if (options_.max_message_size == 0 ||
      options_.max_message_size > kMaxWireLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": max_message_size must be in [1, ",
                     kMaxWireLength, "], got ", options_.max_message_size));
  }
  if (options_.use_srq) {
    absl::Status s = InitSrq();
    if (!s.ok()) return s;
    outstanding_ = initial_credits_;
    return InitAtomics();
  }
  // The ring: recv_credits for messages plus kCreditReserve for credit
  // messages, which are consumed at once and never count as credits.
  ring_slots_ = options_.recv_credits + kCreditReserve + kCtsReserve;
  auto* ring = new RecvRing();
  ring->conn = this;
  ring->slot_size =
      (kHeaderSize + options_.rendezvous_threshold + 63) & ~size_t{63};
  ring->mem_size = ring->slot_size * ring_slots_;
  ring->mem = MapPages(ring->mem_size);
  if (ring->mem == nullptr) {
    delete ring;
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": cannot allocate the receive ring"));
  }
  auto mr =
      ctx_.pd().Register(ring->mem, ring->mem_size, IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) {
    delete ring;
    return absl::Status(mr.status().code(),
                        absl::StrCat(name_, ": registering the receive ring: ",
                                     mr.status().message()));
  }
  ring->mr = std::move(*mr);
  ring->slots.resize(ring_slots_);
  ring_ = ring;
  slot_size_ = ring->slot_size;
  initial_credits_ = options_.recv_credits;
  outstanding_ = initial_credits_;
  // An eighth of the ring per post call (ReturnSlot posts sooner when the
  // gathered credits would become due, so batching holds back no more
  // than the return threshold did before).
  refill_batch_ =
      std::clamp<uint32_t>(options_.recv_credits / 8, 1, kMaxRefill);
  for (uint32_t i = 0; i < ring_slots_; ++i) {
    RecvSlot& s = ring->slots[i];
    s.ring = ring;
    s.data = ring->mem + i * ring->slot_size;
    LocalBuffer b = ring->Buffer(s);
    absl::Status st = qp_->PostRecv(&s, std::span<const LocalBuffer>(&b, 1));
    if (!st.ok()) {
      return absl::Status(
          st.code(),
          absl::StrCat(name_, ": posting the receive ring: ", st.message()));
    }
  }
  return InitAtomics();
}

absl::Status ConnectionImpl::InitAtomics() {
  constexpr uint32_t kAtomicSlots = 16;
  atomic_mem_ = std::make_unique<uint64_t[]>(kAtomicSlots);
  auto amr =
      ctx_.pd().Register(atomic_mem_.get(), kAtomicSlots * sizeof(uint64_t),
                         IBV_ACCESS_LOCAL_WRITE);
  if (!amr.ok()) return amr.status();
  atomic_mr_ = std::move(*amr);
  for (uint32_t i = 0; i < kAtomicSlots; ++i) atomic_free_.push_back(i);
  atomic_slots_.Release(kAtomicSlots);
  return absl::OkStatus();
}

Handshake ConnectionImpl::LocalHandshake() const {
  Handshake h;
  h.credits = initial_credits_;
  h.max_credits = options_.recv_credits;
  h.recv_buffer_size = static_cast<uint32_t>(slot_size_);
  h.max_message_size = options_.max_message_size;
  const transport::DeviceCaps& caps = qp_->caps();
  if (caps.write_with_imm) h.caps |= kCapWriteWithImm;
  if (caps.atomics) h.caps |= kCapAtomics;
  return h;
}

absl::Status ConnectionImpl::Start(
    PeerInfo peer, std::unique_ptr<transport::ConnectionLink> link) {
  peer_ = std::move(peer);
  link_ = std::move(link);
  if (link_ != nullptr) {
    name_ = absl::StrFormat("conn %d (%s, qp 0x%x)", id_, link_->Describe(),
                            qp_->qp_num());
  }
  const Handshake& h = peer_.handshake;
  if (h.credits == 0 || h.credits > 16384) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": peer announced ", h.credits, " credits"));
  }
  // Our eager messages must fit the peer's receive buffers: a peer with
  // smaller ones (a server saving memory per connection) gets the larger
  // messages by WRITE instead (landing buffers or the rendezvous).
  eager_max_ = std::min<size_t>(options_.rendezvous_threshold,
                                h.recv_buffer_size - kHeaderSize);
  peer_max_ = std::min<uint64_t>(h.max_message_size, options_.max_message_size);
  use_imm_ = (h.caps & kCapWriteWithImm) && qp_->caps().write_with_imm;
  credits_.Release(h.credits);
  started_ = true;
  started_event_.Set();
  if (link_ != nullptr) {
    std::weak_ptr<ConnectionImpl> weak = weak_from_this();
    link_->OnDown([weak](absl::Status why) {
      std::shared_ptr<ConnectionImpl> self = weak.lock();
      if (self == nullptr) return;
      // The rdma_cm event can overtake completions already in the CQ (on
      // iWARP the peer's last messages and its GOODBYE arrive before the
      // FIN that raised DISCONNECTED): take them first, so that messages
      // sent before the peer closed are delivered, not lost.
      if (self->status_.ok() && !self->qp_->in_error()) {
        for (int i = 0; i < 64 && self->qp_->PollCompletions() > 0; ++i) {
        }
      }
      if (self->peer_closed_) {
        self->Fail(CloseCause::kPeerClosed,
                   absl::UnavailableError("closed by the peer"));
      } else {
        // The link went down without the peer's goodbye (rdma_cm
        // DISCONNECTED, DEVICE_REMOVAL, a fatal QP event).
        self->Fail(CloseCause::kPeerGone, std::move(why));
      }
    });
  }
  // The active side says hello at once (protocol 4): the passive side's
  // accept waits for it, so a peer that connects and then says nothing is
  // dropped. iWARP also needs it: the active side must speak first, and
  // there the passive side holds its sends until anything arrived.
  if (!qp_->caps().active_side_sends_first || active_) {
    may_send_.Set();
  }
  if (active_) SpawnInternal(SendControl(kHello, 0, 0, {}));
  if (options_.keepalive_interval > absl::ZeroDuration()) {
    SpawnInternal(KeepaliveLoop());
  }
  // Messages can arrive before we start: on the passive side the peer's
  // hello often overtakes our ESTABLISHED event. Their credits were owed
  // while credit messages could not go out yet; send them now, or a peer
  // with a small window (an SRQ connection starts with 2, and a rendezvous
  // needs both) waits for them forever.
  MaybeSendCredits();
  return absl::OkStatus();
}

absl::Status ConnectionImpl::CheckUp(const char* what) const {
  if (!status_.ok()) return DownError(what);
  if (closing_) {
    return absl::UnavailableError(
        absl::StrCat(what, " on ", name_, ": the connection is closing"));
  }
  if (!started_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " on ", name_, ": not connected yet"));
  }
  return absl::OkStatus();
}

absl::Status ConnectionImpl::DownError(const char* op) const {
  // The connection's reason as it is (its cause in words first), then which
  // operation and connection met it.
  return absl::Status(status_.code(), absl::StrCat(status_.message(), " (", op,
                                                   " on ", name_, ")"));
}

absl::Status ConnectionImpl::OpError(const char* op, const absl::Status& s) {
  // A flushed operation, or one failed because the QP was already in error,
  // tells nothing new; anything else is this operation's own failure.
  const bool consequence = absl::StrContains(s.message(), "WR_FLUSH_ERR") ||
                           absl::StrContains(s.message(), "error state") ||
                           absl::StrContains(s.message(), "was destroyed");
  if (!consequence && status_.ok() && transport::WcStatusOf(s).has_value()) {
    // The operation's own completion failed (not a registration or a
    // buffer that could not be had): the reliable QP is in the error state
    // now, so the connection is down. It says so at once, with this
    // reason, instead of when a flushed receive reports it later.
    Fail(CauseOfWc(s),
         absl::Status(s.code(), absl::StrCat(op, " failed: ", s.message())));
  }
  if (!s.ok() && !consequence) {
    if (status_is_flush_ && transport::WcStatusOf(s).has_value()) {
      // The flush that took the connection down came from this failure:
      // it is the cause. Only a failed work request can be: a caller's
      // cancellation (its deadline: "semaphore acquire cancelled") or a
      // buffer it could not get says nothing of why the QP failed, and
      // must never stand as the connection's cause.
      cause_ = CauseOfWc(s);
      status_ =
          absl::Status(s.code(), absl::StrCat(CloseCauseName(cause_), ": ", op,
                                              " failed: ", s.message()));
      status_is_flush_ = false;
    }
    // This operation's failure took the connection down: its cause first.
    if (!status_.ok() && transport::WcStatusOf(s).has_value()) {
      return absl::Status(s.code(),
                          absl::StrCat(CloseCauseName(cause_), ": ", op, " on ",
                                       name_, ": ", s.message()));
    }
    return absl::Status(s.code(),
                        absl::StrCat(op, " on ", name_, ": ", s.message()));
  }
  if (!status_.ok()) return DownError(op);
  return absl::Status(s.code(),
                      absl::StrCat(op, " on ", name_, ": ", s.message()));
}

void ConnectionImpl::SpawnInternal(Task<void> t) {
  tasks_.Add();
  auto keep = [](std::shared_ptr<ConnectionImpl> self,
                 Task<void> t) -> Task<void> {
    co_await std::move(t);
    self->tasks_.Done();
  };
  ctx_.reactor().Spawn(keep(shared_from_this(), std::move(t)));
}

void ConnectionImpl::Fail(absl::Status why) { Fail(CauseOfWc(why), why); }

void ConnectionImpl::Fail(CloseCause cause, absl::Status why) {
  if (!status_.ok()) return;
  COVERBS_CM_TRACE(name_, ": down: ", why.ToString());
  if (goodbye_sent_ && (cause == CloseCause::kPeerGone ||
                        cause == CloseCause::kTransportError)) {
    // Our goodbye went out: the peer may tear the link down before Close
    // gets to mark itself closing, and its flush is no news.
    cause = CloseCause::kLocalClose;
    why = absl::UnavailableError("closed locally");
  } else if (peer_closed_ && (cause == CloseCause::kPeerGone ||
                              cause == CloseCause::kPeerUnreachable ||
                              cause == CloseCause::kKeepalive ||
                              cause == CloseCause::kTransportError)) {
    // The peer said goodbye: losing it afterwards is no news either.
    cause = CloseCause::kPeerClosed;
    why = absl::UnavailableError("closed by the peer");
  }
  if (cause == CloseCause::kPeerGone) CauseFromQpEvent(&cause, &why);
  const char* words = CloseCauseName(cause);
  cause_ = cause;
  // The cause in words first; the detail (verbs status, what failed) after,
  // unless it says no more than the words.
  if (why.message() == words) {
    status_ = std::move(why);
  } else {
    status_ =
        absl::Status(why.code(), absl::StrCat(words, ": ", why.message()));
    why.ForEachPayload([this](absl::string_view url, const absl::Cord& p) {
      status_.SetPayload(url, p);
    });
  }
  LogClose();
  // Stop posting at once (siw never completes WRs posted after a peer
  // TERMINATE) and flush what is posted.
  if (!qp_->in_error())
    qp_->SetError(std::string(status_.message())).IgnoreError();
  if (link_ != nullptr) link_->Disconnect();
  // Wake every waiter; they see status_.
  may_send_.Set();
  started_event_.Set();
  peer_spoke_.Set();
  keepalive_wake_.Set();
  credits_.Release(1 << 24);
  ready_count_.Release(1 << 24);
  rts_window_.Release(1 << 24);
  for (PendingRts* pr : pending_rts_) pr->cts.Set();
  pending_rts_.clear();
  // Landing buffers granted to the peer: the QP is in error, so nothing
  // writes them any more; deregistering ends their rkeys.
  for (LargeBuffer* lb : granted_) delete lb;
  granted_.clear();
  grants_unsent_ = 0;
  grants_.clear();
  // Rendezvous that will never finish (the QP is in the error state: the
  // peer writes their buffers no more), and requests never answered.
  rdv_wake_.Set();
  rdv_deferred_ = 0;
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    if (!it->ready) {
      if (it->large != nullptr) {
        HoldRendezvous(-static_cast<int64_t>(Pinned(it->size)));
      }
      delete it->large;
      it = incoming_.erase(it);
    } else {
      ++it;
    }
  }
}

void ConnectionImpl::CauseFromQpEvent(CloseCause* cause, absl::Status* why) {
  // Our QP failed with nothing known here: no failed completion of ours, no
  // goodbye. If the peer broke it -- a READ or WRITE with a bad key, range
  // or right, refused by our QP as the responder -- the device raised an
  // asynchronous event naming the QP before it flushed anything (verbs
  // moves the QP to error and reports it; soft queues the event before its
  // flushes). That event is on the device's event fd, but maybe not read
  // yet: the flush and the event come through different fds, and the
  // reactor may see the flush first. ErrorOf therefore reads the pending
  // events now, under the table's lock, before deciding. So the answer
  // depends on what the device did, not on which fd the reactor served
  // first: the same scenario gives the same cause. (Waiting a while for an
  // event that may never come would delay every real "peer gone" and
  // still race a late device.)
  std::optional<transport::AsyncEvent> ev =
      SharedOf(ctx_).qp_events->ErrorOf(qp_num_);
  if (!ev.has_value()) return;
  // IBV_EVENT_QP_ACCESS_ERR is the verbs name for it; siw (Linux 6.1)
  // raises IBV_EVENT_QP_REQ_ERR ("invalid request") for the same bad key
  // (cm/README.md). Either way our QP refused a request of the peer and our
  // own protocol is intact: a protection error, the event's name in the
  // detail, never the (rate-limited) protocol violation of cm's framing.
  *cause = CloseCause::kProtectionError;
  *why = absl::PermissionDeniedError(absl::StrCat(
      "the peer's request failed on our QP: ",
      transport::AsyncEventName(ev->type), " (", ev->description, "); ",
      why->message()));
}

void ConnectionImpl::LogClose() const {
  // A close the application or its peer asked for is news at info level; a
  // fault is a warning. A peer breaking the protocol may do so on purpose
  // and over and over: those lines are rate-limited (as refusals are).
  if (cause_ == CloseCause::kProtocolViolation) {
    static LogLimiter limiter(absl::Seconds(1));
    if (!LogEnabled(LogLevel::kWarning)) return;
    uint64_t suppressed = 0;
    if (!limiter.Allow(&suppressed)) return;
    COVERBS_LOG(kWarning, "cm", "%s (%s) closed: %s%s", name_, peer_.address,
                status_.message(),
                suppressed > 0
                    ? absl::StrFormat(" (and %d more like it)", suppressed)
                    : std::string());
    return;
  }
  const bool asked =
      cause_ == CloseCause::kPeerClosed || cause_ == CloseCause::kLocalClose;
  if (asked) {
    COVERBS_LOG(kInfo, "cm", "%s (%s) closed: %s", name_, peer_.address,
                status_.message());
  } else {
    COVERBS_LOG(kWarning, "cm", "%s (%s) closed: %s", name_, peer_.address,
                status_.message());
  }
}

void ConnectionImpl::Abort(absl::Status why) {
  // The owner let go of the connection without closing it.
  Fail(CloseCause::kLocalClose, std::move(why));
  if (detached_) return;  // the Worker took the QP already
  // The owner is gone, so nobody will Close: internal tasks still waiting
  // for their work requests keep this connection (and its QP on the
  // Worker's CQ) alive until the flushes come, which on siw after a peer
  // TERMINATE is never. Destroying the QP now ends the NIC's access and
  // completes them, so the connection goes before its Worker can.
  if (qp_->outstanding() > 0) {
    COVERBS_CM_TRACE(name_, ": destroyed with ", qp_->outstanding(),
                     " WRs posted; abandoning the QP");
    qp_->Abandon("the connection was destroyed");
  }
}

Task<absl::Status> ConnectionImpl::WaitPeerSpoke(absl::Time deadline) {
  if (!peer_spoke_.is_set()) {
    absl::Duration left = deadline - absl::Now();
    absl::Status s = absl::DeadlineExceededError("no time left");
    if (left > absl::ZeroDuration()) {
      auto waiting = peer_spoke_.WaitFor(left);
      s = co_await std::move(waiting);
    }
    if (!s.ok() && status_.ok()) {
      if (s.code() == absl::StatusCode::kDeadlineExceeded) {
        co_return absl::DeadlineExceededError(absl::StrCat(
            name_,
            ": the peer sent nothing after the connection was established "
            "(accept deadline)"));
      }
      co_return absl::Status(s.code(), absl::StrCat(name_, ": ", s.message()));
    }
  }
  co_return status_;
}

namespace {

// Polls `done` every `step` until it holds or `until` passes. Not
// cancellable: the ambient stop token is swapped for an empty one, since
// under a stopped token each Sleep returned Cancelled at once and Close's
// waits spun the CPU until close_timeout.
template <typename Done>
Task<void> PollUnstoppable(Reactor& reactor, Done done, absl::Time until,
                           absl::Duration step) {
  std::stop_token ambient;  // empty: never stops
  co_await ::coverbs::internal::SwapStopToken{&ambient};
  while (!done() && absl::Now() < until) co_await reactor.Sleep(step);
  co_await ::coverbs::internal::SwapStopToken{&ambient};
}

}  // namespace

Task<absl::Status> ConnectionImpl::Close() {
  if (detached_) {
    // The Worker is gone and took the QP and the link: nothing is left to
    // tell the peer or to flush.
    closing_ = true;
    close_started_ = true;
    close_done_.Set();
    co_return absl::OkStatus();
  }
  if (close_started_) {
    // A second Close returns once the first is done (bounded, as it is), so
    // that its caller may then destroy the connection.
    co_return co_await close_done_.WaitFor(2 * options_.close_timeout +
                                           absl::Seconds(1));
  }
  close_started_ = true;
  absl::Duration t = options_.close_timeout;
  // The Worker may be destroyed while this runs (ShutdownConnections waits
  // for a Close under way, bounded): each step after a suspension checks
  // detached_, and the reactor -- which outlives the Worker -- is taken now.
  Reactor& reactor = ctx_.reactor();
  COVERBS_CM_TRACE(name_, ": Close: status ", status_.ToString(),
                   ", peer_closed ", peer_closed_, ", outstanding WRs ",
                   qp_->outstanding());
  if (status_.ok() && qp_->inline_sends_in_flight() > 0) {
    // Small messages sent inline completed at their post; Close delivers
    // them (the peer acknowledges) before anything below can flush them,
    // even for a cancelled caller -- the goodbye below would be skipped.
    // Bounded by close_timeout: a peer that acknowledges nothing loses them.
    auto delivered = [this] {
      return !status_.ok() || qp_->inline_sends_in_flight() == 0;
    };
    co_await PollUnstoppable(reactor, delivered, absl::Now() + t,
                             absl::Microseconds(200));
  }
  if (detached_) {
    close_done_.Set();
    co_return absl::OkStatus();
  }
  if (status_.ok() && started_ && !peer_closed_) {
    // Goodbye first, so the peer reports "closed by the peer", not a loss.
    auto bye = [](ConnectionImpl* self) -> Task<absl::Status> {
      co_await self->SendControl(kGoodbye, 0, 0, {});
      co_return absl::OkStatus();
    };
    goodbye_sent_ = true;
    absl::Status s = co_await WithTimeout(bye(this), t);
    (void)s;  // a peer that cannot take it is gone anyway
  }
  closing_ = true;
  if (detached_) {
    close_done_.Set();
    co_return absl::OkStatus();
  }
  // No-op if already down. After the peer's goodbye, ours is no news: it
  // was the peer that closed (whether its flush came first or not).
  if (peer_closed_) {
    Fail(CloseCause::kPeerClosed, absl::UnavailableError("closed by the peer"));
  } else {
    Fail(CloseCause::kLocalClose, absl::UnavailableError("closed locally"));
  }
  exposures_.clear();  // their tokens end with the connection
  exposed_bytes_ = 0;
  absl::Status result;
  if (link_ != nullptr) {
    link_->Disconnect();
    absl::Status s = co_await link_->WaitDown(t);
    if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) result = s;
  }
  if (detached_) {
    close_done_.Set();
    co_return result;
  }
  // Every posted work request completes (flushed) before the buffers go;
  // a device that lost some (siw after the peer's TERMINATE) gets its QP
  // destroyed, which also ends the NIC's access, and the rest completed.
  qp_->SetError("closed").IgnoreError();
  // Not cancellable: the buffers must outlive the NIC's use of them.
  auto flushed = [this] { return detached_ || qp_->outstanding() == 0; };
  co_await PollUnstoppable(reactor, flushed, absl::Now() + t,
                           absl::Milliseconds(1));
  if (!detached_ && qp_->outstanding() > 0) {
    COVERBS_CM_TRACE(name_, ": Close: ", qp_->outstanding(),
                     " WRs never flushed; abandoning the QP");
    qp_->Abandon("close: the device did not flush every work request");
  }
  absl::Status s;
  // Internal control sends hold the connection alive; they have all been
  // woken or flushed by now.
  s = co_await WithTimeout(
      [](WaitGroup& wg) -> Task<absl::Status> {
        co_return co_await wg.Wait();
      }(tasks_),
      t);
  if (!s.ok() && result.ok()) result = s;
  COVERBS_CM_TRACE(name_, ": Close done: ", result.ToString());
  close_done_.Set();
  co_return result;
}

void ConnectionImpl::ShutdownForWorker() {
  // Down, and the QP in the error state: its posted work requests complete
  // as flushed while ShutdownConnections runs the loop, and the QP goes
  // once they did (TeardownBusy) -- as Close does it. Destroying it with
  // work requests still posted (Abandon) is left to DetachFromWorker, for
  // a device that never flushes or a Worker destroyed inside its loop: on
  // the soft provider, a QP destroyed while its error was still being
  // processed could leave its socket open (the peer saw no end).
  Fail(CloseCause::kLocalClose,
       absl::UnavailableError("the cm::Worker was destroyed"));
}

bool ConnectionImpl::TeardownBusy() const {
  return (close_started_ && !close_done_.is_set()) || tasks_.count() > 0 ||
         (qp_ != nullptr && qp_->outstanding() > 0);
}

void ConnectionImpl::DetachFromWorker() {
  if (detached_) return;
  if (status_.ok()) ShutdownForWorker();
  // What lives in the Worker's PD goes before the PD: exposures (window,
  // then its registration), idle landing windows, the atomics buffer.
  exposures_.clear();
  exposed_bytes_ = 0;
  free_windows_.clear();
  atomic_mr_.Deregister();
  // Messages not handed out give their receive buffers back to the ring or
  // the SRQ pool while those are still ours.
  for (Incoming& in : incoming_) delete in.large;
  incoming_.clear();
  ready_.clear();
  SharedOf(ctx_).qp_events->Forget(qp_num_);
  if (qp_ != nullptr && qp_->outstanding() > 0) {
    qp_->Abandon("the cm::Worker was destroyed");
  }
  qp_.reset();
  link_.reset();
  if (ring_ != nullptr) {
    // Messages the application still holds keep the ring (and its
    // registration) until they go, as after any connection's end.
    ring_->conn = nullptr;
    ring_->MaybeDelete();
    ring_ = nullptr;
  }
  if (pool_ != nullptr) {
    pool_->conns.erase(id_);
    auto it = pool_->by_qp.find(qp_num_);
    if (it != pool_->by_qp.end() && it->second == this) pool_->by_qp.erase(it);
    pool_->committed -=
        outstanding_ + to_return_ + kCreditReserve + kCtsReserve;
    pool_ = nullptr;
  }
  send_pool_ = nullptr;
  staging_pool_ = nullptr;
  // What this connection held leaves the Worker's rendezvous count.
  HoldRendezvous(-static_cast<int64_t>(rdv_held_));
  detached_ = true;
  SharedOf(ctx_).connections.erase(this);
}

// Runs once the Connection and every internal task are gone.
ConnectionImpl::~ConnectionImpl() {
  if (status_.ok()) {
    Fail(CloseCause::kLocalClose,
         absl::UnavailableError("the connection was destroyed"));
  }
  if (detached_) return;  // DetachFromWorker released the rest
  HoldRendezvous(-static_cast<int64_t>(rdv_held_));
  SharedOf(ctx_).connections.erase(this);
  // Before the QP goes: its number may serve a new QP at once.
  SharedOf(ctx_).qp_events->Forget(qp_num_);
  qp_.reset();  // drains (bounded) before freeing what the NIC may touch
  link_.reset();
  for (Incoming& in : incoming_) delete in.large;
  incoming_.clear();
  ready_.clear();
  if (ring_ != nullptr) {
    ring_->conn = nullptr;
    ring_->MaybeDelete();
  }
  if (pool_ != nullptr) {
    // Held messages return their buffers to the pool, not to us.
    pool_->conns.erase(id_);
    auto it = pool_->by_qp.find(qp_num_);
    if (it != pool_->by_qp.end() && it->second == this) pool_->by_qp.erase(it);
    pool_->committed -=
        outstanding_ + to_return_ + kCreditReserve + kCtsReserve;
  }
  ScheduleCqTrim(ctx_);
}

}  // namespace coverbs::cm::internal
