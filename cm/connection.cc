#include "cm/connection.h"

#include <arpa/inet.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/context_shared.h"
#include "cm/wire.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "transport/cm_trace.h"
#include "transport/errors.h"

namespace coverbs::cm {
namespace internal {

static_assert(std::endian::native == std::endian::little,
              "the cm wire format is little endian; add byte swaps");

using transport::LocalBuffer;
using transport::MemoryRegion;
using transport::RemoteRegion;

// Memory behind a Message.
class MessageBuffer {
 public:
  virtual void Release() = 0;

 protected:
  ~MessageBuffer() = default;
};

class ConnectionImpl;
struct RecvRing;
struct SrqPool;

// One receive buffer: of a connection's ring, or of the Context's SRQ pool.
struct RecvSlot final : transport::RecvHandler, MessageBuffer {
  RecvRing* ring = nullptr;  // ring mode
  SrqPool* pool = nullptr;   // SRQ mode
  std::byte* data = nullptr;
  // SRQ mode only.
  uint32_t lkey = 0;
  bool posted = false;   // in the SRQ
  bool held = false;     // owned by a Message
  uint64_t conn_id = 0;  // the connection a held message arrived on
  void OnRecv(const ibv_wc& wc) override;
  void Release() override;
};

// The receive ring: one registration carved into equal slots. Shared by the
// connection and the Messages that still hold slots, so a Message may
// outlive its Connection: the ring goes away with the last of them (the QP
// is closed by then, so the NIC no longer writes into it).
struct RecvRing {
  ConnectionImpl* conn = nullptr;  // null once the connection is gone
  std::byte* mem = nullptr;
  size_t mem_size = 0;
  size_t slot_size = 0;
  MemoryRegion mr;
  std::vector<RecvSlot> slots;
  uint32_t held = 0;  // slots owned by Messages

  ~RecvRing() {
    mr.Deregister();
    std::free(mem);
  }
  void MaybeDelete() {
    if (conn == nullptr && held == 0) delete this;
  }
};

// A rendezvous receive buffer. Registered for REMOTE_WRITE only while its
// transfer runs; the Message then owns plain memory.
// The memory comes from (and returns to) the Context's LargeMemoryCache;
// deregistering first guarantees the NIC no longer touches it.
struct LargeBuffer final : MessageBuffer {
  std::byte* mem = nullptr;
  size_t size = 0;
  MemoryRegion mr;
  std::shared_ptr<LargeMemoryCache> cache;
  size_t capacity = 0;
  ~LargeBuffer() {
    mr.Deregister();
    cache->Put({mem, capacity});
  }
  void Release() override { delete this; }
};

// SRQ mode (ConnectionOptions::use_srq): the Context's shared receive queue
// and the buffers posted to it, shared by the connections that use it.
//
// No RNR with a correct peer still holds: every connection is promised
// receives for each credit its peer holds plus its reserve receives
// (kCreditReserve + kCtsReserve), and `committed` (the sum of those
// promises) never exceeds the receives posted. A connection starts with
// srq_initial_credits; its receiver lends a busy sender more (up to
// recv_credits, from receives nobody was promised) and takes them back when
// the sender stops running out (see ConnectionImpl::Replenish). The memory
// of an idle connection is therefore its current window plus 6 buffers
// instead of recv_credits + 6.
//
// Messages may outlive the connection and the Context: the pool goes away
// with the last held buffer (the SRQ and the registrations go with the
// Context, so the NIC no longer writes into them).
struct SrqPool {
  struct Chunk {
    std::byte* mem = nullptr;
    MemoryRegion mr;
    std::unique_ptr<RecvSlot[]> slots;
  };
  std::unique_ptr<transport::SharedReceiveQueue> srq;
  size_t slot_size = 0;
  uint32_t capacity = 0;  // buffers at most (ContextOptions::srq_depth)
  uint32_t slots = 0;     // buffers allocated
  int64_t committed = 0;  // receives promised to connections
  uint32_t held = 0;      // buffers owned by Messages
  bool detached = false;  // the Context is gone
  std::vector<Chunk> chunks;
  std::vector<RecvSlot*> unposted;  // a post failed; retried on Reserve
  absl::flat_hash_map<uint64_t, ConnectionImpl*> conns;  // by connection id
  absl::flat_hash_map<uint32_t, ConnectionImpl*> by_qp;

  ~SrqPool() {
    for (Chunk& c : chunks) {
      c.mr.Deregister();
      std::free(c.mem);
    }
  }
  static absl::StatusOr<SrqPool*> For(Context& ctx);
  // Receives posted and promised to nobody.
  int64_t Free() const {
    return static_cast<int64_t>(srq->posted()) - committed;
  }
  // Promises `n` receives, posting more buffers (up to `limit` in all) if
  // the free ones are too few.
  absl::Status Reserve(uint32_t n, uint32_t limit, Context& ctx);
  // Lending stops short of the last quarter of the capacity, which is kept
  // for new connections' initial grants.
  bool CanLend(uint32_t n, Context& ctx) {
    return Reserve(n, capacity - capacity / 4, ctx).ok();
  }
  bool Post(RecvSlot* s);
  void OnRecv(RecvSlot* s, const ibv_wc& wc);
  void Release(RecvSlot* s);
  void Detach() {
    srq.reset();  // discards the posted receives: the NIC is done with them
    for (Chunk& c : chunks) c.mr.Deregister();
    detached = true;
    if (held == 0) delete this;
  }
};

void DetachSrqPool(SrqPool* pool) { pool->Detach(); }

// A received message waiting to be handed out in arrival order; a
// rendezvous entry is not ready until its DONE arrived.
struct Incoming {
  Message msg;
  bool ready = false;
  uint32_t cookie = 0;
  LargeBuffer* large = nullptr;
  bool dropped = false;  // aborted by the sender
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

class ConnectionImpl : public std::enable_shared_from_this<ConnectionImpl> {
 public:
  ConnectionImpl(Context& ctx, std::unique_ptr<transport::QueuePair> qp,
                 const ConnectionOptions& o, bool active)
      : ctx_(ctx), qp_(std::move(qp)), options_(o), active_(active) {
    id_ = ctx.shared().next_connection_id++;
    qp_num_ = qp_->qp_num();
    name_ = absl::StrFormat("conn %d (qp 0x%x)", id_, qp_->qp_num());
  }
  ~ConnectionImpl();

