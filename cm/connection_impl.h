// Internal: the state of one Connection. Its methods live in one file per
// concept: connection_impl.cc (set-up, start, failure, teardown), send.cc
// (the send turn, eager and control messages), credits.cc (the credit
// window), receive.cc (completions of receives, delivery), rendezvous.cc
// (large messages), landing.cc (medium messages into granted buffers),
// one_sided.cc (RDMA READ / WRITE / atomics).
#ifndef COVERBS_CM_CONNECTION_IMPL_H_
#define COVERBS_CM_CONNECTION_IMPL_H_

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cm/connection.h"
#include "cm/handshake.h"
#include "cm/recv_buffers.h"
#include "cm/srq_pool.h"
#include "cm/wire.h"
#include "cm/worker.h"
#include "cm/worker_shared.h"
#include "core/frame_pool.h"
#include "core/sync.h"
#include "core/task.h"
#include "transport/connection_link.h"
#include "transport/memory.h"
#include "transport/queue_pair.h"

namespace coverbs::cm::internal {

static_assert(std::endian::native == std::endian::little,
              "the cm wire format is little endian; add byte swaps");

// A received message waiting to be handed out in arrival order; a
// rendezvous entry is not ready until its DONE arrived.
struct Incoming {
  Message msg;
  bool ready = false;
  // A rendezvous request whose CTS waits for the budget (rendezvous.cc):
  // no buffer yet (`large` is null), `size` bytes announced.
  bool deferred = false;
  uint32_t cookie = 0;
  LargeBuffer* large = nullptr;
  uint32_t size = 0;  // rendezvous: the announced size
  // Granted rendezvous: its DONE must have come by then
  // (ConnectionOptions::rendezvous_done_timeout).
  SteadyTime done_by{};
  // A landed message: its block's bytes, held against the rendezvous
  // budgets until Recv takes it.
  uint64_t landed_bytes = 0;
};

// The deliverable messages, in arrival order: a ring that doubles when
// full. (std::deque's push_back and pop_front, out of line, were ~45
// instructions per received message.)
class MessageQueue {
 public:
  bool empty() const { return head_ == tail_; }
  // Inline: once per message received (gcc made it a call of its own).
  [[gnu::always_inline]] void push_back(Message&& m) {
    if (tail_ - head_ == buf_.size()) [[unlikely]] Grow();
    buf_[tail_++ & (buf_.size() - 1)] = std::move(m);
  }
  // Only when !empty().
  Message pop_front() { return std::move(buf_[head_++ & (buf_.size() - 1)]); }
  void clear() {
    while (!empty()) pop_front();
  }
  // Messages ever pushed and popped: the i-th pushed (from 0) has been
  // taken once popped() > i (the rendezvous budget learns this way which
  // large messages Recv took, without a step on the pop).
  uint64_t pushed() const { return tail_; }
  uint64_t popped() const { return head_; }

 private:
  [[gnu::noinline]] void Grow() {
    // Keeps head_ and tail_ (pushed/popped count on): each message moves
    // to its index's slot in the bigger ring.
    std::vector<Message> bigger(std::max<size_t>(16, buf_.size() * 2));
    for (uint64_t i = head_; i != tail_; ++i) {
      bigger[i & (bigger.size() - 1)] =
          std::move(buf_[i & (buf_.size() - 1)]);
    }
    buf_ = std::move(bigger);
  }
  std::vector<Message> buf_;  // a power of two long (or empty)
  uint64_t head_ = 0;         // next to pop; both count up, index & mask
  uint64_t tail_ = 0;
};

// A large Send waiting for the receiver's CTS.
struct PendingRts {
  uint32_t cookie = 0;
  Event cts;
  bool granted = false;
  bool refused = false;
  uint64_t addr = 0;
  uint32_t rkey = 0;
};

// Copies `parts` one after the other to `dst`; returns the bytes copied.
[[gnu::always_inline]] inline size_t CopyParts(
    std::byte* dst, std::span<const std::span<const std::byte>> parts) {
  size_t off = 0;
  for (auto p : parts) {
    if (!p.empty()) std::memcpy(dst + off, p.data(), p.size());
    off += p.size();
  }
  return off;
}

// Connection ids are unique in the process (logs and errors name them),
// not per Worker.
uint64_t NextConnectionId();
// The cause a failed work request's verbs status (in `s`) stands for.
CloseCause CauseOfWc(const absl::Status& s);
CloseCause CauseOfWcStatus(ibv_wc_status wc);

// A landed message that SendAwaiter posted without a coroutine
// (TryStartLanded): its WRITE and header, and the staging buffer the WRITE
// reads, held until the send completes. From the frame pool: one per
// landed Send.
struct LandedSend {
  transport::SendBatch batch;
  std::optional<transport::BufferPool::Buffer> staging;
  static void* operator new(size_t n) {
    return coverbs::internal::AllocFrame(n);
  }
  static void operator delete(void* p, size_t n) noexcept {
    coverbs::internal::FreeFrame(p, n);
  }
};

class ConnectionImpl : public std::enable_shared_from_this<ConnectionImpl> {
 public:
  ConnectionImpl(Worker& ctx, std::unique_ptr<transport::QueuePair> qp,
                 const ConnectionOptions& o, bool active)
      : ctx_(ctx), qp_(std::move(qp)), options_(o), active_(active) {
    id_ = NextConnectionId();
    qp_num_ = qp_->qp_num();
    name_ = absl::StrFormat("conn %d (qp 0x%x)", id_, qp_->qp_num());
    SharedOf(ctx_).connections.insert(this);
  }
  ~ConnectionImpl();

