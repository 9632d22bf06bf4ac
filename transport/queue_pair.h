// QueuePair: an RC queue pair whose operations are awaitables.
//
//   absl::StatusOr<WorkCompletion> wc = co_await qp.Send(buf);
//   co_await qp.Write(local, remote);          // RDMA WRITE
//   co_await qp.Read(local, remote);           // RDMA READ
//   co_await qp.FetchAdd(result8, remote, 1);  // atomics, if caps().atomics
//
// Contract:
//  - Every operation yields absl::StatusOr<WorkCompletion>. A failed
//    completion becomes a Status naming the operation, the QP and
//    ibv_wc_status_str; transport::WcStatusOf() gives the exact status.
//  - The operation state (WR, SGEs, awaiting coroutine) lives in the
//    awaiter, i.e. in the coroutine frame; wr_id points at it. Buffers named
//    by an operation stay owned by it until its completion arrived: the
//    coroutine is not resumed before, whatever happens (flush included).
//  - Send-queue slots are accounted exactly. An operation that does not fit
//    waits (FIFO) until completions free slots; it never fails because the
//    queue is full. The same holds for the receive queue and for CQ space.
//  - Selective signaling: PostBatch() posts a list of WRs in one call with
//    only the last one signaled; its completion retires the whole batch.
//  - When the QP enters the error state, every outstanding operation
//    completes with IBV_WC_WR_FLUSH_ERR (Aborted), in order; operations
//    waiting for slots fail with FailedPrecondition.
//  - Cancellation (the awaiting coroutine's stop token): a posted work
//    request cannot be taken back from a NIC, so cancelling an operation
//    moves the QP to the error state; the operation then completes (flushed)
//    and yields Cancelled. Operations still waiting for a slot are simply
//    withdrawn. Either way the buffer is free once the coroutine resumes.
//  - Close() moves the QP to error and waits until every operation has
//    completed; the destructor does the same synchronously (bounded) if
//    Close() was not awaited, so the NIC never touches freed memory.
//  - Single reactor: a QueuePair is used from the reactor of its CQ.
#ifndef COVERBS_TRANSPORT_QUEUE_PAIR_H_
#define COVERBS_TRANSPORT_QUEUE_PAIR_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <coroutine>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/intrusive.h"
#include "core/reactor.h"
#include "core/sync.h"
#include "core/task.h"
#include "transport/completion_queue.h"
#include "transport/device.h"
#include "transport/errors.h"
#include "transport/provider.h"

