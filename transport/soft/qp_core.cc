// QpCore's life cycle and error state: construction, taking over the
// connected socket, the entry points the engine calls on the progress thread
// (kick, readable, writable, service), destruction, and the move to the
// error state -- flushing both queues, the DISCONNECT frame, the close
// deadline. The data path is in qp_rx.cc, qp_rx_frames.cc and qp_tx.cc,
// posting in qp_post.cc, the timers in qp_timers.cc.
#include "transport/soft/qp_core.h"

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_internal.h"

namespace coverbs::transport::soft {
namespace {

constexpr auto kCloseTimeout = std::chrono::seconds(2);

}  // namespace

QpCore::QpCore(Engine* engine, uint64_t id, QpConfig config)
    : engine_(engine),
      engine_weak_(engine->weak_from_this()),
      id_(id),
      cfg_(std::move(config)),
      sq_cap_(cfg_.init.max_send_wr),
      max_send_sge_(cfg_.init.max_send_sge),
      max_inline_(cfg_.init.max_inline_data),
      rq_(cfg_.srq ? nullptr
                   : std::make_unique<RecvQueue>(cfg_.init.max_recv_wr,
                                                 cfg_.init.max_recv_sge,
                                                 cfg_.pd_id)),
      sq_(sq_cap_),
      sq_sge_(static_cast<size_t>(sq_cap_) * max_send_sge_),
      sq_mr_(static_cast<size_t>(sq_cap_) * max_send_sge_),
      sq_inline_(static_cast<size_t>(sq_cap_) * max_inline_) {}

QpCore::~QpCore() {
  if (fd_ >= 0) close(fd_);
}

// ---------------------------------------------------------------------------
// Progress thread: life cycle

void QpCore::Connect(int fd) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (err_ || removed_) {
    close(fd);
    return;
  }
  fd_ = fd;
  // Not zero-filled (make_unique would touch every page): an idle
  // connection keeps only what it has used resident.
  rbuf_ = std::make_unique_for_overwrite<char[]>(kRbufSize);
  arena_ = std::make_unique_for_overwrite<char[]>(kArenaSize);
  segs_.resize(kMaxSegs);
  EnterReactorRx();
  engine_->Activate(this);
}

void QpCore::OnKick() {
  kicked_.store(false);
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (removed_) return;
  // A reactor found the lock busy when the socket had data (RxInline).
  if (rx_hint_.exchange(false)) {
    rx_ready_ = true;
    engine_->Activate(this);
  }
  if (timers_owed_) {
    // Set by a thread receiving inline, which cannot touch the timer heap.
    timers_owed_ = false;
    if (rnr_wait_) engine_->AddTimer(this, rnr_until_);
    if (err_ && !closed_) engine_->AddTimer(this, close_deadline_);
  }
  if (error_requested_.load() && !err_) {
    EnterError(Cause::kLocalRequest, "moved to the error state by SetError");
  }
  if (err_) {
    // Draining until the peer closes needs the io_uring poll.
    if (reactor_rx_) LeaveReactorRx();
    FlushRq();
    if (nsegs_ == 0) FlushSq();
    // An error entered inline has not run the transmit side (DISCONNECT,
    // flushing, shutdown) yet.
    engine_->Activate(this);
    return;
  }
  // A poster that sent the first outstanding request inline could not arm
  // the transport timer (the engine's timer heap is this thread's).
  ArmAckTimer();
  engine_->Activate(this);
}

void QpCore::OnReadable(bool ended) {
  if (ended) peer_ended_.store(true, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(progress_mu_);
  rx_ready_ = true;
  engine_->Activate(this);
}

void QpCore::OnWritable() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  tx_blocked_ = false;
  engine_->Activate(this);
}

void QpCore::Service() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  if (removed_) return;
  // A bulk payload under way: this thread receives for the QP until the
  // bulk is over (StartBulkRx).
  if (reactor_rx_ && !bulk_rx_ && fd_ >= 0 && !err_ && in_payload_ &&
      pay_left_ > kInlineBulk) {
    StartBulkRx();
    rx_ready_ = true;
  }
  // (A fault an inline receive met is acted on by DoRx.)
  if ((rx_ready_ || rx_fault_ != 0) && fd_ >= 0) DoRx();
  // Back to the reactor at a frame boundary once the bulk is over (a run of
  // small frames: switching each way costs syscalls and a wake-up, and
  // going back after every bulk frame lost most of the gain).
  if (bulk_rx_ && !in_payload_ && bulk_small_run_ >= kBulkExitFrames && !err_ &&
      fd_ >= 0) {
    EndBulkRx();
  }
  DoTx();
}