  absl::Status Init();
  absl::Status Start(PeerInfo peer,
                     std::unique_ptr<transport::ConnectionLink> link);
  // What this side can receive (Init must have run), for the handshake.
  Handshake LocalHandshake() const;
  // What was sent to the peer, for Connection::local_handshake().
  void set_local_handshake(Handshake h) { local_ = std::move(h); }
  const Handshake& local_handshake() const { return local_; }

  Task<absl::Status> SendParts(std::span<const std::span<const std::byte>> p);
  Task<absl::Status> SendRegistered(LocalBuffer b);
  // A deliverable message if one is there and no Recv waits ahead of the
  // caller (TryAcquire fails then).
  std::optional<Message> TryRecv() {
    if (ready_.empty() || !ready_count_.TryAcquire(1)) return std::nullopt;
    return ready_.pop_front();
  }
  Task<absl::Status> OneSided(bool read, LocalBuffer local, RemoteRegion r);
  // On plain memory: registers it through the Worker's cache first.
  Task<absl::Status> OneSidedPlain(bool read, const std::byte* data,
                                   size_t length, RemoteRegion r);
  Task<absl::StatusOr<uint64_t>> Atomic(bool cas, RemoteRegion r, uint64_t a,
                                        uint64_t b);
  // The exposure with `rkey` releases `owner` after its window
  // (Connection::ExposeOwned, right after the exposure was made: the
  // newest, so the search starts there).
  void KeepWithExposure(uint32_t rkey, std::shared_ptr<void> owner) {
    for (auto it = exposures_.rbegin(); it != exposures_.rend(); ++it) {
      if ((*it)->rkey == rkey) {
        (*it)->owner = std::move(owner);
        return;
      }
    }
  }
  // Connection::Expose (ExposeScope::kConnection) and Revoke (one_sided.cc).
  absl::StatusOr<RemoteRegion> ExposeWindow(const MemoryRegion& mr, int access,
                                            size_t offset, size_t length);
  absl::Status Revoke(const RemoteRegion& token);
  Task<absl::Status> Close();
  void Abort(absl::Status why);
  // The Worker is being destroyed (ShutdownConnections): down with that
  // reason, the QP destroyed and every waiter woken.
  void ShutdownForWorker();
  // Whether teardown work of this connection still runs on the reactor: a
  // Close under way, internal sends, work requests not yet completed.
  bool TeardownBusy() const;
  // Last step of the Worker's destruction for a connection somebody still
  // holds: releases everything the Worker provided (QP, link, receive ring
  // or SRQ share, registrations, windows) now, and from then on refers to
  // the Worker no more. The connection stays valid and down: its status,
  // cause and name remain; operations fail with its status, Close returns
  // at once, worker() and qp() must not be used.
  void DetachFromWorker();
  // Until the peer's first message arrived (its kHello), at most until
  // `deadline`: DeadlineExceeded if it said nothing, the connection's error
  // if it failed meanwhile.
  Task<absl::Status> WaitPeerSpoke(absl::Time deadline);
  // Keepalive (keepalive.cc): the probe loop, and one credit message with
  // `flags` (kFlagPing for a probe, 0 for the answer).
  Task<void> KeepaliveLoop();
  Task<void> SendKeepalive(uint8_t flags);

