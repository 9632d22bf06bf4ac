// QueuePair and SharedReceiveQueue: the provider QP and the slots of its
// queues. Creation and adoption (CQ entries reserved), posting with exact
// slot accounting and FIFO back-pressure, receives that complete into a
// RecvHandler, the error state with its flush watchdog, Abandon, Close and
// the destructor's synchronous drain. The operation builders (Send, Write,
// ...) are in queue_pair_builders.cc; the awaitable operation itself
// (internal_qp::OpBase) in queue_pair_op.cc.
#include "transport/queue_pair.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/timeout.h"

namespace coverbs::transport {
namespace {

// Posts one receive whose completion goes to `h`, on a QP's own receive
// queue (ProviderQp) or a shared one (ProviderSrq).
template <typename ReceiveQueue>
absl::Status PostHandlerRecv(ReceiveQueue& queue, RecvHandler* h,
                             std::span<const LocalBuffer> bufs) {
  // Once per received message: SGEs on the stack, no vector; the usual
  // single buffer without even the array.
  ibv_recv_wr wr;
  wr.wr_id = reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(h)) | 1;
  wr.next = nullptr;
  wr.num_sge = static_cast<int>(bufs.size());
  ibv_recv_wr* bad = nullptr;
  if (bufs.size() == 1) {
    ibv_sge sge = bufs[0].sge();
    wr.sg_list = &sge;
    return queue.PostRecv(&wr, &bad);
  }
  ibv_sge inline_sges[internal_qp::kInlineSges];
  std::unique_ptr<ibv_sge[]> heap;
  ibv_sge* sges = inline_sges;
  if (bufs.size() > internal_qp::kInlineSges) {
    heap = std::make_unique<ibv_sge[]>(bufs.size());
    sges = heap.get();
  }
  for (size_t i = 0; i < bufs.size(); ++i) sges[i] = bufs[i].sge();
  wr.sg_list = sges;
  return queue.PostRecv(&wr, &bad);
}

}  // namespace

// ---------------------------------------------------------------------------
// RecvHandler

void RecvHandler::OnCompletion(const ibv_wc& wc) {
  if (SharedReceiveQueue* srq = srq_) {
    --srq->posted_;
    srq->cq_->AddInFlight(-1);
    OnRecv(wc);
    return;
  }
  QueuePair* qp = qp_;
  if (qp != nullptr) {
    if (linked()) qp->posted_handlers_.erase(this);
    ++qp->rq_free_;
    --qp->handler_recvs_;
    if (wc.status != IBV_WC_SUCCESS && !qp->in_error_) {
      qp->in_error_ = true;
      qp->FailWaiters(absl::FailedPreconditionError(absl::StrFormat(
          "QP 0x%x is in the error state (%s on a receive)", qp->qp_num_,
          WcStatusName(wc.status))));
    }
    qp->OnOpDone();
  }
  OnRecv(wc);
}

// ---------------------------------------------------------------------------
// SharedReceiveQueue

absl::StatusOr<std::unique_ptr<SharedReceiveQueue>> SharedReceiveQueue::Create(
    ProtectionDomain& pd, CompletionQueue& cq, uint32_t max_wr,
    uint32_t max_sge) {
  absl::Status r = cq.Reserve(static_cast<int>(max_wr));
  if (!r.ok()) return r;
  auto srq = pd.provider()->CreateSrq(max_wr, max_sge);
  if (!srq.ok()) {
    cq.Unreserve(static_cast<int>(max_wr));
    return srq.status();
  }
  return std::unique_ptr<SharedReceiveQueue>(
      new SharedReceiveQueue(*std::move(srq), &cq, max_wr));
}

SharedReceiveQueue::~SharedReceiveQueue() {
  // Destroying an SRQ discards its posted receives without completions
  // (unlike a QP's, they are not flushed): their handlers are never called.
  srq_.reset();
  cq_->AddInFlight(-static_cast<int>(posted_));
  cq_->Unreserve(static_cast<int>(max_wr_));
}

