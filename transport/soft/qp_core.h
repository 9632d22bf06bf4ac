// QpCore: the state of one soft RC QP, shared between the application threads
// (posting, SetError, state) and the progress thread (everything on the
// socket; a poster may transmit inline, under progress_mu_). Fields are
// grouped by who may touch them; see README.md.
#ifndef COVERBS_TRANSPORT_SOFT_QP_CORE_H_
#define COVERBS_TRANSPORT_SOFT_QP_CORE_H_

#include <infiniband/verbs.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "transport/provider.h"
#include "transport/soft/mr_table.h"
#include "transport/soft/queues.h"
#include "transport/soft/wire.h"

namespace coverbs::transport::soft {

class Engine;

using SteadyTime = std::chrono::steady_clock::time_point;

// RNR NAK delay for an IB min_rnr_timer code: the IB table value divided by
// 10 (code 12, 0.64 ms in IB, waits 64 us; code 0, 655.36 ms, waits 65.5 ms).
std::chrono::microseconds RnrDelay(uint8_t code);

// A growable FIFO ring (no allocation once it has grown to its working size).
template <typename T>
class Ring {
 public:
  bool empty() const { return head_ == tail_; }
  size_t size() const { return head_ - tail_; }
  T& front() { return buf_[tail_ & (buf_.size() - 1)]; }
  T& back() { return buf_[(head_ - 1) & (buf_.size() - 1)]; }
  T& operator[](size_t i) { return buf_[(tail_ + i) & (buf_.size() - 1)]; }
  void push_back(T v) {
    if (head_ - tail_ == buf_.size()) Grow();
    buf_[head_++ & (buf_.size() - 1)] = std::move(v);
  }
  void pop_front() { buf_[tail_++ & (buf_.size() - 1)] = T(); }
  void clear() {
    while (!empty()) pop_front();
  }

 private:
  void Grow() {
    std::vector<T> n(buf_.empty() ? 16 : buf_.size() * 2);
    for (size_t i = 0; tail_ + i != head_; ++i) {
      n[i] = std::move(buf_[(tail_ + i) & (buf_.size() - 1)]);
    }
    head_ -= tail_;
    tail_ = 0;
    buf_ = std::move(n);
  }
  std::vector<T> buf_;
  size_t head_ = 0;
  size_t tail_ = 0;
};

struct QpConfig {
  uint32_t qp_num = 0;
  uint64_t pd_id = 0;
  QpInit init;  // the CQ / SRQ pointers in it are not used
  std::shared_ptr<CqCore> send_cq;
  std::shared_ptr<CqCore> recv_cq;
  std::shared_ptr<RecvQueue> srq;  // null: the QP has its own RQ
  std::shared_ptr<AsyncQueue> async;
};

class QpCore : public std::enable_shared_from_this<QpCore> {
 public:
  QpCore(Engine* engine, uint64_t id, QpConfig config);
  ~QpCore();
  QpCore(const QpCore&) = delete;
  QpCore& operator=(const QpCore&) = delete;

  uint64_t id() const { return id_; }
  uint32_t qp_num() const { return cfg_.qp_num; }
  // What memory-window binds name (NewQpUid): unique for the process's life.
  uint64_t uid() const { return uid_; }
  uint64_t pd_id() const { return cfg_.pd_id; }
  uint32_t max_send_wr() const { return sq_cap_; }
  uint32_t max_recv_wr() const { return rq_ ? rq_->capacity() : 0; }
  uint32_t max_inline_data() const { return max_inline_; }

