// Completion queues, receive rings (a QP's receive queue or an SRQ) and the
// asynchronous event queue of the loop provider.
//
// Threads: the two QPs of a connection may be driven by different reactor
// threads, and a work request runs to the end on the thread that posted it
// (or that posted the receive it was waiting for), so a completion may be
// pushed into a CQ from any thread. CqCore and AsyncQueue lock themselves;
// a RecvRing is guarded by its owner (the connection's mutex for a QP's
// receive queue, SrqCore's mutex for a shared one).
#ifndef COVERBS_TRANSPORT_LOOP_QUEUES_H_
#define COVERBS_TRANSPORT_LOOP_QUEUES_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/async_queue.h"
#include "transport/provider.h"

namespace coverbs::transport::loop {

inline constexpr uint32_t kMaxSge = 16;

class QpCore;

using transport::AsyncQueue;

// A completion queue with verbs' completion-channel mechanics: fd() is an
// eventfd that a Push into an armed CQ (RequestNotify, one-shot) makes
// readable; GetEvents reads it (non-blocking) and returns how many events
// it consumed.
class CqCore {
 public:
  static absl::StatusOr<std::shared_ptr<CqCore>> Create(
      int capacity, std::shared_ptr<AsyncQueue> async);
  ~CqCore();

  int fd() const { return fd_; }
  int capacity() const { return static_cast<int>(ring_.size()); }

  // Appends a completion (any thread). On overrun the completion is
  // dropped, the CQ is in error from then on (Poll: -EOVERFLOW) and
  // IBV_EVENT_CQ_ERR is raised once; returns false.
  bool Push(const ibv_wc& wc);
  int Poll(int n, ibv_wc* out);
  void RequestNotify();
  int GetEvents();
  void AckEvents(unsigned n);
  uint64_t unacked_events() const;

 private:
  CqCore(int capacity, int fd, std::shared_ptr<AsyncQueue> async)
      : fd_(fd), async_(std::move(async)), ring_(capacity) {}

  const int fd_;
  const std::shared_ptr<AsyncQueue> async_;
  mutable std::mutex mu_;
  std::vector<ibv_wc> ring_;
  uint64_t head_ = 0;  // next to write
  uint64_t tail_ = 0;  // next to poll
  bool armed_ = false;
  bool overrun_ = false;
  uint64_t events_ = 0;
  uint64_t acked_ = 0;
  // head_ - tail_ and overrun_, for Poll's lock-free empty check (a reactor
  // polls an empty CQ far more often than a full one).
  std::atomic<uint64_t> count_{0};
  std::atomic<bool> overrun_seen_{false};
};

// A posted receive.
struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t num_sge = 0;
  const ibv_sge* sge = nullptr;  // num_sge entries, inside the ring
};

// A ring of posted receives. Not synchronized: its owner locks.
class RecvRing {
 public:
  RecvRing(uint32_t capacity, uint32_t max_sge)
      : capacity_(capacity),
        max_sge_(max_sge),
        ids_(capacity),
        counts_(capacity),
        sges_(static_cast<size_t>(capacity) * (max_sge ? max_sge : 1)) {}

  // Like ibv_post_recv: EINVAL (InvalidArgument) for too many SGEs, ENOMEM
  // (ResourceExhausted) when full; `*bad` names the WR that failed and the
  // ones before it are posted. `who` names the queue in errors.
  absl::Status Post(ibv_recv_wr* wr, ibv_recv_wr** bad, const char* who,
                    uint32_t num);
  bool empty() const { return head_ == tail_; }
  // The oldest receive; valid until the next Post or Pop.
  RecvWqe Front() const;
  void Pop() { ++tail_; }
  uint32_t capacity() const { return capacity_; }

 private:
  const uint32_t capacity_;
  const uint32_t max_sge_;
  std::vector<uint64_t> ids_;
  std::vector<uint32_t> counts_;
  std::vector<ibv_sge> sges_;
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
};

// A shared receive queue: a RecvRing under its own lock, and the QPs that
// receive from it, so that a receive posted here can release a SEND that
// a peer of one of them is holding (RNR).
class SrqCore {
 public:
  SrqCore(uint32_t capacity, uint32_t max_sge, uint64_t pd_id)
      : ring_(capacity, max_sge), pd_id_(pd_id) {}
  absl::Status Post(ibv_recv_wr* wr, ibv_recv_wr** bad);
  // Takes the oldest receive into `out` (its SGEs copied to `sges`, which
  // holds kMaxSge); false when empty.
  bool Take(RecvWqe* out, ibv_sge* sges);
  void Attach(std::weak_ptr<QpCore> qp);
  uint64_t pd_id() const { return pd_id_; }

 private:
  std::mutex mu_;
  RecvRing ring_;
  const uint64_t pd_id_;
  std::vector<std::weak_ptr<QpCore>> qps_;  // mu_
};

}  // namespace coverbs::transport::loop

#endif  // COVERBS_TRANSPORT_LOOP_QUEUES_H_