namespace coverbs::transport {

// What a successful operation reports.
struct WorkCompletion {
  ibv_wc_opcode opcode = IBV_WC_SEND;
  uint32_t byte_len = 0;
  // Immediate data in host byte order (SEND_WITH_IMM, WRITE_WITH_IMM).
  std::optional<uint32_t> imm;
  // A SEND_WITH_INV's rkey, which the receiving device invalidated.
  std::optional<uint32_t> invalidated_rkey;
  uint32_t qp_num = 0;
};

struct QpOptions {
  uint32_t max_send_wr = 256;
  uint32_t max_recv_wr = 256;
  uint32_t max_send_sge = 4;
  uint32_t max_recv_sge = 4;
  // Clamped to the device's (rxe offers 512, siw 80, soft 256). 128 lets
  // a 64 B message with the messaging layer's 16 B header and an rpc
  // call's 32 B more go inline (perftest's latency tests inline 236 B).
  uint32_t max_inline_data = 128;
  uint8_t rnr_retry = 7;  // 7 = retry forever
  uint8_t min_rnr_timer = 12;
  // RC retransmission: a request unacknowledged for `timeout` (4.096 us x
  // 2^timeout; 14 = 67 ms) is sent again, at most retry_cnt times, then the
  // QP fails with IBV_WC_RETRY_EXC_ERR. rdma_cm connections get both (the
  // connecting side's retry_cnt serves both QPs). rxe treats retry_cnt 7 as
  // "forever" (cm/README.md, "A silent peer"); iWARP retransmits by TCP
  // and has neither.
  uint8_t retry_cnt = 7;
  uint8_t timeout = 14;
  ProviderSrq* srq = nullptr;  // receive through a shared receive queue
  // Once the QP is in the error state, every posted work request must come
  // back flushed within this time; if not (siw loses the WRs of a QP whose
  // peer sent TERMINATE), the QP is abandoned (see Abandon) so that no
  // coroutine -- a cancelled operation included -- waits forever.
  absl::Duration flush_timeout = absl::Seconds(2);
};

struct SendOptions {
  // Copy the payload into the WR at post time (must fit max_inline_data).
  bool inline_data = false;
  std::optional<uint32_t> imm;  // host byte order
  bool fence = false;
  // Ignore the awaiting coroutine's stop token: once posted, the send waits
  // for its completion, which the transport bounds (the peer's ack, else
  // the retry timer or a flush). For senders whose cancellation must not
  // put the QP in the error state (a connection's messages); it also saves
  // a stop-callback registration per send.
  bool ignore_stop = false;
};

class QueuePair;
class SendBatch;

namespace internal_qp {

constexpr int kInlineSges = 4;

// Everything needed to build one work request (or a batch).
struct OpSpec {
  const char* name = "WR";
  bool recv = false;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  std::span<const LocalBuffer> bufs;
  RemoteRegion remote;
  uint64_t compare_add = 0;
  uint64_t swap = 0;
  std::optional<uint32_t> imm;
  unsigned send_flags = 0;
  SendBatch* batch = nullptr;
  bool cancellable = true;  // SendOptions::ignore_stop
  absl::Status error;       // set when the request is invalid: fails unposted
};

// State of one posted operation; lives in the awaiting coroutine's frame.
// Neither copied nor moved: QueuePair methods return it as a prvalue.
class OpBase : public WorkRequest, public coverbs::internal::ListNode<OpBase> {
 public:
  OpBase(QueuePair* qp, const OpSpec& spec);
  // A SEND of 1..kInlineSges buffers without immediate data, within the
  // QP's SGE and inline limits (QueuePair::Send checks): what a connection
  // posts per message, built without an OpSpec, its Status and its checks.
  OpBase(QueuePair* qp, std::span<const LocalBuffer> bufs,
         const SendOptions& o);
  OpBase(const OpBase&) = delete;
  ~OpBase();

  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    // Not copying a token nobody watches saves its atomic count updates.
    if (!cancellable_) return Suspend(h, std::stop_token());
    return Suspend(h, coverbs::internal::StopTokenOf(h));
  }
  absl::StatusOr<WorkCompletion> await_resume();
  // await_resume for a caller that needs only whether the operation
  // succeeded: no WorkCompletion built.
  absl::Status TakeStatus() {
    cb_.reset();
    return early_;
  }
  // Posting before waiting (a caller with something else to await first;
  // stop tokens are not watched, as with SendOptions::ignore_stop):
  // Post() is await_suspend without a coroutine to resume (false: the
  // operation already completed, failed); completed() says whether the
  // completion came; Wait(h) makes `h` the coroutine it resumes (call it
  // only while !completed(), on the reactor thread).
  bool Post() { return Suspend(std::coroutine_handle<>(), std::stop_token()); }
  bool completed() const { return completed_; }
  void Wait(std::coroutine_handle<> h) { waiter_ = h; }

  void OnCompletion(const ibv_wc& wc) override;

 protected:
  friend class coverbs::transport::QueuePair;
  bool Suspend(std::coroutine_handle<> h, std::stop_token token);
  void Fail(absl::Status s);  // completes without a posted WR
  void Resume();

  struct Canceller {
    OpBase* op;
    void operator()() const noexcept;
  };

  QueuePair* qp_;
  bool is_recv_;
  bool destroying_ = false;
  bool cancellable_ = true;
  // Work request (send or recv) and its SGEs. The constructor initializes
  // only the request in use (an op is built per message: zeroing both
  // and a vector of SGEs was most of its cost).
  ibv_send_wr swr_;
  ibv_recv_wr rwr_;
  ibv_sge sge_inline_[kInlineSges];
  std::unique_ptr<ibv_sge[]> sge_heap_;  // more than kInlineSges
  const char* name_ = "WR";
  uint32_t slots_ = 1;  // SQ/RQ slots this op holds (batches: >1)
  uint32_t qp_num_ = 0;
  // Outcome. wc_ is set by OnCompletion before anything reads it.
  ibv_wc wc_;
  bool completed_ = false;
  bool posted_ = false;
  std::atomic<bool> cancelled_{false};
  absl::Status early_;  // failed before posting
  std::coroutine_handle<> waiter_;
  Reactor* reactor_ = nullptr;
  std::optional<std::stop_callback<Canceller>> cb_;
  // Batches: the first error among the batch's completions.
  std::optional<ibv_wc> first_error_;
  uint32_t nonterminal_seen_ = 0;
  SendBatch* batch_ = nullptr;
};

}  // namespace internal_qp