  absl::Status status() const { return status_; }
  CloseCause close_cause() const { return cause_; }
  const PeerInfo& peer() const { return peer_; }
  Worker& worker() const { return ctx_; }
  transport::QueuePair& qp() const { return *qp_; }
  const std::string& name() const { return name_; }
  Connection::Stats stats() const {
    Connection::Stats st = stats_;
    st.recv_window = RecvWindow();
    st.recv_window_peak = std::max(window_peak_, st.recv_window);
    st.rendezvous_bytes_held = RendezvousHeld();
    st.exposures = exposures_.size();
    st.exposed_bytes = exposed_bytes_;
    return st;
  }
  const ConnectionOptions& options() const { return options_; }

  void OnRecv(RecvSlot* slot, const ibv_wc& wc);
  void ReturnSlot(RecvSlot* slot);
  // OnRecv and ReturnSlot's bodies: always inlined into RecvSlot::OnRecv
  // and RecvSlot::Release (once per message received; a call layer each).
  void OnRecvBody(RecvSlot* slot, const ibv_wc& wc);
  void ReturnSlotBody(RecvSlot* slot);
  // Ring mode: posts the slots gathered by ReturnSlot and owes the peer
  // their credits; on failure the connection is failed (false).
  bool FlushRefill();
  // Posts `slot` again; on failure the connection is failed (false).
  bool Repost(RecvSlot* slot);