absl::Status SharedReceiveQueue::PostRecv(RecvHandler* h,
                                          std::span<const LocalBuffer> bufs) {
  if (posted_ >= max_wr_) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RECV on SRQ: all %u receives are posted", max_wr_));
  }
  absl::Status s = PostHandlerRecv(*srq_, h, bufs);
  if (!s.ok()) return s;
  h->srq_ = this;
  h->qp_ = nullptr;
  ++posted_;
  cq_->AddInFlight(1);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// QueuePair

absl::StatusOr<std::pair<std::unique_ptr<QueuePair>, std::unique_ptr<QueuePair>>>
QueuePair::CreatePair(ProtectionDomain& pd_a, CompletionQueue& cq_a,
                      ProtectionDomain& pd_b, CompletionQueue& cq_b,
                      const QpOptions& options) {
  auto init = [&options](CompletionQueue& cq) {
    QpInit i;
    i.send_cq = cq.provider();
    i.recv_cq = cq.provider();
    i.srq = options.srq;
    i.max_send_wr = options.max_send_wr;
    i.max_recv_wr = options.max_recv_wr;
    i.max_send_sge = options.max_send_sge;
    i.max_recv_sge = options.max_recv_sge;
    i.max_inline_data = std::min(options.max_inline_data,
                                 cq.device()->caps().max_inline_data);
    i.rnr_retry = options.rnr_retry;
    i.min_rnr_timer = options.min_rnr_timer;
    i.retry_cnt = options.retry_cnt;
    i.timeout = options.timeout;
    return i;
  };
  Provider* provider = cq_a.device()->provider();
  auto pair = provider->CreateConnectedPair(pd_a.provider(), init(cq_a),
                                            pd_b.provider(), init(cq_b));
  if (!pair.ok()) return pair.status();
  auto a = Adopt(std::move(pair->a), cq_a, options, pair->keepalive);
  if (!a.ok()) return a.status();
  auto b = Adopt(std::move(pair->b), cq_b, options, pair->keepalive);
  if (!b.ok()) return b.status();
  return std::make_pair(*std::move(a), *std::move(b));
}

absl::StatusOr<std::unique_ptr<QueuePair>> QueuePair::Adopt(
    std::unique_ptr<ProviderQp> qp, CompletionQueue& cq,
    const QpOptions& options, std::shared_ptr<void> keepalive,
    CompletionQueue* recv_cq) {
  if (recv_cq != nullptr && recv_cq != &cq && options.srq == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "QP 0x%x: a separate receive CQ needs a shared receive queue (its "
        "receives are reserved on that CQ)",
        qp->qp_num()));
  }
  int need = static_cast<int>(qp->max_send_wr() +
                              (options.srq ? 0 : qp->max_recv_wr()));
  absl::Status s = cq.Reserve(need);
  if (!s.ok()) return s;
  std::unique_ptr<QueuePair> q(
      new QueuePair(std::move(qp), &cq, options, std::move(keepalive)));
  q->cq_reserved_ = need;
  if (recv_cq != nullptr) q->rcq_ = recv_cq;
  cq.RegisterOwner(q->qp_num_, q.get());
  if (q->rcq_ != q->cq_) q->rcq_->RegisterOwner(q->qp_num_, q.get());
  return q;
}

QueuePair::QueuePair(std::unique_ptr<ProviderQp> qp, CompletionQueue* cq,
                     const QpOptions& options, std::shared_ptr<void> keepalive)
    : qp_(std::move(qp)),
      cq_(cq),
      rcq_(cq),
      keepalive_(std::move(keepalive)),
      options_(options),
      qp_num_(qp_->qp_num()),
      sq_capacity_(qp_->max_send_wr()),
      rq_capacity_(qp_->max_recv_wr()),
      sq_free_(sq_capacity_),
      rq_free_(rq_capacity_),
      max_inline_(std::min(options.max_inline_data, qp_->max_inline_data())),
      uses_srq_(options.srq != nullptr),
      drained_(std::make_unique<Event>()),
      alive_(std::make_shared<QueuePair*>(this)) {
  inline_sink_.qp = this;
  inline_sges_ =
      std::min<uint32_t>(internal_qp::kInlineSges, options_.max_send_sge);
  inline_wr_ = ibv_send_wr{};
  inline_wr_.wr_id =
      reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(&inline_sink_)) | 1;
  inline_wr_.sg_list = inline_sge_;
  inline_wr_.opcode = IBV_WR_SEND;
  inline_wr_.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
}