  absl::Status Init();
  absl::Status Start(PeerInfo peer,
                     std::unique_ptr<transport::ConnectionLink> link);
  Handshake LocalHandshake() const;

  Task<absl::Status> SendParts(std::span<const std::span<const std::byte>> p);
  Task<absl::Status> SendRegistered(LocalBuffer b);
  Task<absl::StatusOr<Message>> Recv();
  Task<absl::Status> OneSided(bool read, LocalBuffer local, RemoteRegion r);
  Task<absl::StatusOr<uint64_t>> Atomic(bool cas, RemoteRegion r, uint64_t a,
                                        uint64_t b);
  Task<absl::Status> Close();
  void Abort(absl::Status why);

  absl::Status status() const { return status_; }
  const PeerInfo& peer() const { return peer_; }
  Context& context() const { return ctx_; }
  transport::QueuePair& qp() const { return *qp_; }
  const std::string& name() const { return name_; }
  Connection::Stats stats() const {
    Connection::Stats st = stats_;
    st.recv_window = RecvWindow();
    st.recv_window_peak = std::max(window_peak_, st.recv_window);
    return st;
  }
  const ConnectionOptions& options() const { return options_; }

  void OnRecv(RecvSlot* slot, const ibv_wc& wc);
  void ReturnSlot(RecvSlot* slot);
  // Posts `slot` again; on failure the connection is failed (false).
  bool Repost(RecvSlot* slot);

 private:
  // Sends one small message (header + parts copied into a pooled buffer).
  Task<absl::Status> SendSmall(MsgType type, uint32_t cookie,
                               std::span<const std::span<const std::byte>> p,
                               const LocalBuffer* zero_copy = nullptr);
  Task<absl::Status> SendLarge(std::span<const std::span<const std::byte>> p,
                               const LocalBuffer* registered);
  Task<void> SendCts(uint32_t cookie, uint16_t flags, std::vector<std::byte> payload);
  Task<void> SendControl(MsgType type, uint32_t cookie, uint16_t flags,
                         std::vector<std::byte> payload);
  Task<void> SendCreditMessage();
  // Takes, in FIFO order, the right to post the next message: the send
  // turn, one credit and a send buffer. On success the caller holds the
  // turn and calls send_turn_.Release() right before it posts (nothing
  // suspends in between), which keeps messages in the order Sends began.
  Task<absl::StatusOr<transport::BufferPool::Buffer>> AcquireSend();
  Task<absl::Status> TakeCredit();
  // Runs an internal task that keeps the connection alive until it ends.
  void SpawnInternal(Task<void> t);
  absl::Status CheckUp(const char* what) const;
  // Writes a header for `payload`, then the payload, to `dst` (a send
  // buffer); returns the bytes to post.
  size_t WriteFrame(std::byte* dst, MsgType type, uint32_t cookie,
                    uint16_t flags, std::span<const std::byte> payload);
  // An internal send (control, CTS, credit) failed: the connection is lost,
  // unless it is already down or closing.
  void FailInternalSend(const absl::Status& s, const char* what);
  void FillHeader(WireHeader& h, MsgType type, uint32_t length,
                  uint32_t cookie, uint16_t flags);
  void Fail(absl::Status why);
  void Pump();
  void MaybeSendCredits();
  // Credits returned once this many are owed.
  uint32_t ReturnThreshold() const;
  // SRQ mode: credits the peer may hold now -- announced and unspent, owed,
  // or behind a Message the application holds (its credit returns when the
  // Message is freed).
  uint32_t RecvWindow() const { return outstanding_ + to_return_ + held_; }
  // A credit-spending message arrived (`low`: the peer set kFlagCreditLow on
  // it); false (the connection failed) if the peer had no credit left.
  bool Spent(bool low);
  // A credit-spending receive is posted again: owe the peer its credit
  // back (SRQ mode: or two, to grow a busy sender's window, or none, to
  // shrink one that no longer runs out).
  void Replenish();
  absl::Status InitSrq();
  absl::Status InitAtomics();  // the 8-byte result buffers for atomics
  void Protocol(absl::string_view what);
  absl::Status OpError(const char* op, const absl::Status& s) const;
  Task<absl::StatusOr<transport::BufferPool::Buffer>> GetSendBuffer();
  absl::StatusOr<transport::BufferPool*> SendPool();

  Context& ctx_;
  std::unique_ptr<transport::QueuePair> qp_;
  std::unique_ptr<transport::ConnectionLink> link_;
  ConnectionOptions options_;
  bool active_;
  uint64_t id_ = 0;
  uint32_t qp_num_ = 0;
  std::string name_;
  PeerInfo peer_;
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
  uint32_t held_ = 0;  // SRQ: our receives held by Messages (a credit each
                       // once released)
  uint32_t to_return_ = 0;           // reposted, not yet announced
  uint32_t credit_msgs_seen_ = 0;    // kCredit messages received (acked)
  std::deque<Incoming> incoming_;    // in arrival order
  std::deque<Message> ready_;        // deliverable, in order
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
  Event may_send_{false};  // iWARP passive side: set once the peer spoke
  std::deque<PendingRts*> pending_rts_;
  uint32_t next_cookie_ = 1;
  std::vector<uint32_t> abandoned_;  // RTS cookies whose Send gave up
  uint64_t peer_max_ = 0;
  bool use_imm_ = false;