// A receive whose completion goes to a handler instead of a coroutine (the
// messaging layer keeps a ring of these posted). Must stay alive until its
// completion was delivered (or the QP was closed).
class SharedReceiveQueue;
class RecvHandler : public WorkRequest,
                    public coverbs::internal::ListNode<RecvHandler> {
 public:
  virtual void OnRecv(const ibv_wc& wc) = 0;

 protected:
  ~RecvHandler() = default;

 private:
  friend class QueuePair;
  friend class SharedReceiveQueue;
  void OnCompletion(const ibv_wc& wc) final;
  QueuePair* qp_ = nullptr;
  SharedReceiveQueue* srq_ = nullptr;
};

// A receive queue shared by many QPs (servers with many connections post
// one pool of receives instead of one per connection). Receives complete to
// RecvHandlers on the CQ of whichever QP the message arrived on; `cq` is
// the CQ those QPs use (its entries are reserved for the SRQ's depth).
// Create QPs with QpOptions::srq = srq->provider(). Destroy those QPs
// first; destroying the SRQ discards the receives still posted (their
// handlers are never called; free their buffers after).
class SharedReceiveQueue {
 public:
  static absl::StatusOr<std::unique_ptr<SharedReceiveQueue>> Create(
      ProtectionDomain& pd, CompletionQueue& cq, uint32_t max_wr,
      uint32_t max_sge = 1);
  ~SharedReceiveQueue();

  // Fails with ResourceExhausted when `max_wr` receives are posted.
  absl::Status PostRecv(RecvHandler* h, std::span<const LocalBuffer> bufs);
  ProviderSrq* provider() const { return srq_.get(); }
  uint32_t capacity() const { return max_wr_; }
  uint32_t posted() const { return posted_; }

 private:
  friend class RecvHandler;
  SharedReceiveQueue(std::unique_ptr<ProviderSrq> srq, CompletionQueue* cq,
                     uint32_t max_wr)
      : srq_(std::move(srq)), cq_(cq), max_wr_(max_wr) {}
  std::unique_ptr<ProviderSrq> srq_;
  CompletionQueue* cq_;
  uint32_t max_wr_;
  uint32_t posted_ = 0;
};

// A list of send-queue work requests posted with one post call and one
// signaled completion (the last). Build it, then co_await qp.PostBatch(b).
class SendBatch {
 public:
  // Each Add* copies the SGE; the memory must stay valid until the batch
  // completes.
  void AddSend(LocalBuffer buf, std::optional<uint32_t> imm = std::nullopt);
  void AddWrite(LocalBuffer buf, RemoteRegion remote,
                std::optional<uint32_t> imm = std::nullopt);
  void AddRead(LocalBuffer buf, RemoteRegion remote);
  // Binds `mw` to `range` of `mr` (registered with IBV_ACCESS_MW_BIND)
  // with `access` (IBV_ACCESS_REMOTE_WRITE, ...) and returns the window's
  // new rkey, valid from the next WR of the batch on: announce it in a
  // later SEND. Needs DeviceCaps::memory_windows (else the batch fails).
  uint32_t AddBind(MemoryWindow& mw, const MemoryRegion& mr,
                   std::span<std::byte> range, int access);
  // Ends the bind of our window `rkey` (bound through this QP): later
  // accesses with it fail with a remote access error. Needs
  // DeviceCaps::memory_windows.
  void AddLocalInvalidate(uint32_t rkey);
  // A SEND that invalidates `rkey` on the receiver (a window it bound for
  // this transfer). Needs DeviceCaps::send_with_invalidate.
  void AddSendWithInvalidate(LocalBuffer buf, uint32_t rkey);
  size_t size() const { return wrs_.size(); }
  // Empties the batch for reuse; storage grown past the inline room is
  // kept, so a batch reused for the same kind of post allocates once.
  void Clear() {
    wrs_.resize(0);
    sges_.resize(0);
  }