QueuePair::~QueuePair() {
  FailWaiters(absl::FailedPreconditionError(
      absl::StrFormat("QP 0x%x was destroyed", qp_num_)));
  if (outstanding_ > 0) {
    SetError("destroyed with operations in flight").IgnoreError();
    DrainSync([this] { return outstanding_ == 0; });
  }
  if (outstanding_ > 0) {
    COVERBS_LOG(kWarning, "transport",
                "QP 0x%x destroyed with %d operations whose flush never "
                "arrived; destroying the QP and completing them",
                qp_num_, outstanding_);
    Abandon("destroyed; the device never flushed");
  }
  DisarmFlushWatchdog();  // SetError above may have armed it
  cq_->UnregisterOwner(qp_num_, this);
  if (rcq_ != cq_) rcq_->UnregisterOwner(qp_num_, this);
  cq_->Unreserve(cq_reserved_);
  *alive_ = nullptr;
}

bool QueuePair::HasPosted(const WorkRequest* wr, const ibv_wc& wc) const {
  // Receives through an SRQ are on the SRQ's list, not ours.
  if (uses_srq_ && (wc.opcode & IBV_WC_RECV)) return true;
  if (wr == &inline_sink_) return inline_in_flight_ > 0;
  // Compared as WorkRequest*, never dereferencing `wr` (it may be stale).
  if (posted_ops_.AnyOf([wr](const Op* op) {
        return static_cast<const WorkRequest*>(op) == wr;
      })) {
    return true;
  }
  return posted_handlers_.AnyOf([wr](const RecvHandler* h) {
    return static_cast<const WorkRequest*>(h) == wr;
  });
}

// Inline: twice per message (its send and its receive), both from here.
inline void QueuePair::OnOpDone() {
  if (outstanding_ == 0) {
    COVERBS_LOG(kWarning, "transport",
                "QP 0x%x: a completion with no work request outstanding; "
                "ignored",
                qp_num_);
    return;
  }
  --outstanding_;
  cq_->AddInFlight(-1);
  if (closing_ && outstanding_ == 0) drained_->Set();
  // A failed completion put the QP in the error state: the rest must flush.
  if (in_error_) WatchFlushes();
}

void QueuePair::DrainSync(const std::function<bool()>& done) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    if (PollCompletions() == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

absl::Status QueuePair::SetError(std::string_view reason) {
  if (in_error_) return absl::OkStatus();
  in_error_ = true;
  absl::Status s = qp_ != nullptr ? qp_->SetError() : absl::OkStatus();
  FailWaiters(absl::FailedPreconditionError(absl::StrFormat(
      "QP 0x%x was moved to the error state (%s)", qp_num_, reason)));
  WatchFlushes();
  return s;
}

void QueuePair::WatchFlushes() {
  // The flushes should follow at once; a device that lost them gets the QP
  // abandoned after flush_timeout (timers live on the CQ's reactor thread).
  Reactor* r = cq_->reactor();
  if (qp_ != nullptr && outstanding_ > 0 && r->InLoopThread() &&
      !flush_watchdog_.armed()) {
    flush_watchdog_.qp = this;
    flush_watchdog_.deadline = SteadyAfter(options_.flush_timeout);
    r->AddTimer(&flush_watchdog_);
  }
}

void QueuePair::FlushWatchdog::OnTimer() {
  if (qp->qp_ == nullptr || qp->outstanding_ == 0) return;
  COVERBS_LOG(kWarning, "transport",
              "QP 0x%x: %d work requests not flushed %s after the error "
              "state; destroying the QP (the device lost them)",
              qp->qp_num_, qp->outstanding_,
              absl::FormatDuration(qp->options_.flush_timeout));
  qp->Abandon("the device did not flush its work requests");
}

void QueuePair::DisarmFlushWatchdog() {
  if (flush_watchdog_.armed()) cq_->reactor()->CancelTimer(&flush_watchdog_);
}

void QueuePair::Abandon(std::string_view reason) {
  if (qp_ == nullptr) return;
  DisarmFlushWatchdog();
  SetError(reason).IgnoreError();
  // Destroying the QP is what guarantees the NIC no longer accesses any
  // buffer of its work requests; completions it already produced are
  // still in the CQ and are taken first, so none arrives after ours.
  qp_.reset();
  while (PollCompletions() > 0) {
  }
  ibv_wc wc{};
  wc.status = IBV_WC_WR_FLUSH_ERR;
  wc.qp_num = qp_num_;
  while (Op* op = posted_ops_.pop_front()) {
    wc.wr_id = reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(op)) | 1;
    wc.opcode = op->is_recv_ ? IBV_WC_RECV : IBV_WC_SEND;
    op->OnCompletion(wc);
  }
  while (RecvHandler* h = posted_handlers_.pop_front()) {
    wc.wr_id = reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(h)) | 1;
    wc.opcode = IBV_WC_RECV;
    static_cast<WorkRequest*>(h)->OnCompletion(wc);
  }
  wc.wr_id = inline_wr_.wr_id;  // the sink's
  wc.opcode = IBV_WC_SEND;
  while (inline_in_flight_ > 0) inline_sink_.OnCompletion(wc);
}