 private:
  friend class ConnectionTestPeer;
  friend class cm::Connection::SendAwaiter;  // SendSmall's path, frameless
  friend class cm::Connection;               // TrySendNow
  friend class cm::Connection::RecvAwaiter;  // Recv, frameless
  // Why a Recv that finds no message ends: down, closing, not started, or
  // closed by the peer with nothing left to deliver.
  absl::Status RecvError() const;
  // Sends one small message (header + parts copied into a pooled buffer)
  // of `total` payload bytes (the parts' and zero_copy's together).
  Task<absl::Status> SendSmall(
      MsgType type, uint32_t cookie,
      std::span<const std::span<const std::byte>> p, size_t total,
      std::optional<LocalBuffer> zero_copy = std::nullopt);
  // SendRegistered above the eager limit (holds `b` for SendBig).
  Task<absl::Status> SendRegisteredBig(LocalBuffer b);
  // Above the eager limit: takes the send turn, then writes into a landing
  // buffer the peer granted if one fits (BuildLanded), else the rendezvous
  // (SendLarge); both run in that turn, which keeps Send order.
  Task<absl::Status> SendBig(std::span<const std::span<const std::byte>> p,
                             const LocalBuffer* registered, uint64_t total);
  // Both hold the send turn and a credit from AcquireSend in `buf`.
  Task<absl::Status> SendLarge(std::span<const std::span<const std::byte>> p,
                               const LocalBuffer* registered,
                               transport::BufferPool::Buffer& buf);
  // SendAwaiter's landed fast path: when the message fits the oldest grant
  // and a staging buffer (unless `registered`), the send turn, a credit and
  // a header buffer (into `buf`) are all free now, takes them and builds
  // the message (BuildLanded); the caller releases the turn and posts the
  // batch. Null (nothing taken) otherwise: SendBig then waits for them.
  std::unique_ptr<LandedSend, LandedSendDeleter> TryStartLanded(
      std::span<const std::span<const std::byte>> parts,
      const LocalBuffer* registered, uint64_t total,
      std::optional<transport::BufferPool::Buffer>& buf);
  // Whether a message of `total` bytes fits the oldest grant we hold.
  bool FitsGrant(uint64_t total) const {
    return !grants_.empty() && total <= GrantBytes(grants_.front());
  }
  // A landed message's WRITE and header (the oldest grant, spent here):
  // the payload from `registered`, else `parts` copied into `staging`;
  // `buf` holds the header. The caller holds the send turn and a credit,
  // and posts `batch`.
  void BuildLanded(std::span<const std::span<const std::byte>> parts,
                   const LocalBuffer* registered, uint64_t total,
                   transport::BufferPool::Buffer* staging,
                   transport::BufferPool::Buffer& buf,
                   transport::SendBatch& batch);
  // Rendezvous, sender side (rendezvous.cc): the payload's SGEs (`regs`
  // holds the registrations made for them), the RTS together with the
  // credit its completion will need, the CTS, the WRITE(s) and DONE. Each
  // step gives that reserved credit back (Unreserve) when it fails.
  // Parts of at most kCopiedPartMax bytes are copied into `buf` (the RTS's
  // send buffer, from kStagingOffset on: past the RTS header, and kept
  // until the WRITEs completed) instead of being registered.
  static constexpr size_t kCopiedPartMax = 256;
  static constexpr size_t kStagingOffset = 64;
  absl::Status PayloadSges(std::span<const std::span<const std::byte>> parts,
                           const LocalBuffer* registered,
                           transport::BufferPool::Buffer& buf,
                           std::vector<MemoryRegion>& regs,
                           std::vector<LocalBuffer>& sges, uint64_t& total);
  Task<absl::Status> PostRts(PendingRts& pr, uint64_t total,
                             transport::BufferPool::Buffer& buf);
  Task<absl::Status> AwaitCts(PendingRts& pr, uint64_t total);
  Task<absl::Status> WriteRendezvous(const PendingRts& pr,
                                     std::span<const LocalBuffer> sges,
                                     uint64_t total);
  void Unreserve();
  // Receive completions by kind (receive.cc, rendezvous.cc). Those that
  // return bool return false when the message broke the protocol (the
  // connection has failed).
  void OnRecvFailed(const ibv_wc& wc);
  // Validates the header and takes its piggybacked credits and acks, and
  // the credit the message spent.
  bool TakeHeader(RecvSlot* slot, const ibv_wc& wc, WireHeader& h);
  // An internal message's receive is posted again at once.
  void Consume(RecvSlot* slot);
  void OnData(RecvSlot* slot, const WireHeader& h);
  bool OnRts(const WireHeader& h);
  bool OnCts(RecvSlot* slot, const WireHeader& h);
  bool OnDone(const WireHeader& h);
  void OnRendezvousImm(RecvSlot* slot, const ibv_wc& wc);
  // The rendezvous budget (ConnectionOptions::rendezvous_budget),
  // rendezvous.cc. rdv_held_ counts the bytes of the peer's large messages
  // from their grant until Recv takes them; those Pump put in ready_ are
  // listed in rdv_ready_ and leave the count lazily (SettleReady), once
  // ready_.popped() passed them -- so Recv's path has no step for it.
  void SettleReady();
  uint64_t RendezvousHeld() const;  // rdv_held_ less what Recv took
  // What entries of incoming_ from the oldest deferred request on hold
  // (0 with none deferred): not weighed against the budgets.
  uint64_t HeldBehindDeferred() const;
  // What a rendezvous of `size` bytes pins, and counts against the budget:
  // its buffer's block (a power of two, at least 4 KiB).
  static uint64_t Pinned(uint32_t size) {
    return LargeMemoryCache::BlockSize(size);
  }
  // Adds `bytes` to (negative: takes them from) rdv_held_ and the Worker's
  // count (WorkerOptions::rendezvous_budget); keeps the peaks.
  void HoldRendezvous(int64_t bytes);
  // Whether `pinned` more bytes fit the Worker's budget; first settles
  // every connection of the Worker when they do not.
  bool FitsWorkerBudget(uint64_t pinned);
  // Whether a rendezvous of `size` bytes may be granted now (the
  // connection's budget, then the Worker's: rdv_worker_limited_ says
  // which one refused).
  bool FitsBudget(uint32_t size);
  // Gives `in` (a rendezvous request in incoming_) a buffer and sends its
  // CTS; false when no buffer could be had: the CTS said REFUSED and the
  // caller removes `in`.
  bool GrantRendezvous(Incoming& in);
  // Grants the deferred requests, oldest first, while they fit.
  void GrantDeferred();
  // Starts RendezvousWatch unless it runs (then wakes it when requests
  // are deferred: it polls for what Recv takes).
  void WatchRendezvous();
  // While rendezvous are granted or deferred: ends the connection when a
  // DONE is overdue, and grants deferred requests as Recv takes messages.
  Task<void> RendezvousWatch();
  // Landing buffers (landing.cc). Receiver: a kLanded message, and keeping
  // options_.landing_buffers granted once the peer sends medium messages.
  // Sender: the grants a credit message carries.
  bool OnLanded(RecvSlot* slot, const WireHeader& h, const ibv_wc& wc);
  // Bytes of a `total`-byte landed message that follow its header (the
  // rest goes by WRITE); `buf_size` is the header's send buffer.
  uint32_t LandedTail(uint64_t total, size_t buf_size) const;
  void TopUpGrants();
  // The peer announced a rendezvous of `length` bytes: if it could have
  // landed, grant from now on.
  void NoteMediumSize(uint64_t length);
  // Unsent grants worth a credit message: a quarter of landing_buffers, or
  // any when the peer holds at most a quarter.
  bool GrantsDue() const;
  bool TakeGrants(const RecvSlot* slot, const WireHeader& h);
  // Writes the next unsent grants (at most kMaxGrantsPerMessage) to `out`;
  // returns the bytes written. A grant by memory window adds its bind to
  // `binds`, which must be posted before the message carrying the grant.
  size_t WriteGrants(std::span<std::byte> out, transport::SendBatch& binds);
  // A buffer to grant: by memory window where we can (landing_windows_),
  // else registered for the peer's WRITE (NewRendezvousBuffer).
  LargeBuffer* NewLandingBuffer();
  // A registered buffer of landing_buffer_size to WRITE a copied payload
  // from (the Worker's pool, local access only).
  Task<absl::StatusOr<transport::BufferPool::Buffer>> GetLandingStaging();
  // A buffer for an announced rendezvous, registered for the peer's WRITE;
  // nullptr when memory or the registration is not to be had.
  LargeBuffer* NewRendezvousBuffer(uint32_t length);
  Task<void> SendCts(uint32_t cookie, uint16_t flags,
                     std::vector<std::byte> payload);
  Task<void> SendControl(MsgType type, uint32_t cookie, uint16_t flags,
                         std::vector<std::byte> payload);
  Task<void> SendCreditMessage();
  // One credit message (kCredit with `flags`, carrying the credits owed)
  // from `buf` into the peer's reserve receives; the caller checked that
  // fewer than kCreditReserve are unacknowledged.
  Task<absl::Status> SendCreditFrame(transport::BufferPool::Buffer& buf,
                                     uint8_t flags);
  // Takes, in FIFO order, the right to post the next message: the send
  // turn, one credit and a send buffer. On success the caller holds the
  // turn and calls send_turn_.Release() right before it posts (nothing
  // suspends in between), which keeps messages in the order Sends began.
  Task<absl::StatusOr<transport::BufferPool::Buffer>> AcquireSend();
  // The same without waiting: true (and `out` set) when the turn, a credit
  // and a buffer were all free; else nothing is taken.
  bool TryAcquireSend(std::optional<transport::BufferPool::Buffer>& out);
  // A small message sent without waiting for anything: when the turn and a
  // credit are free at once and its frame (header, `parts`, then `extra`'s
  // bytes) fits the QP's inline limit, the frame is written on the stack
  // and posted with PostInlineSend -- no send buffer, no operation, no
  // suspension. nullopt: nothing was taken (send the usual way); else the
  // outcome, OK once the message is posted (a later failure of its
  // completion takes the connection down, with its reason).
  std::optional<absl::Status> TrySendInline(
      MsgType type, uint32_t cookie,
      std::span<const std::span<const std::byte>> parts, size_t total,
      const transport::LocalBuffer* extra);
  // Whether a send may be posted inline now and complete at its post: the
  // QP takes it at once, and fewer than kMaxUnackedInline are
  // unacknowledged. Beyond, a Send waits for its completion as before, so
  // a flood is paced by the peer's acknowledgements and does not run the
  // credits dry (every Send would then queue for the send turn and a
  // credit, a wake-up per message).
  static constexpr uint32_t kMaxUnackedInline = 16;
  bool CanSendInlineNow() const {
    return qp_->CanPostSendNow() &&
           qp_->inline_sends_in_flight() < kMaxUnackedInline;
  }
  // Posts a written frame inline (CanSendInlineNow() held) and counts the
  // message: OK once posted, else the connection's view of the failure.
  absl::Status PostFrameInline(MsgType type, size_t total,
                               const transport::LocalBuffer& frame);
  // A send that holds the turn and its credit but will not post: gives both
  // back (the credit only while up: Fail released every waiter with
  // permits that are not credits).
  void AbandonTurn();
  Task<absl::Status> TakeCredit();
  // Runs an internal task that keeps the connection alive until it ends.
  void SpawnInternal(Task<void> t);
  absl::Status CheckUp(const char* what) const;
  // Writes a header for `payload`, then the payload, to `dst` (a send
  // buffer); returns the bytes to post.
  size_t WriteFrame(std::byte* dst, MsgType type, uint32_t cookie,
                    uint16_t flags, std::span<const std::byte> payload);
  // The same for a payload gathered from `parts`, under a header that
  // announces `length` bytes (more than `parts` hold when the rest goes as
  // a second SGE, SendSmall's zero copy).
  size_t WriteFrame(std::byte* dst, MsgType type, uint32_t length,
                    uint32_t cookie,
                    std::span<const std::span<const std::byte>> parts);
  // An internal send (control, CTS, credit) failed: the connection is lost,
  // unless it is already down or closing.
  void FailInternalSend(const absl::Status& s, const char* what);
  void FillHeader(WireHeader& h, MsgType type, uint32_t length, uint32_t cookie,
                  uint16_t flags);
  void FillHeaderBody(WireHeader& h, MsgType type, uint32_t length,
                      uint32_t cookie, uint16_t flags);
  // Takes the connection down: status_ becomes `why` with the cause's
  // words first (CloseCauseName), the close is logged with it. The one-
  // argument form finds the cause in the verbs status `why` carries.
  void Fail(CloseCause cause, absl::Status why);
  void Fail(absl::Status why);
  // A "peer gone" becomes the fault the device reported on our QP, if it
  // reported one (cm/qp_events.h).
  void CauseFromQpEvent(CloseCause* cause, absl::Status* why);
  void LogClose() const;
  // What an operation on the down connection returns.
  absl::Status DownError(const char* op) const;
  void Pump();
  void MaybeSendCredits();
  // Credits returned once this many are owed.
  uint32_t ReturnThreshold() const;
  // SRQ mode: credits the peer may hold now -- announced and unspent, owed,
  // or behind a Message the application holds (its credit returns when the
  // Message is freed).
  // (Ring mode: the slots waiting for their batched repost count as
  // released.)
  uint32_t RecvWindow() const {
    return outstanding_ + to_return_ + refill_n_ + held_;
  }
  // A credit-spending message arrived (`low`: the peer set kFlagCreditLow on
  // it); false (the connection failed) if the peer had no credit left.
  bool Spent(bool low);
  bool SpentBody(bool low);
  // A credit-spending receive is posted again: owe the peer its credit
  // back (SRQ mode: or two, to grow a busy sender's window, or none, to
  // shrink one that no longer runs out).
  void Replenish();
  // The bodies of Repost, Replenish, MaybeSendCredits and ReturnThreshold,
  // always inlined where credits.cc calls them once per released message
  // (ReturnSlot); the named functions call them for the other files.
  bool RepostBody(RecvSlot* slot);
  void ReplenishBody();
  void MaybeSendCreditsBody();
  uint32_t ReturnThresholdBody() const;
  absl::Status InitSrq();
  absl::Status InitAtomics();  // the 8-byte result buffers for atomics
  void Protocol(absl::string_view what);
  // An operation's failure as its caller sees it: its own error when that
  // is the root cause (RETRY_EXC_ERR, a remote access error...), which then
  // also becomes the connection's status if that only said "flushed";
  // else the connection's status.
  absl::Status OpError(const char* op, const absl::Status& s);
  Task<absl::StatusOr<transport::BufferPool::Buffer>> GetSendBuffer();
  absl::StatusOr<transport::BufferPool*> SendPool();
  // SendPool's answer once found: the Worker keeps its pools as long as it
  // lives, which outlasts its connections (a map lookup per message else).
  transport::BufferPool* send_pool_ = nullptr;
  uint32_t send_lkey_ = 0;  // send_pool_'s
  // The Worker's pool of registered buffers of `size` bytes (shared by
  // its connections; made with `count` buffers on first use). `partly_used`:
  // its buffers are mostly written in part, so its pages are not
  // transparent huge pages (BufferPool::Options::transparent_hugepages).
  absl::StatusOr<transport::BufferPool*> PoolOf(size_t size, size_t count,
                                                bool partly_used = false);