  // Teardown.
  absl::Status status_;  // non-OK once down
  bool closing_ = false;
  WaitGroup tasks_;  // internal control sends in flight

  // 8-byte result buffers for atomics.
  std::unique_ptr<uint64_t[]> atomic_mem_;
  MemoryRegion atomic_mr_;
  Semaphore atomic_slots_{0};
  std::vector<uint32_t> atomic_free_;

  Connection::Stats stats_;
};

// ---------------------------------------------------------------------------

void RecvSlot::OnRecv(const ibv_wc& wc) {
  if (pool != nullptr) {
    pool->OnRecv(this, wc);
  } else if (ring->conn != nullptr) {
    ring->conn->OnRecv(this, wc);
  }
}

void RecvSlot::Release() {
  if (pool != nullptr) {
    pool->Release(this);
    return;
  }
  RecvRing* r = ring;
  --r->held;
  if (r->conn != nullptr) {
    r->conn->ReturnSlot(this);
  } else {
    r->MaybeDelete();
  }
}

absl::StatusOr<SrqPool*> SrqPool::For(Context& ctx) {
  Context::Shared& sh = ctx.shared();
  if (sh.srq_pool != nullptr) return sh.srq_pool;
  const ContextOptions& o = ctx.options();
  if (o.srq_depth == 0) {
    return absl::FailedPreconditionError(
        "ConnectionOptions::use_srq needs a Context with a shared receive "
        "queue (ContextOptions::srq_depth > 0)");
  }
  if (o.srq_buffer_size <= kHeaderSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("ContextOptions::srq_buffer_size ", o.srq_buffer_size,
                     " does not hold a message header"));
  }
  auto srq =
      transport::SharedReceiveQueue::Create(ctx.pd(), ctx.cq(), o.srq_depth, 1);
  if (!srq.ok()) {
    return absl::Status(
        srq.status().code(),
        absl::StrCat("creating the Context's shared receive queue (",
                     o.srq_depth, " receives): ", srq.status().message()));
  }
  auto* pool = new SrqPool();
  pool->srq = std::move(*srq);
  pool->capacity = o.srq_depth;
  pool->slot_size = (size_t{o.srq_buffer_size} + 63) & ~size_t{63};
  sh.srq_pool = pool;
  return pool;
}

}  // namespace internal

Context::SrqUsage Context::srq_usage() const {
  SrqUsage u;
  const internal::SrqPool* p = shared_->srq_pool;
  if (p == nullptr) return u;
  u.buffers = p->slots;
  u.posted = p->srq->posted();
  u.promised = p->committed;
  u.bytes = size_t{p->slots} * p->slot_size;
  return u;
}

namespace internal {

absl::Status SrqPool::Reserve(uint32_t n, uint32_t limit, Context& ctx) {
  while (Free() < n && !unposted.empty()) {
    RecvSlot* s = unposted.back();
    unposted.pop_back();
    if (!Post(s)) break;
  }
  while (Free() < n) {
    if (slots >= limit) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the shared receive queue is full: %d of %d receives promised "
          "(ContextOptions::srq_depth)",
          committed, capacity));
    }
    // Grow by at least 64 buffers (one registration each time).
    uint32_t want = static_cast<uint32_t>(n - Free());
    uint32_t count = std::min(limit - slots, std::max<uint32_t>(want, 64));
    size_t bytes = (slot_size * count + 4095) & ~size_t{4095};
    Chunk c;
    c.mem = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    if (c.mem == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", bytes, " bytes of SRQ receive buffers"));
    }
    auto mr = ctx.pd().Register(c.mem, bytes, IBV_ACCESS_LOCAL_WRITE);
    if (!mr.ok()) {
      std::free(c.mem);
      return absl::Status(mr.status().code(),
                          absl::StrCat("registering SRQ receive buffers: ",
                                       mr.status().message()));
    }
    c.mr = std::move(*mr);
    c.slots.reset(new RecvSlot[count]);
    slots += count;
    for (uint32_t i = 0; i < count; ++i) {
      RecvSlot& s = c.slots[i];
      s.pool = this;
      s.data = c.mem + i * slot_size;
      s.lkey = c.mr.lkey();
    }
    RecvSlot* first = c.slots.get();
    chunks.push_back(std::move(c));
    for (uint32_t i = 0; i < count; ++i) {
      if (!Post(first + i)) {
        return absl::UnavailableError(
            "posting receives to the shared receive queue failed");
      }
    }
  }
  committed += n;
  return absl::OkStatus();
}

bool SrqPool::Post(RecvSlot* s) {
  LocalBuffer b{s->data, static_cast<uint32_t>(slot_size), s->lkey};
  absl::Status st = srq->PostRecv(s, std::span<const LocalBuffer>(&b, 1));
  if (!st.ok()) {
    std::fprintf(stderr, "coverbs: reposting an SRQ receive: %s\n",
                 st.ToString().c_str());
    unposted.push_back(s);
    return false;
  }
  s->posted = true;
  return true;
}

void SrqPool::OnRecv(RecvSlot* s, const ibv_wc& wc) {
  s->posted = false;
  auto it = by_qp.find(wc.qp_num);
  // A completion of a connection that is gone (its QP was destroyed with
  // the message already in the CQ) only gives the buffer back.
  if (it != by_qp.end()) it->second->OnRecv(s, wc);
  if (!s->posted && !s->held) Post(s);
}

void SrqPool::Release(RecvSlot* s) {
  s->held = false;
  --held;
  if (detached) {
    if (held == 0) delete this;
    return;
  }
  auto it = conns.find(s->conn_id);
  if (it != conns.end()) {
    it->second->ReturnSlot(s);
  } else {
    Post(s);
  }
}