Task<absl::Status> QueuePair::Close() {
  closing_ = true;
  absl::Status s = SetError("closed");
  if (outstanding_ == 0) co_return s;
  auto wait = [](Event* e) -> Task<absl::Status> { co_return co_await e->Wait(); };
  absl::Status w = co_await WithTimeout(wait(drained_.get()), absl::Seconds(30));
  if (!w.ok()) {
    co_return absl::DeadlineExceededError(absl::StrFormat(
        "closing QP 0x%x: %llu operations still outstanding after 30s (no "
        "flush completion arrived): %s",
        qp_num_, static_cast<unsigned long long>(outstanding_), w.message()));
  }
  co_return s;
}

void QueuePair::CancelOp(Op* op) {
  if (op->linked() && !op->posted_) {  // still waiting for a slot
    (op->is_recv_ ? recv_waiters_ : send_waiters_).erase(op);
    op->Fail(absl::CancelledError(absl::StrFormat(
        "%s on QP 0x%x cancelled while waiting for a queue slot", op->name_,
        qp_num_)));
    return;
  }
  if (op->posted_ && !op->completed_) {
    SetError("an operation was cancelled").IgnoreError();
  }
}

// Start, PostNow and Release always inline (gcc does not on its own):
// each message's send runs Suspend -> Start -> PostNow and OnCompletion ->
// Release, and a call and its prologue each were ~15% of the transport's
// instructions per message.
[[gnu::always_inline]] inline bool QueuePair::Start(Op* op) {
  if (!op->early_.ok()) {
    op->completed_ = true;
    return false;
  }
  auto fail_now = [op](absl::Status s) {
    op->early_ = std::move(s);
    op->completed_ = true;
    return false;
  };
  if (in_error_) {
    return fail_now(absl::FailedPreconditionError(absl::StrFormat(
        "%s on QP 0x%x: the QP is in the error state", op->name_, qp_num_)));
  }
  if (op->is_recv_ && uses_srq_) {
    return fail_now(absl::InvalidArgumentError(absl::StrFormat(
        "RECV on QP 0x%x: the QP receives through a shared receive queue; "
        "post receives there",
        qp_num_)));
  }
  uint32_t cap = op->is_recv_ ? rq_capacity_ : sq_capacity_;
  if (op->slots_ > cap || op->slots_ == 0) {
    return fail_now(absl::InvalidArgumentError(absl::StrFormat(
        "%s on QP 0x%x needs %u work requests; the queue holds %u", op->name_,
        qp_num_, op->slots_, cap)));
  }
  auto& waiters = op->is_recv_ ? recv_waiters_ : send_waiters_;
  uint32_t free = op->is_recv_ ? rq_free_ : sq_free_;
  if (!waiters.empty() || free < op->slots_) {
    waiters.push_back(op);  // back-pressure: posted when slots free up
    return true;
  }
  absl::Status s = PostNow(op);
  if (!s.ok()) return fail_now(std::move(s));
  return true;
}