void QpCore::Destroy() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  removed_ = true;
  if (fd_ >= 0) {
    // Best effort, when the stream is at a frame boundary: tell the peer
    // this was deliberate so it does not report a fault; or, destroyed in
    // error, send the NAK still owed for the peer's bad request -- the
    // owner often destroys the QP as soon as it sees the flush, before the
    // progress thread sent it, and the peer then saw the link end
    // ("peer gone") instead of its remote access error.
    if (hello_sent_ && seg_idx_ == nsegs_) {
      wire::Header h;
      bool send_one = false;
      if (!err_) {
        h.opcode = wire::kDisconnect;
        send_one = true;
      } else {
        for (size_t i = 0; i < ctrl_.size(); ++i) {
          const Ctrl& c = ctrl_[i];
          if (c.op != wire::kNak) continue;
          h.opcode = wire::kNak;
          h.seq = c.seq;
          h.syndrome = c.syndrome;
          send_one = true;
          break;
        }
      }
      if (send_one) {
        char buf[wire::kHeaderSize];
        wire::Encode(h, buf);
        ssize_t n = send(fd_, buf, sizeof(buf), MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)n;
      }
    }
    if (reactor_rx_) LeaveReactorRx(/*watch=*/false);
    engine_->Unwatch(this);
    close(fd_);
    fd_ = -1;
  }
  closed_ = true;
  ResetTx();
  ctrl_.clear();
  rx_mr_.Reset();
  have_cur_recv_ = false;
  for (auto& mr : cur_recv_.mr) mr.reset();
}

// ---------------------------------------------------------------------------
// Progress thread: errors

void QpCore::EnterError(Cause cause, const std::string& why,
                        ibv_event_type event) {
  if (err_) return;
  err_ = true;
  state_.store(IBV_QPS_ERR);
  // The event is queued before any flush completion is pushed: whoever
  // reads a flush of this QP finds its event already pending (cm decides a
  // close's cause that way, cm/async_events.h).
  if (cause == Cause::kFault && cfg_.async) {
    cfg_.async->Push(AsyncEvent{
        event, qp_num(),
        absl::StrFormat("soft: qp %u (peer qp %u) error: %s", qp_num(),
                        peer_qpn_, why)});
  }
  in_payload_ = false;
  rx_mr_.Reset();
  rnr_wait_ = false;
  // Draining until the peer closes needs the io_uring poll (inline, OnKick
  // does this).
  if (reactor_rx_ && !inline_ && fd_ >= 0) LeaveReactorRx();
  FlushRq();
  if (fd_ < 0) {
    closed_ = true;
    FlushSq();
    return;
  }
  Ctrl c;
  c.op = wire::kDisconnect;
  ctrl_.push_back(std::move(c));
  close_deadline_ = std::chrono::steady_clock::now() + kCloseTimeout;
  AddTimer(close_deadline_);
  Activate();
}

void QpCore::FlushRq() {
  if (have_cur_recv_) {
    PushRecvWc(IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
  }
  if (!rq_) return;
  std::vector<uint64_t> ids;
  rq_->TakeAllIds(&ids);
  for (uint64_t id : ids) {
    ibv_wc wc{};
    wc.wr_id = id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp_num();
    wc.src_qp = peer_qpn_;
    cfg_.recv_cq->Push(wc);
  }
}

void QpCore::FlushSq() {
  uint64_t head = ReadHead();
  if (comp_ptr_ == head) return;
  while (comp_ptr_ < head) CompleteWqe(comp_ptr_, IBV_WC_WR_FLUSH_ERR);
  send_ptr_ = comp_ptr_;
  rd_atomic_out_ = 0;
  PublishTail();
}

void QpCore::CloseNow() {
  if (fd_ >= 0) {
    if (reactor_rx_) LeaveReactorRx(/*watch=*/false);
    engine_->Unwatch(this);
    close(fd_);
    fd_ = -1;
  }
  closed_ = true;
  rx_ready_ = false;
  tx_blocked_ = false;
  ResetTx();
  ctrl_.clear();
  if (err_) FlushSq();
}

void QpCore::ConnectionLost(const std::string& why) {
  EnterError(Cause::kFault, why);
  CloseNow();
}

}  // namespace coverbs::transport::soft