  Worker& ctx_;
  std::unique_ptr<transport::QueuePair> qp_;
  std::unique_ptr<transport::ConnectionLink> link_;
  ConnectionOptions options_;
  bool active_;
  uint64_t id_ = 0;
  uint32_t qp_num_ = 0;
  std::string name_;
  PeerInfo peer_;
  Handshake local_;
  bool started_ = false;

  // Receive side.
  RecvRing* ring_ = nullptr;  // ring mode
  uint32_t ring_slots_ = 0;
  SrqPool* pool_ = nullptr;  // SRQ mode
  size_t slot_size_ = 0;     // bytes per receive buffer
  uint32_t initial_credits_ = 0;
  uint32_t outstanding_ = 0;  // credits announced and not yet spent
  bool peer_low_ = false;     // SRQ: the peer ran out since we last lent
  uint32_t since_low_ = 0;    // SRQ: credit-spending messages since then
  uint32_t window_peak_ = 0;
  uint32_t held_ = 0;       // SRQ: our receives held by Messages (a credit each
                            // once released)
  uint32_t to_return_ = 0;  // reposted, not yet announced
  // Ring mode: released slots not posted again yet. They go back with one
  // post call once refill_batch_ gathered (eRPC's batched refill), or as
  // soon as their credits would be due (to_return_ + refill_n_ reaching the
  // return threshold), so batching never holds back a credit the peer would
  // have got: the peer's credits plus what is owed stay as before.
  static constexpr uint32_t kMaxRefill = 16;
  std::array<transport::RecvHandler*, kMaxRefill> refill_{};
  std::array<LocalBuffer, kMaxRefill> refill_bufs_{};
  uint32_t refill_n_ = 0;
  uint32_t refill_batch_ = 1;
  uint32_t credit_msgs_seen_ = 0;  // kCredit messages received (acked)
  std::deque<Incoming> incoming_;  // in arrival order
  MessageQueue ready_;             // deliverable, in order
  Semaphore ready_count_{0};
  bool peer_closed_ = false;