[[gnu::always_inline]] inline absl::Status QueuePair::PostNow(Op* op) {
  if (qp_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s on QP 0x%x: the QP was destroyed", op->name_, qp_num_));
  }
  uint32_t& free = op->is_recv_ ? rq_free_ : sq_free_;
  free -= op->slots_;
  absl::Status s;
  if (op->is_recv_) {
    ibv_recv_wr* bad = nullptr;
    s = qp_->PostRecv(&op->rwr_, &bad);
  } else if (op->batch_ != nullptr) {
    auto& wrs = op->batch_->wrs_;
    auto& sges = op->batch_->sges_;
    uint64_t id =
        reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(op));
    for (size_t i = 0; i < wrs.size(); ++i) {
      wrs[i].wr_id = id;
      wrs[i].sg_list = &sges[i];
      wrs[i].num_sge =
          wrs[i].opcode == IBV_WR_BIND_MW || wrs[i].opcode == IBV_WR_LOCAL_INV
              ? 0
              : 1;
      wrs[i].send_flags = 0;
      wrs[i].next = i + 1 < wrs.size() ? &wrs[i + 1] : nullptr;
    }
    wrs.back().wr_id = id | 1;
    wrs.back().send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    s = qp_->PostSend(wrs.data(), &bad);
    if (!s.ok() && bad != nullptr && bad != wrs.data()) {
      // Part of the list was posted. Those WRs carry this op's address: the
      // op must outlive their (flush) completions before it can fail.
      uint32_t posted = static_cast<uint32_t>(bad - wrs.data());
      ++outstanding_;
      cq_->AddInFlight(1);
      SetError("a batch was posted only in part").IgnoreError();
      DrainSync([op, posted] { return op->nonterminal_seen_ >= posted; });
      OnOpDone();
      free += op->slots_;
      return s;
    }
  } else {
    ibv_send_wr* bad = nullptr;
    s = qp_->PostSend(&op->swr_, &bad);
  }
  if (!s.ok()) {
    free += op->slots_;
    return s;
  }
  op->posted_ = true;
  posted_ops_.push_back(op);
  ++outstanding_;
  cq_->AddInFlight(1);
  return absl::OkStatus();
}

[[gnu::always_inline]] inline void QueuePair::Release(Op* op) {
  if (op->linked()) posted_ops_.erase(op);
  (op->is_recv_ ? rq_free_ : sq_free_) += op->slots_;
  const ibv_wc& w = op->first_error_ ? *op->first_error_ : op->wc_;
  if (w.status != IBV_WC_SUCCESS && !in_error_) {
    // RC: any failed completion means the QP is now in the error state.
    in_error_ = true;
    FailWaiters(absl::FailedPreconditionError(absl::StrFormat(
        "QP 0x%x is in the error state after %s", qp_num_,
        WcStatusName(w.status))));
  }
  OnOpDone();
  // Nearly always nobody waits for a slot: no call.
  if (!in_error_ && !(send_waiters_.empty() && recv_waiters_.empty())) {
    PumpWaiters();
  }
}

namespace internal_qp {

bool OpBase::Suspend(std::coroutine_handle<> h, std::stop_token token) {
  waiter_ = h;
  reactor_ = qp_->cq_->reactor();
  if (token.stop_requested()) {
    cancelled_ = true;
    early_ = absl::CancelledError(absl::StrFormat(
        "%s on QP 0x%x cancelled before it was posted", name_, qp_num_));
    completed_ = true;
    return false;
  }
  if (!qp_->Start(this)) return false;  // finished synchronously
  if (token.stop_possible()) cb_.emplace(std::move(token), Canceller{this});
  return true;
}

void OpBase::OnCompletion(const ibv_wc& wc) {
  if (completed_) {
    // A second completion for a finished WR (a device bug): counting it
    // again would corrupt the QP's accounting and resume the waiter twice.
    COVERBS_LOG(kWarning, "transport",
                "QP 0x%x: a second completion (%s) for %s, which already "
                "completed; ignored",
                qp_num_, WcStatusName(wc.status), name_);
    return;
  }
  if (wc.status != IBV_WC_SUCCESS && !first_error_) first_error_ = wc;
  if (!(wc.wr_id & 1)) {  // a non-terminal WR of a batch (errors only)
    ++nonterminal_seen_;
    return;
  }
  wc_ = wc;
  completed_ = true;
  const ibv_wc& w = first_error_ ? *first_error_ : wc_;
  if (w.status != IBV_WC_SUCCESS) {
    if (cancelled_.load(std::memory_order_acquire) &&
        w.status == IBV_WC_WR_FLUSH_ERR) {
      early_ = absl::CancelledError(absl::StrFormat(
          "%s on QP 0x%x cancelled: the QP was moved to the error state to "
          "take the work request back from the NIC",
          name_, qp_num_));
    } else {
      early_ = WcError(w.status, w.vendor_err, name_, qp_num_,
                       qp_->caps().device_name);
    }
  }
  qp_->Release(this);
  Resume();
}

}  // namespace internal_qp