  // ---- Application side (any thread).
  // Posted inside a batch (BeginPostBatch below) the WRs are transmitted at
  // its end, from this thread -- or earlier, once the batch has posted
  // kFirstEarlyTx of them to this QP, then twice as many, and so on;
  // otherwise the progress thread is kicked.
  //
  // Why early: a NIC starts on a WR when its doorbell rings. Holding all of
  // a reactor iteration's posts for one sendmsg saves system calls, but
  // when the iteration answers a window of requests (an RPC server's 16
  // responses), the peer gets nothing until the last is ready, and the two
  // processes take turns instead of working at once. A doubling schedule
  // lets the peer start on the first few while this side makes the rest,
  // for a few more sendmsgs per batch (3 for 16 posts, 5 for 64).
  static constexpr uint32_t kFirstEarlyTx = 3;
  // Posts carrying more than this many payload bytes do not count.
  static constexpr uint64_t kEarlyTxMaxBytes = 16 * 1024;
  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad);
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad);
  void RequestError();
  // The end of a post batch that listed this QP (qp_post.cc): transmit
  // inline, else kick. With `may_hold`, a QP that owes nothing but an ACK
  // sends nothing yet and stays listed (returns true): see EndPostBatch.
  bool FlushDeferred(bool may_hold = false);
  ibv_qp_state state() const {
    return static_cast<ibv_qp_state>(state_.load(std::memory_order_acquire));
  }
  // Marks the QP connected (RTS) once the progress thread owns its socket.
  // False if the QP went to the error state first.
  bool SetConnected() {
    int expected = IBV_QPS_INIT;
    return state_.compare_exchange_strong(expected, IBV_QPS_RTS);
  }

  // ---- The reactor that drives the QP's receive CQ, from its GetEvents
  // (CqCore), when the socket became readable: receives what is there and
  // produces the completions on this thread; the ACKs and responses that
  // owes go out with the thread's post batch (or inline at once outside
  // one). Whatever needs the progress thread (an error, a timer, a backlog)
  // is left to it through a kick.
  // `ended`: the event reported the peer's end of stream or an error.
  void RxInline(bool ended);

  // ---- Progress thread. Each of these takes progress_mu_.
  void Connect(int fd);
  void OnKick();
  void Service();
  void OnTimer(SteadyTime now);
  void OnReadable(bool ended);
  void OnWritable();
  void Destroy();
  // The receive CQ's reactor is gone: the io_uring poll takes over.
  void TakeBackRx();
  // Runs the transmit side (an ACK a stuck reactor held back).
  void Nudge();

 private:
  friend class Engine;

  enum class Cause { kLocalRequest, kPeerDisconnect, kFault };
  enum class RxKind : uint8_t {
    kDiscard,
    kRecv,
    kWrite,
    kAtomicReq,
    kReadResp,
    kAtomicResp,
  };
  struct SendWqe {
    uint64_t wr_id;
    uint64_t remote_addr;
    uint64_t compare_add;
    uint64_t swap;
    uint64_t total;
    uint32_t rkey;
    uint32_t imm;
    uint32_t num_sge;
    uint8_t opcode;  // ibv_wr_opcode
    uint8_t status;  // IBV_WC_SUCCESS, or the local error found at post
    uint8_t rnr_retries;
    bool signaled;
    bool inlined;
    bool solicited;
  };
  // A response (or DISCONNECT) queued by the responder side.
  struct Ctrl {
    uint8_t op = 0;
    uint8_t syndrome = 0;
    uint64_t seq = 0;
    std::shared_ptr<MrEntry> mr;  // READ_RESP source
    uint64_t addr = 0;
    uint32_t len = 0;
    uint64_t value = 0;  // ATOMIC_RESP
  };
  struct Dest {
    char* p;
    size_t len;
    const MrEntry* mr;    // checked before each use; null for internal buffers
    bool pinned = false;  // mr is held by an MrPin

    bool Usable() const {
      return mr == nullptr || (pinned ? mr->Live() : mr->Usable());
    }
  };
  struct Seg {
    const char* p = nullptr;
    size_t len = 0;
    std::shared_ptr<MrEntry> mr;  // null: arena memory
    int64_t slot = -1;            // SQ index whose buffer this is, or -1
  };

  // Application side.
  absl::Status CheckSendWr(const ibv_send_wr& wr) const;
  // Window binds and local invalidations take effect here, at post (the
  // table is then locked exclusively); LOCAL_INV's windows are appended to
  // `unmapped`, for the caller to end once the table is unlocked. Returns
  // false when the WR is over at post: an unsignaled bind or invalidation
  // that succeeded on a QP in RTS has no completion to report and nothing
  // to send, so it takes no slot (and no sequence number) in the queue.
  bool FillSendWqe(const MrTable::Reader& table, const ibv_send_wr& wr,
                   uint64_t index,
                   std::vector<std::shared_ptr<MrEntry>>* unmapped);
  void Kick();
  friend void EndPostBatch();
  // Transmits what the send ring and the response ring hold from the
  // posting thread, if the progress thread is not busy with this QP and its
  // transmit side is idle. False when the progress thread still has to act
  // (nothing was tried, or a backlog, EAGAIN, an error or a timer to arm is
  // left for it): the caller kicks.
  enum class InlineTx { kDone, kKick, kHeld };
  InlineTx TxInline(bool may_hold);

  // Progress thread or a thread inside RxInline / TxInline (inline_): what
  // the engine would do. Inline, Activate asks for the poster's transmit
  // (want_tx_: ACKs, responses, requests the ACKs let through) and
  // AddTimer leaves the timer to the progress thread (OnKick re-adds it).
  void Activate();
  void AddTimer(SteadyTime when);
  // Progress thread: receive notifications from the receive CQ's reactor
  // instead of the io_uring poll (Connect), and back (error, CQ no longer
  // driven; `watch` false: the socket is being closed).
  void EnterReactorRx();
  void LeaveReactorRx(bool watch = true);
  // Progress thread: a reactor-received QP's bulk payloads are received by
  // the progress thread (see kInlineBulk, qp_rx.cc), then back.
  void StartBulkRx();
  void EndBulkRx();
  // After RxInline: the QP's transmit joins this thread's post batch, or
  // runs now outside one. `engine` keeps the engine alive meanwhile.
  void DeferTx(std::shared_ptr<Engine> engine);

  // Progress thread: receive.
  void DoRx();
  // After a read of `n` bytes that asked for `want`: whether the socket is
  // known to be empty (see peer_ended_).
  bool Drained(size_t n, size_t want) const {
    return n < want && !peer_ended_.load(std::memory_order_relaxed);
  }
  bool RecvResult(ssize_t n);
  void DrainAfterError();
  void StartFrame(const wire::Header& h);
  void StartRequest(const wire::Header& h);
  void FinishFrame();
  void BeginPayload(RxKind kind, uint64_t len);
  void Place(const char* src, size_t n);
  int DestIov(struct iovec* iov, int max, size_t* covered);
  void AdvanceDest(size_t n);
  bool TakeRecv();
  uint8_t CheckRemote(uint32_t rkey, uint64_t addr, uint64_t len, int access,
                      std::shared_ptr<MrEntry>* out,
                      MrPin* pin = nullptr) const;
  void RecvFailed(uint8_t recv_status, uint8_t nak_status,
                  const std::string& why);
  void RespondError(uint8_t nak_status, const std::string& why);
  void QueueAck(uint64_t seq);
  void QueueCtrl(Ctrl c);
  // `inv`: the SEND invalidated the rkey `imm_data` (IBV_WC_WITH_INV).
  void PushRecvWc(uint8_t status, ibv_wc_opcode op, uint32_t len, bool imm,
                  uint32_t imm_data, bool inv = false);
  void ProtocolError(const std::string& why);

  // Progress thread: requester.
  SendWqe& Wqe(uint64_t i) { return sq_[i % sq_cap_]; }
  bool AckBefore(uint64_t end);
  void CompleteWqe(uint64_t i, uint8_t status);
  void PublishTail();
  uint64_t ReadHead();
  bool IsRdAtomic(const SendWqe& w) const;

  // Progress thread: transmit.
  void DoTx();
  bool SendPending(size_t* budget);
  bool Build();
  void AppendHeader(const wire::Header& h, const char* extra, size_t n);
  void AppendUser(const char* p, size_t n, const std::shared_ptr<MrEntry>& mr,
                  int64_t slot);
  void ResetTx();

  // Progress thread: errors.
  // A fault raises `event` on the QP (the async event queue): verbs'
  // IBV_EVENT_QP_ACCESS_ERR / _REQ_ERR for a request the responder refused
  // for its key or validity, IBV_EVENT_QP_FATAL for the rest.
  void EnterError(Cause cause, const std::string& why,
                  ibv_event_type event = IBV_EVENT_QP_FATAL);
  void FlushRq();
  void FlushSq();
  void CloseNow();
  void ConnectionLost(const std::string& why);
  void PushSendWc(const SendWqe& w, uint8_t status);

  Engine* const engine_;
  // For threads other than the progress thread that must keep the engine
  // alive while they use the QP (RxInline).
  const std::weak_ptr<Engine> engine_weak_;
  const uint64_t id_;
  const QpConfig cfg_;
  const uint64_t uid_ = NewQpUid();
  const uint32_t sq_cap_;
  const uint32_t max_send_sge_;
  const uint32_t max_inline_;
  const std::unique_ptr<RecvQueue> rq_;  // null when the QP uses an SRQ

  // ---- Shared.
  std::atomic<int> state_{IBV_QPS_INIT};
  std::atomic<bool> kicked_{false};
  std::atomic<bool> deferred_{false};  // in some thread's post batch
  // Early transmits inside a post batch (PostSend): posts since this QP
  // last transmitted, and the count at which it transmits without waiting
  // for the batch's end (kFirstEarlyTx, doubling after each).
  std::atomic<uint32_t> batch_posts_{0};
  std::atomic<uint32_t> early_tx_at_{kFirstEarlyTx};
  std::atomic<bool> error_requested_{false};
  // A pure ACK held back by a reactor's post batch (EndPostBatch), cleared
  // when a transmit sends the response ring; hold_gen_ counts the holds, so
  // the progress thread's check can tell one that lasted a whole period.
  // RxInline found progress_mu_ busy: the progress thread looks at the
  // socket (OnKick), since the edge that reported the data is consumed.
  std::atomic<bool> rx_hint_{false};
  // A readiness event (the reactor's epoll, the io_uring poll) reported the
  // peer's end of stream or an error. Until then a read that returns less
  // than it asked for drained the socket (data arriving later raises a new
  // event); from then on it does not: the end is queued behind the data,
  // and nothing will report the socket again, so reads go on until one
  // returns 0 or fails (DoRx, Drained). Set before the thread that saw the
  // event takes progress_mu_ or kicks.
  std::atomic<bool> peer_ended_{false};
  std::atomic<bool> ack_held_{false};
  std::atomic<uint32_t> hold_gen_{0};
  uint32_t hold_gen_seen_ = 0;  // progress thread (CheckReactors)
  std::mutex mu_;
  uint64_t sq_head_ = 0;  // guarded by mu_: next slot to post
  uint64_t sq_tail_ = 0;  // guarded by mu_: oldest uncompleted slot
  // Slots [sq_tail_, sq_head_) are owned by the progress thread (published by
  // mu_); the others by posters holding mu_.
  std::vector<SendWqe> sq_;
  std::vector<ibv_sge> sq_sge_;
  std::vector<std::shared_ptr<MrEntry>> sq_mr_;
  std::vector<char> sq_inline_;

  // Guards everything below except the engine's bookkeeping (in_active_,
  // watching_in_, pollout_armed_: progress thread only). The progress thread
  // holds it in each entry point (OnKick, Service, OnTimer, ...); a poster
  // holds it while it transmits inline (TxInline, which only try_locks it).
  // Fields the engine also reads unlocked (fd_, removed_) are written only by
  // the progress thread. Lock order: progress_mu_ -> mu_ -> CQ mutexes.
  std::mutex progress_mu_;
  // True while another thread runs the transmit (TxInline) or receive
  // (RxInline) code: paths that need the progress thread (io_uring polls,
  // timers, the active list, errors, closing) set need_engine_ instead of
  // acting, and that thread kicks.
  bool inline_ = false;
  bool need_engine_ = false;
  bool want_tx_ = false;      // inline receive queued something to send
  bool timers_owed_ = false;  // an inline AddTimer left it to OnKick
  // The socket's readiness goes to the receive CQ's reactor (CqCore::AddRx),
  // not to the progress thread's io_uring poll.
  bool reactor_rx_ = false;
  // A reactor-received QP in the middle of bulk payloads: the reactor's
  // epoll interest is off and the progress thread's io_uring poll watches
  // (StartBulkRx / EndBulkRx).
  bool bulk_rx_ = false;
  uint32_t bulk_small_run_ = 0;  // frames of kInlineBulk or less in a row
  bool progress_watches_in() const { return !reactor_rx_ || bulk_rx_; }
  // End of stream (-1) or the errno that an inline receive met, for the
  // progress thread to act on.
  int rx_fault_ = 0;

  // ---- Progress thread (or an inline poster, see above).
  int fd_ = -1;
  bool removed_ = false;
  // ---- Progress thread only (engine bookkeeping).
  bool in_active_ = false;
  bool watching_in_ = false;
  uint8_t in_gen_ = 0;  // the current POLLIN poll's generation (its CQEs')
  bool pollout_armed_ = false;
  // ---- Progress thread (or an inline poster).
  bool rx_ready_ = false;
  bool tx_blocked_ = false;
  bool err_ = false;
  bool closed_ = false;
  bool fin_sent_ = false;
  bool hello_sent_ = false;
  bool hello_rx_ = false;
  uint32_t peer_qpn_ = 0;
  SteadyTime close_deadline_{};
  // Requester.
  uint64_t head_cache_ = 0;
  uint64_t send_ptr_ = 0;  // next WQE to transmit
  uint64_t comp_ptr_ = 0;  // oldest WQE not completed
  uint32_t rd_atomic_out_ = 0;
  bool rnr_wait_ = false;
  SteadyTime rnr_until_{};
  // RC's transport timer (QpInit timeout, retry_cnt): while requests are
  // outstanding and nothing moves -- no byte accepted by the socket, none
  // received from the peer -- for AckTimeout(), the oldest request fails
  // with IBV_WC_RETRY_EXC_ERR and the QP goes to error. TCP retransmits;
  // what this catches is a peer whose process froze or hung.
  SteadyTime progress_at_{};
  SteadyTime ack_due_{};
  bool ack_timer_armed_ = false;
  void NoteProgress();
  void ArmAckTimer();
  std::chrono::nanoseconds AckTimeout() const;
  // Responder.
  uint64_t expected_seq_ = 0;
  bool rnr_drop_ = false;
  Ring<Ctrl> ctrl_;
  // Receive framing.
  std::unique_ptr<char[]> rbuf_;
  size_t rpos_ = 0;
  size_t rend_ = 0;
  bool in_payload_ = false;
  wire::Header cur_;
  uint64_t pay_left_ = 0;
  RxKind rx_kind_ = RxKind::kDiscard;
  bool rx_err_ = false;  // a destination became invalid during placement
  Dest dests_[kMaxSge];
  uint32_t ndest_ = 0;
  uint32_t dest_idx_ = 0;
  size_t dest_off_ = 0;
  RecvWqe cur_recv_;
  bool have_cur_recv_ = false;
  MrPin rx_mr_;  // WRITE target being filled
  alignas(8) char atomic_buf_[wire::kAtomicReqSize];
  // Transmit batch.
  std::unique_ptr<char[]> arena_;
  size_t arena_used_ = 0;
  std::vector<Seg> segs_;
  size_t nsegs_ = 0;
  size_t seg_idx_ = 0;
  size_t seg_off_ = 0;
};

// A post batch on the calling thread (called in pairs; they nest): a
// PostSend inside one leaves its QP's new frames for EndPostBatch, which
// transmits them inline -- all the frames a thread posted to a QP during
// the batch in one sendmsg -- or kicks the progress thread where that is not
// possible. Every EndPostBatch hands on what was held back, so nothing waits
// longer than the batch. The soft CQ's BeginBatch / EndBatch, that is a
// reactor's loop iteration.
void BeginPostBatch();
void EndPostBatch();
// Outside any batch (a reactor about to sleep polls its CQ empty): sends
// the ACKs the last batch held back.
void FlushHeldAcks();

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_QP_CORE_H_