  // Send side.
  Semaphore credits_{0};
  Semaphore send_turn_{1};
  // Our RTS messages still waiting for their CTS (see kCtsReserve).
  Semaphore rts_window_{kCtsReserve};
  // Keeps CTS messages in the order of the RTS they answer.
  Semaphore cts_turn_{1};
  uint32_t credit_msgs_sent_ = 0;
  uint32_t credit_msgs_acked_ = 0;
  bool credit_msg_running_ = false;
  // SendCreditFrame's binds (landing grants by window), reused while free.
  transport::SendBatch credit_batch_;
  bool credit_batch_busy_ = false;
  Event may_send_{false};  // iWARP passive side: set once the peer spoke
  // Set by Start (or by a failure): a CTS answering an RTS that overtook
  // the passive side's ESTABLISHED waits for it (SendCts).
  Event started_event_{false};
  // Set by the first message from the peer (or by a failure): the passive
  // side's accept waits for it (WaitPeerSpoke).
  Event peer_spoke_{false};
  // status_ only says that a receive was flushed: the QP went to error for
  // a reason an operation's own completion may still tell (OpError).
  bool status_is_flush_ = false;
  // Keepalive: completions received so far, and the loop's wake-up (set
  // when the connection goes down).
  uint64_t rx_count_ = 0;
  Event keepalive_wake_{false};
  std::deque<PendingRts*> pending_rts_;
  // Receiver side of the rendezvous budget (see SettleReady): bytes held,
  // requests deferred, the large messages in ready_ by their index there.
  struct ReadyLarge {
    uint64_t index;
    uint64_t bytes;  // Pinned(size)
  };
  uint64_t rdv_held_ = 0;
  uint32_t rdv_deferred_ = 0;
  // The last FitsBudget refused for the Worker's budget: RendezvousWatch
  // polls for what other connections' applications take.
  bool rdv_worker_limited_ = false;
  std::deque<ReadyLarge> rdv_ready_;
  bool rdv_watch_running_ = false;
  Event rdv_wake_{false};  // wakes RendezvousWatch (Fail sets it too)
  uint32_t next_cookie_ = 1;
  std::vector<uint32_t> abandoned_;  // RTS cookies whose Send gave up
  uint64_t peer_max_ = 0;
  // Largest eager payload: our rendezvous_threshold, or less when the
  // peer's receive buffers are smaller.
  size_t eager_max_ = 0;
  bool use_imm_ = false;