void QueuePair::PumpWaiters() {
  for (auto* list : {&send_waiters_, &recv_waiters_}) {
    bool recv = list == &recv_waiters_;
    while (Op* op = list->front()) {
      if ((recv ? rq_free_ : sq_free_) < op->slots_) break;
      list->erase(op);
      absl::Status s = PostNow(op);
      if (!s.ok()) op->Fail(std::move(s));
    }
  }
}

void QueuePair::FailWaiters(const absl::Status& s) {
  for (auto* list : {&send_waiters_, &recv_waiters_}) {
    while (Op* op = list->pop_front()) op->Fail(s);
  }
}

absl::Status QueuePair::PostInlineSend(std::span<const LocalBuffer> bufs) {
  // Once per small message: the work request is a member with its fixed
  // fields set once, and every refusal is one test here (the reasons are
  // sorted out off the fast path).
  const size_t n = bufs.size();
  if (!CanPostSendNow() || n - 1 >= inline_sges_) [[unlikely]] {
    return RefuseInlineSend(bufs);
  }
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    inline_sge_[i] = bufs[i].sge();
    total += bufs[i].length;
  }
  if (total > max_inline_) [[unlikely]]
    return RefuseInlineSend(bufs);
  inline_wr_.num_sge = static_cast<int>(n);
  ibv_send_wr* bad = nullptr;
  absl::Status s = qp_->PostSend(&inline_wr_, &bad);
  if (!s.ok()) return s;
  --sq_free_;
  ++inline_in_flight_;
  ++outstanding_;
  cq_->AddInFlight(1);
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> QueuePair::PostBind(MemoryWindow& mw,
                                             const MemoryRegion& mr,
                                             std::span<std::byte> range,
                                             int access) {
  if (!caps().memory_windows) {
    return absl::UnimplementedError(absl::StrFormat(
        "window bind on QP 0x%x: %s has no type-2 memory windows", qp_num_,
        caps().device_name));
  }
  if (!mw.valid() || !mr.valid()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "window bind on QP 0x%x: no window or no region", qp_num_));
  }
  if (!CanPostSendNow()) {
    absl::Status why = RefuseInlineSend({});
    return absl::Status(why.code(),
                        absl::StrCat("window bind: ", why.message()));
  }
  ibv_send_wr wr{};
  uint32_t rkey = mw.provider()->PrepareBind(
      wr, *mr.provider(), reinterpret_cast<uint64_t>(range.data()),
      range.size(), access);
  // Completes into the inline sends' sink: a slot back, or the QP down.
  wr.wr_id = inline_wr_.wr_id;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  absl::Status s = qp_->PostSend(&wr, &bad);
  if (!s.ok()) return s;
  --sq_free_;
  ++inline_in_flight_;
  ++outstanding_;
  cq_->AddInFlight(1);
  return rkey;
}

absl::Status QueuePair::RefuseInlineSend(
    std::span<const LocalBuffer> bufs) const {
  if (in_error_ || qp_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "inline SEND on QP 0x%x: the QP is in the error state", qp_num_));
  }
  if (sq_free_ == 0 || !send_waiters_.empty()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "inline SEND on QP 0x%x: no free send-queue slot (%u) without "
        "waiting",
        qp_num_, sq_capacity_));
  }
  if (bufs.empty() || bufs.size() > inline_sges_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("inline SEND on QP 0x%x: %d buffers (1 to %d)", qp_num_,
                        bufs.size(), inline_sges_));
  }
  uint64_t total = 0;
  for (const LocalBuffer& b : bufs) total += b.length;
  return absl::InvalidArgumentError(absl::StrFormat(
      "inline SEND on QP 0x%x: %u bytes exceed the QP's max_inline_data of %u",
      qp_num_, total, max_inline_));
}