 private:
  friend class QueuePair;
  // Inline room for the usual batch (a landed message is a WRITE and its
  // header SEND): building one allocates nothing.
  absl::InlinedVector<ibv_send_wr, 4> wrs_;
  absl::InlinedVector<ibv_sge, 4> sges_;
};

class QueuePair final : private WrOwner {
 public:
  using Op = internal_qp::OpBase;

  // A connected pair for tests and benchmarks (no cm layer): the provider
  // connects them (soft: a loopback TCP connection; verbs: rdma_cm on the
  // test address). On iWARP the `b` side must send first.
  static absl::StatusOr<
      std::pair<std::unique_ptr<QueuePair>, std::unique_ptr<QueuePair>>>
  CreatePair(ProtectionDomain& pd_a, CompletionQueue& cq_a,
             ProtectionDomain& pd_b, CompletionQueue& cq_b,
             const QpOptions& options = {});

  // Adopts a connected provider QP (the cm layer builds those). `cq` takes
  // its send completions, and its receive completions unless `recv_cq` is
  // given -- only for a QP on a shared receive queue, whose receive
  // completions go to the CQ that queue's receives are counted on (the
  // connection layer spreads QPs' send completions over several CQs).
  static absl::StatusOr<std::unique_ptr<QueuePair>> Adopt(
      std::unique_ptr<ProviderQp> qp, CompletionQueue& cq,
      const QpOptions& options, std::shared_ptr<void> keepalive = nullptr,
      CompletionQueue* recv_cq = nullptr);

  ~QueuePair();
  QueuePair(const QueuePair&) = delete;

  // --- Two-sided.
  Op Send(std::span<const LocalBuffer> bufs, SendOptions o = {});
  Op Send(LocalBuffer buf, SendOptions o = {}) {
    if (!o.imm && (!o.inline_data || buf.length <= max_inline_) &&
        options_.max_send_sge >= 1) {
      return Op(this, std::span<const LocalBuffer>(&buf, 1), o);
    }
    return Send(std::span<const LocalBuffer>(&buf, 1), o);
  }
  Op Recv(std::span<const LocalBuffer> bufs);
  Op Recv(LocalBuffer buf) {
    return Recv(std::span<const LocalBuffer>(&buf, 1));
  }
  // A SEND of 1..4 buffers whose bytes (at most max_inline_data() in all)
  // the provider copies into the work request at post time, and that
  // nobody awaits: the buffers may be reused once this returns, and the QP
  // takes the completion itself -- the slot comes back, and a failure puts
  // the QP in the error state (its reason in inline_send_error()), which
  // flushes everything else posted. What a messaging layer posts per small
  // message without an operation, a frame or a resume per message. RC
  // delivers in order, so a later awaited Send's completion still means
  // every earlier inline send arrived. Fails without posting:
  // FailedPrecondition in the error state, ResourceExhausted while the send
  // queue has no free slot or awaited operations wait for one (post an awaited
  // Send then, which queues in order), InvalidArgument beyond the limits.
  absl::Status PostInlineSend(std::span<const LocalBuffer> bufs);
  // The first failure (not a flush) of a PostInlineSend's completion; OK
  // while there was none.
  const absl::Status& inline_send_error() const { return inline_error_; }
  // Whether a send posted now would go at once (up, a slot free, nobody
  // queued for one): PostInlineSend cannot then be refused for room.
  bool CanPostSendNow() const {
    return !in_error_ && qp_ != nullptr && sq_free_ > 0 &&
           send_waiters_.empty();
  }
  uint32_t inline_sends_in_flight() const { return inline_in_flight_; }
  // Binds `mw` to `range` of `mr` (registered with IBV_ACCESS_MW_BIND) with
  // remote `access`, posted now and awaited by nobody, like
  // PostInlineSend (same refusals; a failed bind puts the QP in the error
  // state, its reason in inline_send_error()). Yields the window's new
  // rkey, valid for the peer from the next WR posted on this QP (send the
  // token there: RC ordering executes the bind first). Needs
  // DeviceCaps::memory_windows.
  absl::StatusOr<uint32_t> PostBind(MemoryWindow& mw, const MemoryRegion& mr,
                                    std::span<std::byte> range, int access);