absl::Status ConnectionImpl::InitSrq() {
  auto pool = SrqPool::For(ctx_);
  if (!pool.ok()) {
    return absl::Status(pool.status().code(),
                        absl::StrCat(name_, ": ", pool.status().message()));
  }
  if ((*pool)->slot_size < kHeaderSize + options_.rendezvous_threshold) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: SRQ receive buffers of %d bytes cannot hold eager messages of "
        "%d bytes + the %d-byte header (raise "
        "ContextOptions::srq_buffer_size or lower rendezvous_threshold)",
        name_, (*pool)->slot_size, options_.rendezvous_threshold, kHeaderSize));
  }
  if (options_.srq_initial_credits == 0 ||
      options_.srq_initial_credits > options_.recv_credits) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": srq_initial_credits must be in [1, recv_credits = ",
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
  if (options_.rendezvous_threshold == 0 ||
      options_.rendezvous_threshold > (1u << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": rendezvous_threshold must be in [1, 1 MiB], got ",
        options_.rendezvous_threshold));
  }
  if (options_.recv_credits < 2 || options_.recv_credits > 16384) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, ": recv_credits must be in [2, 16384], got ",
        options_.recv_credits));
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
  ring->mem = static_cast<std::byte*>(
      std::aligned_alloc(4096, (ring->mem_size + 4095) & ~size_t{4095}));
  if (ring->mem == nullptr) {
    delete ring;
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": cannot allocate the receive ring"));
  }
  auto mr = ctx_.pd().Register(ring->mem, ring->mem_size,
                               IBV_ACCESS_LOCAL_WRITE);
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
  for (uint32_t i = 0; i < ring_slots_; ++i) {
    RecvSlot& s = ring->slots[i];
    s.ring = ring;
    s.data = ring->mem + i * ring->slot_size;
    LocalBuffer b{s.data, static_cast<uint32_t>(ring->slot_size),
                  ring->mr.lkey()};
    absl::Status st = qp_->PostRecv(&s, std::span<const LocalBuffer>(&b, 1));
    if (!st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(name_, ": posting the receive ring: ",
                                       st.message()));
    }
  }
  return InitAtomics();
}

absl::Status ConnectionImpl::InitAtomics() {
  constexpr uint32_t kAtomicSlots = 16;
  atomic_mem_ = std::make_unique<uint64_t[]>(kAtomicSlots);
  auto amr = ctx_.pd().Register(atomic_mem_.get(),
                                kAtomicSlots * sizeof(uint64_t),
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
  // The peer's receive buffers must hold our largest eager message.
  if (h.recv_buffer_size < kHeaderSize + options_.rendezvous_threshold) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: peer receive buffers (%d bytes) are smaller than our eager "
        "messages (%d bytes + %d header): configure the same "
        "rendezvous_threshold on both sides",
        name_, h.recv_buffer_size, options_.rendezvous_threshold, kHeaderSize));
  }
  peer_max_ = std::min<uint64_t>(h.max_message_size, options_.max_message_size);
  use_imm_ = (h.caps & kCapWriteWithImm) && qp_->caps().write_with_imm;
  credits_.Release(h.credits);
  started_ = true;
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
        for (int i = 0; i < 64 && self->qp_->cq()->Poll() > 0; ++i) {
        }
      }
      if (self->peer_closed_) why = absl::UnavailableError("closed by the peer");
      self->Fail(std::move(why));
    });
  }
  // iWARP: the active side must speak first, so it says hello at once and
  // the passive side holds its sends until anything arrived.
  if (!qp_->caps().active_side_sends_first || active_) {
    may_send_.Set();
  }
  if (qp_->caps().active_side_sends_first && active_) {
    SpawnInternal(SendControl(kHello, 0, 0, {}));
  }
  return absl::OkStatus();
}

