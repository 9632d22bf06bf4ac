// Completion queues, receive queues (a QP's own RQ or an SRQ) and the
// provider's asynchronous event queue of the soft provider. They are shared
// between the application threads and the progress thread; each guards its
// state with its own mutex.
#ifndef COVERBS_TRANSPORT_SOFT_QUEUES_H_
#define COVERBS_TRANSPORT_SOFT_QUEUES_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/async_queue.h"
#include "transport/provider.h"
#include "transport/soft/mr_table.h"

namespace coverbs::transport::soft {

inline constexpr uint32_t kMaxSge = 16;

class QpCore;

using transport::AsyncQueue;

// A completion queue with verbs' completion-channel mechanics. Push is called
// by whoever runs a QP's receive (the progress thread, or the reactor that
// drives the QP's receive CQ, below); the rest by the application (any
// thread).
//
// fd() is an epoll instance holding the channel's eventfd, so that it is
// readable exactly when the eventfd is. A CQ that a reactor drives (its
// BeginBatch was called: the reactor watches fd() and calls GetEvents
// whenever it is readable) also gets the sockets of the QPs that receive
// into it (edge-triggered): their data wakes the reactor directly, and
// GetEvents receives it on the reactor's thread (QpCore::RxInline) instead
// of the progress thread. Why: on the progress thread every message crossed
// two threads (the progress thread's wake-up, then the CQ's eventfd wake-up
// of the reactor), which cost most of a small message's CPU.
class CqCore {
 public:
  static absl::StatusOr<std::shared_ptr<CqCore>> Create(
      int capacity, std::shared_ptr<AsyncQueue> async);
  ~CqCore();

  int fd() const { return epfd_; }
  int capacity() const { return static_cast<int>(ring_.size()); }

  // Appends a completion. On overrun the completion is dropped, the CQ is
  // marked in error (once: IBV_EVENT_CQ_ERR) and false is returned. A push
  // from inside this CQ's own GetEvents raises no channel event: the caller
  // polls after GetEvents anyway.
  bool Push(const ibv_wc& wc);

  int Poll(int n, ibv_wc* out);
  void RequestNotify();
  // Receives for the QPs whose sockets are ready (reactor-driven CQ), then
  // consumes the channel events; returns their number (0 when only socket
  // data woke the caller).
  int GetEvents();
  void AckEvents(unsigned n);
  uint64_t unacked_events() const;

  // ---- Reactor receive (see above).
  // The owning reactor's loop iteration (SoftCq::BeginBatch): marks the CQ
  // driven. Its heartbeat counts the GetEvents calls that received.
  void NoteDriven() {
    if (!driven_.load(std::memory_order_relaxed)) driven_.store(true);
  }
  // The reactor let go of the CQ (SoftCq destroyed).
  void Undrive() { driven_.store(false); }
  bool driven() const { return driven_.load(std::memory_order_relaxed); }
  uint64_t heartbeat() const {
    return heartbeat_.load(std::memory_order_relaxed);
  }
  // Progress thread: adds / removes a connected QP's socket (with the QP's
  // engine id). False if epoll refused it (the QP then stays with the
  // progress thread).
  bool AddRx(uint64_t id, int fd, std::weak_ptr<QpCore> qp);
  void RemoveRx(uint64_t id, int fd);
  // Turns the reactor's notifications for a QP's socket off (the progress
  // thread receives its bulk data) or back on; on again with data waiting,
  // the reactor is woken for it.
  void SetRxInterest(uint64_t id, int fd, bool on);
  // Progress thread, for a reactor that stopped turning: takes the ids of
  // the QPs whose sockets became ready (instead of the reactor), and
  // whether their events reported the peer's end.
  struct ReadyRx {
    uint64_t id;
    bool ended;
  };
  void TakeReady(std::vector<ReadyRx>* ready);

 private:
  CqCore(int capacity, int fd, int epfd, std::shared_ptr<AsyncQueue> async);

  const int fd_;    // the channel's eventfd
  const int epfd_;  // what fd() returns
  // One writer (the driving reactor): no read-modify-write needed.
  void Beat() {
    heartbeat_.store(heartbeat_.load(std::memory_order_relaxed) + 1,
                     std::memory_order_relaxed);
  }

  std::atomic<bool> driven_{false};
  std::atomic<uint64_t> heartbeat_{0};
  std::atomic<int> rx_count_{0};  // QPs in rx_
  std::mutex rx_mu_;              // not held with any other lock
  absl::flat_hash_map<uint64_t, std::weak_ptr<QpCore>> rx_;  // rx_mu_
  const std::shared_ptr<AsyncQueue> async_;
  mutable std::mutex mu_;
  std::vector<ibv_wc> ring_;
  uint64_t head_ = 0;  // next to write
  uint64_t tail_ = 0;  // next to poll
  bool armed_ = false;
  bool overrun_ = false;
  uint64_t events_ = 0;  // delivered through GetEvents
  uint64_t acked_ = 0;
  std::atomic<uint64_t> count_{0};  // head_ - tail_, for a lock-free empty check
  std::atomic<bool> overrun_seen_{false};  // overrun_, for the same check
};

// A posted receive, as the progress thread consumes it.
struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  uint8_t status = IBV_WC_SUCCESS;  // IBV_WC_LOC_PROT_ERR: an SGE failed checks
  uint64_t total = 0;
  ibv_sge sge[kMaxSge];
  std::shared_ptr<MrEntry> mr[kMaxSge];
};

// A ring of posted receive WRs: a QP's receive queue or an SRQ.
class RecvQueue {
 public:
  RecvQueue(uint32_t capacity, uint32_t max_sge, uint64_t pd_id);

  // Application: like ibv_post_recv. SGEs are checked against the MR table
  // here; a failing SGE does not fail the post but makes the WR complete with
  // IBV_WC_LOC_PROT_ERR when a message lands in it.
  absl::Status Post(ibv_recv_wr* wr, ibv_recv_wr** bad, uint32_t qp_num);

  // Progress thread: moves the oldest WR into `out`; false when empty.
  bool Take(RecvWqe* out);
  // Progress thread: removes every WR, oldest first, into `out` (ids only).
  void TakeAllIds(std::vector<uint64_t>* out);

  uint32_t capacity() const { return capacity_; }
  uint32_t max_sge() const { return max_sge_; }

 private:
  struct Slot {
    uint64_t wr_id;
    uint32_t num_sge;
    uint8_t status;
    uint64_t total;
  };
  const uint32_t capacity_;
  const uint32_t max_sge_;
  const uint64_t pd_id_;
  std::mutex mu_;
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
  std::vector<Slot> slots_;
  std::vector<ibv_sge> sges_;
  std::vector<std::shared_ptr<MrEntry>> mrs_;
};

// Checks a local SGE against the MR table for `pd_id`. Returns the region or
// nullptr (a local protection error).
const std::shared_ptr<MrEntry>* CheckLocalSge(const MrTable::Reader& table,
                                              uint64_t pd_id,
                                              const ibv_sge& sge,
                                              bool nic_writes);

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_QUEUES_H_