  // --- One-sided.
  Op Write(std::span<const LocalBuffer> bufs, RemoteRegion remote);
  Op Write(LocalBuffer buf, RemoteRegion remote) {
    return Write(std::span<const LocalBuffer>(&buf, 1), remote);
  }
  // Consumes a receive on the peer, which completes with the immediate.
  Op WriteWithImm(LocalBuffer buf, RemoteRegion remote, uint32_t imm);
  Op Read(std::span<const LocalBuffer> bufs, RemoteRegion remote);
  Op Read(LocalBuffer buf, RemoteRegion remote) {
    return Read(std::span<const LocalBuffer>(&buf, 1), remote);
  }
  // 8-byte atomics on an 8-byte aligned remote address; the original remote
  // value lands in `result` (8 bytes, registered with LOCAL_WRITE).
  Op CompareSwap(LocalBuffer result, RemoteRegion remote, uint64_t compare,
                 uint64_t swap);
  Op FetchAdd(LocalBuffer result, RemoteRegion remote, uint64_t add);

  // --- Selective signaling: one post call, one completion for the batch.
  // Yields the last WR's completion, or the first error in the batch.
  // `ignore_stop` as in SendOptions: once posted, the batch waits for its
  // completion whatever the awaiting coroutine's stop token says.
  Op PostBatch(SendBatch& batch, bool ignore_stop = false);

  // --- Receives that complete into a handler instead of a coroutine (the
  // messaging layer pre-posts its receive ring this way). `wr` must stay
  // alive until its completion was delivered.
  // Fails with ResourceExhausted when the receive queue is full.
  absl::Status PostRecv(RecvHandler* h, std::span<const LocalBuffer> bufs);
  // Up to kMaxRecvBatch receives with one post call, `hs[i]` into the single
  // buffer `bufs[i]`: a receiver that refills its ring in batches pays the
  // post (and the provider's queue lock) once per batch, not per message.
  // Refused as a whole (nothing posted) when the QP is in error or the
  // receive queue has no room for all of them. If the provider refuses a
  // receive of the chain, the ones before it stay posted and complete as
  // usual; the error says how many were.
  static constexpr size_t kMaxRecvBatch = 32;
  absl::Status PostRecvs(std::span<RecvHandler* const> hs,
                         std::span<const LocalBuffer> bufs);

  // Moves the QP to the error state (flushes everything outstanding).
  absl::Status SetError(std::string_view reason = "requested");
  // SetError, then wait until every outstanding operation completed.
  Task<absl::Status> Close();
  // For devices that lose work requests once the connection died (siw
  // after a peer TERMINATE completes nothing posted afterwards, not even
  // with a flush): destroys the QP in the provider -- after which the NIC
  // touches none of its buffers -- then completes every operation and
  // handler receive still outstanding with IBV_WC_WR_FLUSH_ERR, so no
  // coroutine waits forever. Later operations fail at once. The destructor
  // does this itself when the flush does not come.
  void Abandon(std::string_view reason);

  uint32_t qp_num() const { return qp_num_; }
  const DeviceCaps& caps() const { return cq_->device()->caps(); }
  CompletionQueue* cq() const { return cq_; }
  // Polls this QP's CQ (and its receive CQ when that is another) once;
  // the number of completions taken, of any QP on them.
  int PollCompletions() {
    int n = cq_->Poll();
    if (rcq_ != cq_) n += rcq_->Poll();
    return n;
  }
  ProviderQp* provider() const { return qp_.get(); }
  bool in_error() const { return in_error_; }
  uint32_t send_capacity() const { return sq_capacity_; }
  uint32_t send_slots_free() const { return sq_free_; }
  uint32_t recv_slots_free() const { return rq_free_; }
  // Operations posted and not yet completed (any queue).
  uint64_t outstanding() const { return outstanding_; }
  uint32_t max_inline_data() const { return max_inline_; }

 private:
  friend class internal_qp::OpBase;
  QueuePair(std::unique_ptr<ProviderQp> qp, CompletionQueue* cq,
            const QpOptions& options, std::shared_ptr<void> keepalive);