absl::Status ConnectionImpl::CheckUp(const char* what) const {
  if (!status_.ok()) {
    return absl::Status(status_.code(),
                        absl::StrCat(what, " on ", name_, ": ",
                                     status_.message()));
  }
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

absl::Status ConnectionImpl::OpError(const char* op,
                                     const absl::Status& s) const {
  if (!status_.ok()) {
    return absl::Status(status_.code(), absl::StrCat(op, " on ", name_, ": ",
                                                     status_.message()));
  }
  return absl::Status(s.code(),
                      absl::StrCat(op, " on ", name_, ": ", s.message()));
}

void ConnectionImpl::FillHeader(WireHeader& h, MsgType type, uint32_t length,
                                uint32_t cookie, uint16_t flags) {
  h.type = type;
  h.flags = static_cast<uint8_t>(flags);
  uint32_t give = std::min<uint32_t>(to_return_, 0xffff);
  h.credits = static_cast<uint16_t>(give);
  to_return_ -= give;
  outstanding_ += give;
  // Spending our last credit: tell a receiver that lends (SRQ) that we
  // would use a larger window.
  bool spends = type != kCredit && type != kCts;
  if (spends && credits_.available() == 0) h.flags |= kFlagCreditLow;
  h.length = length;
  h.credit_acks = credit_msgs_seen_;
  h.cookie = cookie;
}

size_t ConnectionImpl::WriteFrame(std::byte* dst, MsgType type,
                                  uint32_t cookie, uint16_t flags,
                                  std::span<const std::byte> payload) {
  WireHeader h;
  FillHeader(h, type, static_cast<uint32_t>(payload.size()), cookie, flags);
  std::memcpy(dst, &h, kHeaderSize);
  if (!payload.empty()) {
    std::memcpy(dst + kHeaderSize, payload.data(), payload.size());
  }
  return kHeaderSize + payload.size();
}

void ConnectionImpl::FailInternalSend(const absl::Status& s,
                                      const char* what) {
  if (!s.ok() && status_.ok() && !closing_) {
    Fail(absl::UnavailableError(
        absl::StrCat("connection lost: ", what, " failed: ", s.message())));
  }
}

Task<absl::Status> ConnectionImpl::TakeCredit() {
  if (!may_send_.is_set()) {
    absl::Status s = co_await may_send_.Wait();
    if (!s.ok()) co_return s;
  }
  absl::Status s = CheckUp("send");
  if (!s.ok()) co_return s;
  if (!credits_.TryAcquire(1)) {
    ++stats_.credit_waits;
    s = co_await credits_.Acquire(1);
    if (!s.ok()) co_return s;
  }
  // Fail() releases every waiter with permits that are not credits.
  s = CheckUp("send");
  co_return s;
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::AcquireSend() {
  absl::Status s = co_await send_turn_.Acquire(1);
  if (!s.ok()) co_return s;
  s = co_await TakeCredit();
  if (!s.ok()) {
    send_turn_.Release(1);
    co_return s;
  }
  // Buffers are only ever held by posted sends, which complete: waiting
  // for one here cannot deadlock with credits.
  auto buf = co_await GetSendBuffer();
  if (!buf.ok()) {
    if (status_.ok()) credits_.Release(1);
    send_turn_.Release(1);
    co_return OpError("send", buf.status());
  }
  co_return std::move(*buf);
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

absl::StatusOr<transport::BufferPool*> ConnectionImpl::SendPool() {
  Context::Shared& sh = ctx_.shared();
  size_t size = kHeaderSize + options_.rendezvous_threshold;
  auto it = sh.send_pools.find(size);
  if (it != sh.send_pools.end()) return it->second.get();
  transport::BufferPool::Options po;
  po.buffer_size = (size + 63) & ~size_t{63};
  po.count = 256;
  po.access = IBV_ACCESS_LOCAL_WRITE;
  auto pool = transport::BufferPool::Create(ctx_.pd(), po);
  if (!pool.ok()) return pool.status();
  transport::BufferPool* p = pool->get();
  sh.send_pools.emplace(size, std::move(*pool));
  return p;
}

Task<absl::StatusOr<transport::BufferPool::Buffer>>
ConnectionImpl::GetSendBuffer() {
  auto pool = SendPool();
  if (!pool.ok()) co_return pool.status();
  if (auto b = (*pool)->TryGet()) co_return std::move(*b);
  co_return co_await (*pool)->Get();
}

Task<absl::Status> ConnectionImpl::SendSmall(
    MsgType type, uint32_t cookie,
    std::span<const std::span<const std::byte>> parts,
    const LocalBuffer* zero_copy) {
  size_t total = 0;
  for (auto p : parts) total += p.size();
  if (zero_copy != nullptr) total += zero_copy->length;
  auto buf = co_await AcquireSend();
  if (!buf.ok()) co_return buf.status();
  WireHeader h;
  FillHeader(h, type, static_cast<uint32_t>(total), cookie, 0);
  std::byte* d = buf->data();
  std::memcpy(d, &h, kHeaderSize);
  size_t off = kHeaderSize;
  for (auto p : parts) {
    if (!p.empty()) std::memcpy(d + off, p.data(), p.size());
    off += p.size();
  }
  // A payload that fits inline goes inline even when the caller registered
  // it: one SGE copied at post time beats a second SGE the NIC must fetch.
  if (zero_copy != nullptr && off + zero_copy->length <= qp_->max_inline_data()) {
    if (zero_copy->length > 0) std::memcpy(d + off, zero_copy->addr, zero_copy->length);
    off += zero_copy->length;
    zero_copy = nullptr;
  }
  LocalBuffer sg[2] = {buf->Local(off), {}};
  size_t n = 1;
  if (zero_copy != nullptr) sg[n++] = *zero_copy;
  transport::SendOptions so;
  so.inline_data = zero_copy == nullptr && off <= qp_->max_inline_data();
  send_turn_.Release(1);
  auto wc = co_await qp_->Send(std::span<const LocalBuffer>(sg, n), so);
  if (!wc.ok()) co_return OpError("send", wc.status());
  if (type == kData) ++stats_.messages_sent;
  co_return absl::OkStatus();
}

Task<void> ConnectionImpl::SendControl(MsgType type, uint32_t cookie,
                                       uint16_t flags,
                                       std::vector<std::byte> payload) {
  // Control messages travel like data (a credit each) but are consumed by
  // the peer's connection, never by its application, so they always return.
  absl::Status s;
  do {
    auto buf = co_await AcquireSend();
    if (!buf.ok()) {
      s = buf.status();
      break;
    }
    size_t len = WriteFrame(buf->data(), type, cookie, flags, payload);
    transport::SendOptions so;
    so.inline_data = len <= qp_->max_inline_data();
    send_turn_.Release(1);
    auto wc = co_await qp_->Send(buf->Local(len), so);
    if (!wc.ok()) s = wc.status();
  } while (false);
  FailInternalSend(s, "sending a control message");
}

Task<void> ConnectionImpl::SendCts(uint32_t cookie, uint16_t flags,
                                   std::vector<std::byte> payload) {
  // No credit and no send turn: the CTS lands in one of the kCtsReserve
  // receives the peer posted for the answers to its RTS messages.
  absl::Status s;
  do {
    s = co_await cts_turn_.Acquire(1);
    if (!s.ok()) break;
    s = CheckUp("send");
    if (!s.ok()) {
      cts_turn_.Release(1);
      break;
    }
    auto buf = co_await GetSendBuffer();
    if (!buf.ok()) {
      s = buf.status();
      cts_turn_.Release(1);
      break;
    }
    size_t len = WriteFrame(buf->data(), kCts, cookie, flags, payload);
    transport::SendOptions so;
    so.inline_data = len <= qp_->max_inline_data();
    cts_turn_.Release(1);  // posted in order by the co_await below
    auto wc = co_await qp_->Send(buf->Local(len), so);
    if (!wc.ok()) s = wc.status();
  } while (false);
  FailInternalSend(s, "sending a rendezvous answer");
}

Task<void> ConnectionImpl::SendCreditMessage() {
  // Credit messages use the kCreditReserve receives the peer posted beyond
  // its credits, so returning credits never waits for credits.
  absl::Status s;
  while (to_return_ > 0 && status_.ok() && !closing_ &&
         credit_msgs_sent_ - credit_msgs_acked_ < kCreditReserve) {
    if (!may_send_.is_set()) break;
    auto buf = co_await GetSendBuffer();
    if (!buf.ok()) {
      s = buf.status();
      break;
    }
    if (to_return_ == 0 || !status_.ok()) break;
    size_t len = WriteFrame(buf->data(), kCredit, 0, 0, {});
    ++credit_msgs_sent_;
    ++stats_.credit_messages_sent;
    transport::SendOptions so;
    so.inline_data = len <= qp_->max_inline_data();
    auto wc = co_await qp_->Send(buf->Local(len), so);
    if (!wc.ok()) {
      s = wc.status();
      break;
    }
    // Keep going only if a lot accumulated meanwhile.
    if (to_return_ < ReturnThreshold()) break;
  }
  credit_msg_running_ = false;
  FailInternalSend(s, "a credit message");
}

void ConnectionImpl::MaybeSendCredits() {
  if (credit_msg_running_ || !status_.ok() || closing_ || !started_) return;
  if (to_return_ < ReturnThreshold()) return;
  if (credit_msgs_sent_ - credit_msgs_acked_ >= kCreditReserve) return;
  credit_msg_running_ = true;
  SpawnInternal(SendCreditMessage());
}

uint32_t ConnectionImpl::ReturnThreshold() const {
  // SRQ: a quarter of the current window, which may be as small as
  // srq_initial_credits (a fixed quarter of recv_credits could exceed it
  // and never be reached).
  uint32_t window = pool_ != nullptr ? RecvWindow() : options_.recv_credits;
  return std::max<uint32_t>(1, window / 4);
}

bool ConnectionImpl::Spent(bool low) {
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

void ConnectionImpl::Replenish() {
  if (pool_ == nullptr) {
    ++to_return_;
    return;
  }
  // Additive growth while the sender keeps running out; once a whole
  // window of messages came without it running out, shrink by one per
  // message until it does: the window settles where the sender just stops
  // waiting. Giving back the one credit always fits (its receive was just
  // posted again).
  uint32_t window = RecvWindow();
  uint32_t give = 1;
  bool low = std::exchange(peer_low_, false);
  if (low && window + 2 <= options_.recv_credits && pool_->CanLend(2, ctx_)) {
    // CanLend promised both.
    to_return_ += 2;
    window_peak_ = std::max(window_peak_, window + 2);
    return;
  }
  if (!low && window + 1 > initial_credits_ && since_low_ > window) {
    give = 0;  // and again on the next message, until the sender runs low
  }
  to_return_ += give;
  pool_->committed += give;
}

bool ConnectionImpl::Repost(RecvSlot* slot) {
  absl::Status s;
  if (pool_ != nullptr) {
    if (pool_->Post(slot)) return true;
    s = absl::UnavailableError("the shared receive queue refused it");
  } else {
    LocalBuffer b{slot->data, static_cast<uint32_t>(ring_->slot_size),
                  ring_->mr.lkey()};
    s = qp_->PostRecv(slot, std::span<const LocalBuffer>(&b, 1));
  }
  if (!s.ok()) {
    Fail(absl::UnavailableError(
        absl::StrCat("connection lost: reposting a receive: ", s.message())));
    return false;
  }
  return true;
}

void ConnectionImpl::ReturnSlot(RecvSlot* slot) {
  if (pool_ != nullptr) --held_;
  if (!status_.ok() || qp_->in_error()) {
    // The ring is finished; an SRQ buffer serves the other connections.
    if (pool_ != nullptr) pool_->Post(slot);
    return;
  }
  if (!Repost(slot)) return;
  Replenish();
  MaybeSendCredits();
}

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
        Fail(absl::UnavailableError(absl::StrCat(
            "connection lost: receive completed with ",
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
      Protocol(absl::StrFormat("WRITE_WITH_IMM for unknown rendezvous %d",
                               cookie));
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
  if (h.credit_acks - credit_msgs_acked_ <= credit_msgs_sent_ - credit_msgs_acked_) {
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
        Protocol(absl::StrFormat("rendezvous of %d bytes exceeds our maximum %d",
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
            lb->mem, h.length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
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

void ConnectionImpl::Fail(absl::Status why) {
  if (!status_.ok()) return;
  COVERBS_CM_TRACE(name_, ": down: ", why.ToString());
  status_ = std::move(why);
  // Stop posting at once (siw never completes WRs posted after a peer
  // TERMINATE) and flush what is posted.
  if (!qp_->in_error()) qp_->SetError(std::string(status_.message())).IgnoreError();
  if (link_ != nullptr) link_->Disconnect();
  // Wake every waiter; they see status_.
  may_send_.Set();
  credits_.Release(1 << 24);
  ready_count_.Release(1 << 24);
  rts_window_.Release(1 << 24);
  for (PendingRts* pr : pending_rts_) pr->cts.Set();
  pending_rts_.clear();
  // Rendezvous that will never finish.
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    if (!it->ready) {
      delete it->large;
      it = incoming_.erase(it);
    } else {
      ++it;
    }
  }
}

void ConnectionImpl::Abort(absl::Status why) {
  Fail(std::move(why));
  // The owner is gone, so nobody will Close: internal tasks still waiting
  // for their work requests keep this connection (and its QP on the
  // Context's CQ) alive until the flushes come, which on siw after a peer
  // TERMINATE is never. Destroying the QP now ends the NIC's access and
  // completes them, so the connection goes before its Context can.
  if (qp_->outstanding() > 0) {
    COVERBS_CM_TRACE(name_, ": destroyed with ", qp_->outstanding(),
                     " WRs posted; abandoning the QP");
    qp_->Abandon("the connection was destroyed");
  }
}

Task<absl::Status> ConnectionImpl::SendParts(
    std::span<const std::span<const std::byte>> parts) {
  size_t total = 0;
  for (auto p : parts) total += p.size();
  absl::Status s = CheckUp("send");
  if (!s.ok()) co_return s;
  if (total > peer_max_) {
    co_return absl::InvalidArgumentError(absl::StrFormat(
        "send on %s: message of %d bytes exceeds the maximum %d (local %d, "
        "peer %d)",
        name_, total, peer_max_, options_.max_message_size,
        peer_.handshake.max_message_size));
  }
  if (total <= options_.rendezvous_threshold) {
    co_return co_await SendSmall(kData, 0, parts);
  }
  co_return co_await SendLarge(parts, nullptr);
}

Task<absl::Status> ConnectionImpl::SendRegistered(LocalBuffer b) {
  absl::Status s = CheckUp("send");
  if (!s.ok()) co_return s;
  if (b.length > peer_max_) {
    co_return absl::InvalidArgumentError(absl::StrFormat(
        "send on %s: message of %d bytes exceeds the maximum %d", name_,
        b.length, peer_max_));
  }
  if (b.length <= options_.rendezvous_threshold) {
    co_return co_await SendSmall(kData, 0, {}, &b);
  }
  co_return co_await SendLarge({}, &b);
}

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
      auto mr = ctx_.pd().Register(const_cast<std::byte*>(p.data()), p.size(),
                                   0);
      if (!mr.ok()) co_return OpError("send (registering the payload)",
                                      mr.status());
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

Task<absl::Status> ConnectionImpl::OneSided(bool read, LocalBuffer local,
                                            RemoteRegion r) {
  const char* op = read ? "RDMA READ" : "RDMA WRITE";
  absl::Status s = CheckUp(op);
  if (!s.ok()) co_return s;
  // Not `read ? co_await a : co_await b`: gcc 12 miscompiles co_await in
  // both arms of a conditional (the result was garbage).
  absl::StatusOr<transport::WorkCompletion> wc;
  if (read) {
    wc = co_await qp_->Read(local, r);
  } else {
    wc = co_await qp_->Write(local, r);
  }
  if (!wc.ok()) co_return OpError(op, wc.status());
  co_return absl::OkStatus();
}

Task<absl::StatusOr<uint64_t>> ConnectionImpl::Atomic(bool cas,
                                                      RemoteRegion r,
                                                      uint64_t a, uint64_t b) {
  const char* op = cas ? "COMPARE_SWAP" : "FETCH_ADD";
  if (!qp_->caps().atomics) {
    co_return absl::FailedPreconditionError(absl::StrCat(
        op, " on ", name_, ": device ", qp_->caps().device_name,
        " has no atomics"));
  }
  absl::Status s = CheckUp(op);
  if (!s.ok()) co_return s;
  s = co_await atomic_slots_.Acquire(1);
  if (!s.ok()) co_return s;
  uint32_t i = atomic_free_.back();
  atomic_free_.pop_back();
  LocalBuffer res = atomic_mr_.Local(i * sizeof(uint64_t), sizeof(uint64_t));
  absl::StatusOr<transport::WorkCompletion> wc;
  if (cas) {
    wc = co_await qp_->CompareSwap(res, r, a, b);
  } else {
    wc = co_await qp_->FetchAdd(res, r, a);
  }
  uint64_t v = atomic_mem_[i];
  atomic_free_.push_back(i);
  atomic_slots_.Release(1);
  if (!wc.ok()) co_return OpError(op, wc.status());
  co_return v;
}

Task<absl::Status> ConnectionImpl::Close() {
  if (closing_) {
    co_return absl::OkStatus();
  }
  absl::Duration t = options_.close_timeout;
  COVERBS_CM_TRACE(name_, ": Close: status ", status_.ToString(), ", peer_closed ",
                   peer_closed_, ", outstanding WRs ", qp_->outstanding());
  if (status_.ok() && started_ && !peer_closed_) {
    // Goodbye first, so the peer reports "closed by the peer", not a loss.
    auto bye = [](ConnectionImpl* self) -> Task<absl::Status> {
      co_await self->SendControl(kGoodbye, 0, 0, {});
      co_return absl::OkStatus();
    };
    absl::Status s = co_await WithTimeout(bye(this), t);
    (void)s;  // a peer that cannot take it is gone anyway
  }
  closing_ = true;
  Fail(absl::UnavailableError("closed locally"));  // no-op if already down
  absl::Status result;
  if (link_ != nullptr) {
    link_->Disconnect();
    absl::Status s = co_await link_->WaitDown(t);
    if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) result = s;
  }
  // Every posted work request completes (flushed) before the buffers go;
  // a device that lost some (siw after the peer's TERMINATE) gets its QP
  // destroyed, which also ends the NIC's access, and the rest completed.
  qp_->SetError("closed").IgnoreError();
  absl::Time until = absl::Now() + t;
  while (qp_->outstanding() > 0 && absl::Now() < until) {
    co_await ctx_.reactor().Sleep(absl::Milliseconds(1));
  }
  if (qp_->outstanding() > 0) {
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
  co_return result;
}

// Runs once the Connection and every internal task are gone.
ConnectionImpl::~ConnectionImpl() {
  if (status_.ok()) Fail(absl::UnavailableError("connection destroyed"));
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
}

}  // namespace internal

// ---------------------------------------------------------------------------
// Message

Message::Message(Message&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      owner_(std::exchange(o.owner_, nullptr)) {}

Message& Message::operator=(Message&& o) noexcept {
  if (this != &o) {
    if (owner_ != nullptr) owner_->Release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    owner_ = std::exchange(o.owner_, nullptr);
  }
  return *this;
}

Message::~Message() {
  if (owner_ != nullptr) owner_->Release();
}

// ---------------------------------------------------------------------------
// RegionToken

std::string RegionToken::Encode() const {
  std::string out(kEncodedSize, '\0');
  std::memcpy(out.data(), &region.addr, 8);
  std::memcpy(out.data() + 8, &region.length, 8);
  std::memcpy(out.data() + 16, &region.rkey, 4);
  return out;
}

absl::StatusOr<RegionToken> RegionToken::Decode(
    std::span<const std::byte> data) {
  if (data.size() != kEncodedSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "region token: %d bytes, expected %d", data.size(), kEncodedSize));
  }
  RegionToken t;
  std::memcpy(&t.region.addr, data.data(), 8);
  std::memcpy(&t.region.length, data.data() + 8, 8);
  std::memcpy(&t.region.rkey, data.data() + 16, 4);
  if (t.region.length == 0 || t.region.addr + t.region.length < t.region.addr) {
    return absl::InvalidArgumentError("region token: empty or wrapping range");
  }
  return t;
}

// ---------------------------------------------------------------------------
// Connection

Connection::Connection(std::shared_ptr<internal::ConnectionImpl> impl)
    : impl_(std::move(impl)) {}
// Internal tasks (control sends) keep the state alive until they end; the
// abort wakes or flushes all of them.
Connection::~Connection() {
  impl_->Abort(absl::UnavailableError("connection destroyed"));
}

Task<absl::Status> Connection::Send(std::span<const std::byte> payload) {
  std::span<const std::byte> parts[1] = {payload};
  co_return co_await impl_->SendParts(parts);
}
Task<absl::Status> Connection::SendV(
    std::span<const std::span<const std::byte>> parts) {
  return impl_->SendParts(parts);
}
Task<absl::Status> Connection::Send(transport::LocalBuffer registered) {
  return impl_->SendRegistered(registered);
}
Task<absl::StatusOr<Message>> Connection::Recv() { return impl_->Recv(); }

absl::StatusOr<RegionToken> Connection::Expose(const transport::MemoryRegion& mr,
                                               int access, size_t offset,
                                               size_t length) {
  constexpr int kRemote =
      IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  if (!mr.valid()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expose on ", name(), ": the region is not registered"));
  }
  if ((access & ~kRemote) != 0 || access == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expose on ", name(),
        ": access must be a non-empty set of IBV_ACCESS_REMOTE_* flags"));
  }
  if ((mr.access() & access) != access) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: the region was registered with access 0x%x, which "
        "lacks 0x%x",
        name(), mr.access(), access & ~mr.access()));
  }
  if (offset > mr.length()) {
    return absl::OutOfRangeError(absl::StrCat("expose on ", name(),
                                              ": offset beyond the region"));
  }
  RegionToken t;
  t.region = mr.Remote(offset, length);
  return t;
}

Task<absl::Status> Connection::Read(transport::LocalBuffer local,
                                    transport::RemoteRegion remote) {
  return impl_->OneSided(true, local, remote);
}
Task<absl::Status> Connection::Write(transport::LocalBuffer local,
                                     transport::RemoteRegion remote) {
  return impl_->OneSided(false, local, remote);
}
Task<absl::StatusOr<uint64_t>> Connection::FetchAdd(
    transport::RemoteRegion remote, uint64_t add) {
  return impl_->Atomic(false, remote, add, 0);
}
Task<absl::StatusOr<uint64_t>> Connection::CompareSwap(
    transport::RemoteRegion remote, uint64_t compare, uint64_t swap) {
  return impl_->Atomic(true, remote, compare, swap);
}
Task<absl::Status> Connection::Close() { return impl_->Close(); }

absl::Status Connection::status() const { return impl_->status(); }
const PeerInfo& Connection::peer() const { return impl_->peer(); }
Context& Connection::context() const { return impl_->context(); }
transport::QueuePair& Connection::qp() const { return impl_->qp(); }
const std::string& Connection::name() const { return impl_->name(); }
Connection::Stats Connection::stats() const { return impl_->stats(); }

absl::StatusOr<transport::QpOptions> Connection::QpOptionsFor(
    Context& ctx, const ConnectionOptions& o) {
  transport::QpOptions q = o.qp;
  if (o.use_srq) {
    auto pool = internal::SrqPool::For(ctx);
    if (!pool.ok()) return pool.status();
    q.srq = (*pool)->srq->provider();
  }
  const transport::DeviceCaps& caps = ctx.device().caps();
  // The send queue only bounds how much is posted at once (the QueuePair
  // queues the rest); credits bound what the peer must absorb.
  uint32_t send = o.send_depth + internal::kCreditReserve + internal::kCtsReserve + 4;
  uint32_t recv = o.recv_credits + internal::kCreditReserve + internal::kCtsReserve;
  if (caps.max_qp_wr != 0) {
    send = std::min(send, caps.max_qp_wr);
    recv = std::min(recv, caps.max_qp_wr);
  }
  q.max_send_wr = send;
  q.max_recv_wr = recv;
  q.max_send_sge = std::max<uint32_t>(q.max_send_sge, 2);
  if (caps.max_sge != 0) q.max_send_sge = std::min(q.max_send_sge, caps.max_sge);
  q.max_recv_sge = 1;
  return q;
}

absl::StatusOr<std::unique_ptr<Connection>> Connection::CreateUnstarted(
    Context& ctx, std::unique_ptr<transport::QueuePair> qp,
    const ConnectionOptions& o, bool active_side) {
  auto impl = std::make_shared<internal::ConnectionImpl>(ctx, std::move(qp), o,
                                                         active_side);
  absl::Status s = impl->Init();
  if (!s.ok()) return s;
  return std::unique_ptr<Connection>(new Connection(std::move(impl)));
}

Handshake Connection::LocalHandshake() const { return impl_->LocalHandshake(); }

absl::Status Connection::Start(PeerInfo peer,
                               std::unique_ptr<transport::ConnectionLink> link) {
  return impl_->Start(std::move(peer), std::move(link));
}

}  // namespace coverbs::cm