  // Landing buffers, receiver side: granted to the peer (registered for
  // its WRITE, oldest first; the last grants_unsent_ not yet announced),
  // the sequence number of granted_.front(), and whether the peer sends
  // medium messages (we grant from its first rendezvous on).
  std::deque<LargeBuffer*> granted_;
  uint32_t grants_unsent_ = 0;
  uint32_t landing_seq_ = 0;
  bool landing_on_ = false;
  // Grants are memory windows over blocks that stay registered (the device
  // has them and options_.landing_windows): a medium message then costs no
  // registration. Windows the peer invalidated wait here to be bound again.
  bool landing_windows_ = false;
  std::vector<transport::MemoryWindow> free_windows_;
  // The Worker's staging buffers for landed messages (PoolOf, which keeps
  // each pool for the Worker's life), looked up once: a map lookup per
  // message otherwise.
  transport::BufferPool* staging_pool_ = nullptr;
  // Sender side: the peer's grants, oldest first, and the sequence number
  // of grants_.front().
  std::deque<GrantPayload> grants_;
  uint32_t grant_seq_ = 0;

  // Teardown.
  absl::Status status_;  // non-OK once down
  CloseCause cause_ = CloseCause::kNone;
  bool closing_ = false;
  bool goodbye_sent_ = false;  // Close posted ours: a later flush is ours
  bool close_started_ = false;
  Event close_done_{false};  // the first Close() ended
  // The Worker is gone (DetachFromWorker): qp_, link_, ring_ and pool_ are
  // released and ctx_ must not be touched.
  bool detached_ = false;
  WaitGroup tasks_;  // internal control sends in flight