void QueuePair::InlineSink::OnCompletion(const ibv_wc& wc) {
  QueuePair* q = qp;
  if (q->inline_in_flight_ == 0) {
    COVERBS_LOG(kWarning, "transport",
                "QP 0x%x: a completion (%s) for an inline send when none is "
                "in flight; ignored",
                q->qp_num_, WcStatusName(wc.status));
    return;
  }
  --q->inline_in_flight_;
  ++q->sq_free_;
  if (wc.status != IBV_WC_SUCCESS) {
    if (q->inline_error_.ok() && wc.status != IBV_WC_WR_FLUSH_ERR) {
      q->inline_error_ =
          WcError(wc.status, wc.vendor_err, "inline SEND or window bind",
                  q->qp_num_, q->caps().device_name);
    }
    if (!q->in_error_) {
      // RC: a failed completion means the QP is in the error state.
      q->in_error_ = true;
      q->FailWaiters(absl::FailedPreconditionError(absl::StrFormat(
          "QP 0x%x is in the error state after %s on an inline send",
          q->qp_num_, WcStatusName(wc.status))));
    }
  }
  q->OnOpDone();
  if (!q->in_error_ && !q->send_waiters_.empty()) q->PumpWaiters();
}

absl::Status QueuePair::PostRecv(RecvHandler* h,
                                 std::span<const LocalBuffer> bufs) {
  if (in_error_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "RECV on QP 0x%x: the QP is in the error state", qp_num_));
  }
  if (rq_free_ == 0 || !recv_waiters_.empty()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RECV on QP 0x%x: the receive queue (%u) is full", qp_num_,
        rq_capacity_));
  }
  absl::Status s = PostHandlerRecv(*qp_, h, bufs);
  if (!s.ok()) return s;
  TrackRecvs(std::span<RecvHandler* const>(&h, 1));
  return absl::OkStatus();
}

absl::Status QueuePair::PostRecvs(std::span<RecvHandler* const> hs,
                                  std::span<const LocalBuffer> bufs) {
  const size_t n = hs.size();
  if (n == 0) return absl::OkStatus();
  if (n > kMaxRecvBatch || bufs.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RECV batch on QP 0x%x: %u handlers and %u buffers (at most %u)",
        qp_num_, n, bufs.size(), kMaxRecvBatch));
  }
  if (in_error_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "RECV on QP 0x%x: the QP is in the error state", qp_num_));
  }
  if (rq_free_ < n || !recv_waiters_.empty()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "RECV batch of %u on QP 0x%x: the receive queue (%u) has %u free", n,
        qp_num_, rq_capacity_, rq_free_));
  }
  ibv_recv_wr wrs[kMaxRecvBatch];
  ibv_sge sges[kMaxRecvBatch];
  for (size_t i = 0; i < n; ++i) {
    sges[i] = bufs[i].sge();
    wrs[i].wr_id =
        reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(hs[i])) | 1;
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
  }
  ibv_recv_wr* bad = nullptr;
  absl::Status s = qp_->PostRecv(wrs, &bad);
  if (s.ok()) {
    TrackRecvs(hs);
    return s;
  }
  // The verbs contract: the work requests before *bad were posted. A
  // provider that failed without naming one posted none of them.
  size_t posted = bad != nullptr ? static_cast<size_t>(bad - wrs) : 0;
  if (posted > n) posted = 0;
  TrackRecvs(hs.first(posted));
  return absl::Status(
      s.code(), absl::StrFormat("%s (%u of a batch of %u posted)", s.message(),
                                posted, n));
}

void QueuePair::TrackRecvs(std::span<RecvHandler* const> hs) {
  for (RecvHandler* h : hs) {
    h->qp_ = this;
    posted_handlers_.push_back(h);
  }
  const auto n = static_cast<uint32_t>(hs.size());
  rq_free_ -= n;
  handler_recvs_ += n;
  outstanding_ += n;
  cq_->AddInFlight(static_cast<int>(n));
}

}  // namespace coverbs::transport