  friend class RecvHandler;
  // Posts `op` now if slots allow, else queues it. Returns false if the op
  // completed synchronously (error) and the caller must not suspend.
  // Fails `spec` (unposted) if it names more SGEs than `limit`.
  void LimitSges(internal_qp::OpSpec& spec, const char* limit_name,
                 uint32_t limit) const;
  bool Start(Op* op);
  absl::Status PostNow(Op* op);
  void CancelOp(Op* op);
  void Release(Op* op);
  void PumpWaiters();
  void FailWaiters(const absl::Status& s);
  void OnOpDone();
  // Counts handler receives that the provider took.
  void TrackRecvs(std::span<RecvHandler* const> hs);
  // Polls the CQ synchronously (bounded) until `done`; for destruction
  // paths that cannot suspend.
  void DrainSync(const std::function<bool()>& done);
  // WrOwner: walks the posted lists (error completions only).
  bool HasPosted(const WorkRequest* wr, const ibv_wc& wc) const override;
  absl::Status RefuseInlineSend(std::span<const LocalBuffer> bufs) const;

  // Takes the completions of PostInlineSend: one per QP (its wr_id), the
  // sends counted, not named -- RC completes a send queue in order.
  struct InlineSink final : WorkRequest {
    QueuePair* qp = nullptr;
    void OnCompletion(const ibv_wc& wc) override;
  };

  std::unique_ptr<ProviderQp> qp_;
  CompletionQueue* cq_;
  CompletionQueue* rcq_;  // receive completions; == cq_ unless on an SRQ
  std::shared_ptr<void> keepalive_;
  QpOptions options_;
  uint32_t qp_num_;
  uint32_t sq_capacity_, rq_capacity_;
  uint32_t sq_free_, rq_free_;
  uint32_t max_inline_;
  bool uses_srq_;
  int cq_reserved_ = 0;
  bool in_error_ = false;
  uint64_t outstanding_ = 0;
  coverbs::internal::IntrusiveList<Op> send_waiters_;
  coverbs::internal::IntrusiveList<Op> recv_waiters_;
  // Posted and not completed (for Abandon).
  coverbs::internal::IntrusiveList<Op> posted_ops_;
  coverbs::internal::IntrusiveList<RecvHandler> posted_handlers_;
  uint32_t handler_recvs_ = 0;
  InlineSink inline_sink_;
  // PostInlineSend's work request, its fixed fields set once.
  ibv_send_wr inline_wr_;
  ibv_sge inline_sge_[internal_qp::kInlineSges];
  uint32_t inline_sges_ = 0;  // most buffers per inline send
  uint32_t inline_in_flight_ = 0;
  absl::Status inline_error_;
  bool closing_ = false;
  std::unique_ptr<Event> drained_;
  // Lets a cross-thread cancellation find out whether the QP still exists.
  std::shared_ptr<QueuePair*> alive_;
  // Armed when the QP enters the error state with work requests posted.
  struct FlushWatchdog final : coverbs::internal::TimerNode {
    QueuePair* qp = nullptr;
    void OnTimer() override;
  };
  FlushWatchdog flush_watchdog_;
  void DisarmFlushWatchdog();
  // Arms the watchdog once the QP is in the error state with work requests
  // posted (SetError, or a failed completion).
  void WatchFlushes();
};

// StatusOf op{qp.Send(...)}; co_await op: the operation's outcome as a
// Status, without the WorkCompletion (for callers that need only whether
// it succeeded; building it was ~40 instructions per message). The
// operation is built in place. Name it: gcc 12 mis-copies braced
// temporaries inside a co_await expression (elsewhere in coverbs), and one
// callgrind run with `co_await StatusOf{...}` in SendSmall hung.
struct StatusOf {
  QueuePair::Op op;
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    return op.await_suspend(h);
  }
  absl::Status await_resume() { return op.TakeStatus(); }
};

namespace internal_qp {
// Inline: built per message, into the caller's frame.
inline OpBase::OpBase(QueuePair* qp, std::span<const LocalBuffer> bufs,
                      const SendOptions& o)
    : qp_(qp),
      is_recv_(false),
      cancellable_(!o.ignore_stop),
      name_("SEND"),
      qp_num_(qp->qp_num()) {
  for (size_t i = 0; i < bufs.size(); ++i) sge_inline_[i] = bufs[i].sge();
  swr_ = ibv_send_wr{};
  swr_.wr_id = reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(this)) | 1;
  swr_.sg_list = sge_inline_;
  swr_.num_sge = static_cast<int>(bufs.size());
  swr_.opcode = IBV_WR_SEND;
  swr_.send_flags = (o.inline_data ? IBV_SEND_INLINE : 0) |
                    (o.fence ? IBV_SEND_FENCE : 0) | IBV_SEND_SIGNALED;
}
}  // namespace internal_qp

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_QUEUE_PAIR_H_