  // 8-byte result buffers for atomics.
  std::unique_ptr<uint64_t[]> atomic_mem_;
  MemoryRegion atomic_mr_;
  Semaphore atomic_slots_{0};
  std::vector<uint32_t> atomic_free_;

  // Exposures (one_sided.cc): each a window bound to this QP over a
  // registration of its own (MW_BIND, no remote access), ended by Revoke,
  // Close or destruction (the window goes before its registration).
  // Members go in reverse order: the window ends, then its registration,
  // then what the owner kept (ExposeOwned).
  struct Exposure {
    std::shared_ptr<void> owner;
    MemoryRegion mr;
    transport::MemoryWindow window;
    uint32_t rkey = 0;
    uint64_t bytes = 0;
  };
  std::vector<std::unique_ptr<Exposure>> exposures_;
  uint64_t exposed_bytes_ = 0;  // of exposures_

  Connection::Stats stats_;
};

// Inline here: OnRecv (receive.cc) runs them once per message received,
// and ReturnSlot (credits.cc) once per message released (a call each).
[[gnu::always_inline]] inline uint32_t ConnectionImpl::ReturnThresholdBody()
    const {
  // SRQ: a quarter of the current window, which may be as small as
  // srq_initial_credits (a fixed quarter of recv_credits could exceed it
  // and never be reached).
  uint32_t window = pool_ != nullptr ? RecvWindow() : options_.recv_credits;
  return std::max<uint32_t>(1, window / 4);
}

[[gnu::always_inline]] inline void ConnectionImpl::MaybeSendCreditsBody() {
  // Twice per message received: the usual "nothing due" first, without
  // a call.
  if (credit_msg_running_) return;
  if (to_return_ < ReturnThresholdBody() &&
      (grants_unsent_ == 0 || !GrantsDue())) {
    return;
  }
  if (!status_.ok() || closing_ || !started_) return;
  if (credit_msgs_sent_ - credit_msgs_acked_ >= kCreditReserve) return;
  credit_msg_running_ = true;
  SpawnInternal(SendCreditMessage());
}

[[gnu::always_inline]] inline bool ConnectionImpl::SpentBody(bool low) {
  if (outstanding_ == 0) {
    Protocol("a message arrived although the peer had no credit left");
    return false;
  }
  --outstanding_;
  if (pool_ != nullptr) {
    --pool_->committed;
    if (low) {
      peer_low_ = true;
      since_low_ = 0;
    } else {
      ++since_low_;
    }
  }
  return true;
}

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_CONNECTION_IMPL_H_
