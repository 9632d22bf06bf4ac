// The loop provider's RC queue pair. Both QPs of a connection live in this
// process and share a Wire: one mutex, under which either QP's work
// requests execute to the end -- the data copied through the memory-region
// table and the completions pushed -- on the thread that posts them. There
// is no progress thread and no time: a work request is done when PostSend
// returns, except a SEND (or WRITE_WITH_IMM) that finds no receive posted
// at the peer: with rnr_retry 7 (infinite) it is held, with every WR posted
// after it (RC order), until the peer posts a receive (on the peer's
// thread); with a finite rnr_retry it fails at once with
// IBV_WC_RNR_RETRY_EXC_ERR (no timer runs the retries).
//
// Errors: a fault completes its WR with the error status and moves the QP
// to IBV_QPS_ERR; the peer's QP goes to error with it (as the soft
// provider's closed socket: the connection is over), and both flush what
// they hold in posting order. Faults raise asynchronous events as the soft
// provider does: IBV_EVENT_QP_FATAL on the requester, and on the responder
// IBV_EVENT_QP_ACCESS_ERR for a refused key, range or access right,
// IBV_EVENT_QP_REQ_ERR for a message longer than its receive.
#ifndef COVERBS_TRANSPORT_LOOP_QP_H_
#define COVERBS_TRANSPORT_LOOP_QP_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "transport/loop/mr_table.h"
#include "transport/loop/queues.h"
#include "transport/provider.h"

namespace coverbs::transport::loop {

class QpCore;

// What the two QPs of a connection share. A QP gets its Wire when it is
// created (its own, or the peer's) and keeps it: the pointer never changes,
// so no thread ever reads it while another writes it.
struct Wire {
  std::mutex mu;
  QpCore* end[2] = {nullptr, nullptr};  // set by Connect, cleared by Destroy
};

struct QpConfig {
  uint32_t qp_num = 0;
  uint64_t pd_id = 0;
  QpInit init;  // its CQ and SRQ pointers unused: the cores below
  std::shared_ptr<CqCore> send_cq, recv_cq;
  std::shared_ptr<SrqCore> srq;
  std::shared_ptr<AsyncQueue> async;  // may be null
};

class QpCore : public std::enable_shared_from_this<QpCore> {
 public:
  QpCore(QpConfig cfg, std::shared_ptr<Wire> wire);
  QpCore(const QpCore&) = delete;

  uint32_t qp_num() const { return cfg_.qp_num; }
  const QpConfig& config() const { return cfg_; }
  const std::shared_ptr<Wire>& wire() const { return wire_; }
  ibv_qp_state state() const { return state_.load(std::memory_order_acquire); }

  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad);
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad);
  // Moves this QP (and its peer) to the error state: both flush.
  void SetError();
  // The provider QP is being destroyed: the peer goes to error, this QP
  // completes nothing more (verbs: callers drain before destroying).
  void Destroy();
  // A receive was posted to this QP's SRQ: runs what the peer was holding.
  void ReleaseHeldSends();

  // Connects two QPs in IBV_QPS_INIT that share one Wire (the second was
  // created with the first's) and moves both to IBV_QPS_RTS.
  static absl::Status Connect(QpCore* a, QpCore* b);

 private:
  // A send WR waiting behind a held SEND, with copies of what the caller
  // may reuse once PostSend returns: its SGE list and inline data.
  struct Pending {
    ibv_send_wr wr{};
    ibv_sge sge[kMaxSge];
    std::vector<char> inline_bytes;
  };
  // How one execution went.
  struct Outcome {
    enum Kind { kDone, kHeld, kFailed } kind = kDone;
    ibv_wc_status status = IBV_WC_SUCCESS;
    std::string why;
    uint32_t byte_len = 0;  // of the send completion (READ, atomics)
    // The event the peer raises when this failure takes it down with us.
    std::optional<ibv_event_type> peer_event;
  };

  // Everything below runs under wire_->mu.
  QpCore* PeerLocked() const { return wire_->end[1 - side_]; }
  absl::Status CheckSendWr(const ibv_send_wr& wr) const;
  // Posts one WR: executes it at once when nothing is waiting before it.
  void PostOneLocked(const ibv_send_wr& wr);
  void SavePendingLocked(const ibv_send_wr& wr);
  // Runs the waiting WRs in order until one is held or none is left.
  void DrainPendingLocked();
  // Executes `wr`; `inline_bytes` non-null: its data, copied at post.
  Outcome ExecuteLocked(const ibv_send_wr& wr,
                        const std::vector<char>* inline_bytes);
  // The peer's next receive (its own queue's or its SRQ's); false if none.
  bool TakeRecvLocked(RecvWqe* out, ibv_sge* sges);
  // After an execution: completes `wr` as `o` says (a failure moves the QP
  // and its peer to error).
  void FinishLocked(const ibv_send_wr& wr, const Outcome& o);
  void CompleteSendLocked(const ibv_send_wr& wr, ibv_wc_status status,
                          uint32_t byte_len);
  // Moves this QP to error (flushing its waiting sends and its receive
  // queue in posting order) and the peer with it. `event`: the async event
  // this QP raises; `peer_event`: the peer's.
  void EnterErrorLocked(std::optional<ibv_event_type> event,
                        std::optional<ibv_event_type> peer_event,
                        const std::string& why);
  void FlushLocked();
  void RaiseLocked(ibv_event_type type, const std::string& why);
  bool signaled(const ibv_send_wr& wr) const {
    return cfg_.init.sq_sig_all || (wr.send_flags & IBV_SEND_SIGNALED) != 0;
  }

  const QpConfig cfg_;
  const std::shared_ptr<Wire> wire_;
  int side_ = 0;  // index in wire_->end; set by Connect
  std::atomic<ibv_qp_state> state_{IBV_QPS_INIT};
  bool destroyed_ = false;
  RecvRing rq_;
  std::deque<Pending> pending_;
};

}  // namespace coverbs::transport::loop

#endif  // COVERBS_TRANSPORT_LOOP_QP_H_
