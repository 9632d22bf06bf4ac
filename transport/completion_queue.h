// CompletionQueue: the completion-channel reactor.
//
// One CompletionQueue per Reactor, shared by every QP on that reactor. It is
// a core Poller, so the reactor's polling policy applies to it:
//  - kEvent: the completion channel fd is watched through io_uring; when it
//    fires the CQ gets its channel events (acked in batches), and is polled
//    in batches of kPollBatch until empty; before the reactor sleeps the CQ
//    is re-armed and polled once more (a completion that slipped in between
//    the last poll and the arm is not lost).
//  - kBusy / kAdaptive: the reactor calls Poll() every iteration.
//
// Each ibv_wc carries in wr_id a pointer to a WorkRequest living inside the
// waiting coroutine's frame (bit 0 is free for the owner's use); dispatch is
// a virtual call, with no allocation and no lookup. Work requests only
// schedule coroutines; nothing is resumed inline.
#ifndef COVERBS_TRANSPORT_COMPLETION_QUEUE_H_
#define COVERBS_TRANSPORT_COMPLETION_QUEUE_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "transport/device.h"
#include "transport/provider.h"

namespace coverbs::transport {

// Anything whose address is posted as a wr_id.
class WorkRequest {
 public:
  virtual void OnCompletion(const ibv_wc& wc) = 0;
  static WorkRequest* FromWrId(uint64_t wr_id) {
    return reinterpret_cast<WorkRequest*>(wr_id & ~uint64_t{1});
  }

 protected:
  ~WorkRequest() = default;
};

// Knows which work requests it has posted and not seen complete (a QP).
class WrOwner {
 public:
  virtual bool HasPosted(const WorkRequest* wr, const ibv_wc& wc) const = 0;

 protected:
  ~WrOwner() = default;
};

class CompletionQueue final : public Poller, private internal::IoCompletion {
 public:
  static constexpr int kPollBatch = 32;
  // Channel events are acknowledged in batches of this many (and all at
  // destruction: ibv_destroy_cq waits for unacknowledged events).
  static constexpr unsigned kAckBatch = 64;

  // `cqe` = 0 sizes the CQ from the device: DefaultEntries(device).
  static absl::StatusOr<std::unique_ptr<CompletionQueue>> Create(
      Device& device, Reactor& reactor, int cqe = 0);
  // min(max_cqe, 4096).
  static int DefaultEntries(const Device& device);
  ~CompletionQueue() override;
  CompletionQueue(const CompletionQueue&) = delete;

  Reactor* reactor() const { return reactor_; }
  Device* device() const { return device_; }
  ProviderCq* provider() const { return cq_.get(); }
  int capacity() const { return cq_->capacity(); }

  // CQ slots are reserved by QPs (every WR that can complete needs one) so
  // a CQ never overruns; Reserve fails with ResourceExhausted when full.
  absl::Status Reserve(int n);
  void Unreserve(int n) { reserved_ -= n; }
  int reserved() const { return reserved_; }
  int free_entries() const { return capacity() - reserved_; }

  // Outstanding operations (drives adaptive polling).
  void AddInFlight(int n) { in_flight_ += n; }

  // Error completions are checked against their QP before dispatch: siw
  // (Linux 6.1) flushes an RDMA READ that already completed with an error a
  // second time, and that wr_id may point at a finished operation's freed
  // frame. Only failed completions pay for the check; successful ones go
  // straight to their operation.
  void RegisterOwner(uint32_t qp_num, const WrOwner* owner) {
    owners_[qp_num] = owner;
  }
  // Only if `owner` still holds the number (an abandoned QP's number may
  // already belong to a new QP).
  void UnregisterOwner(uint32_t qp_num, const WrOwner* owner) {
    auto it = owners_.find(qp_num);
    if (it != owners_.end() && it->second == owner) owners_.erase(it);
  }
  // Error completions dropped because their QP had no such work request.
  uint64_t stray_completions() const { return stray_; }

  // Poller.
  int Poll() override;
  bool InFlight() const override { return in_flight_ > 0; }
  bool PrepareToSleep() override;
  void BeginIteration() override { cq_->BeginBatch(); }
  void EndIteration() override { cq_->EndBatch(); }

  // Statistics.
  uint64_t completions() const { return completions_; }
  uint64_t channel_events() const { return events_; }

 private:
  CompletionQueue(Device* d, Reactor* r, std::unique_ptr<ProviderCq> cq);
  void OnIoComplete(int32_t res, uint32_t flags) override;
  void WatchChannel();
  int Drain();

  Device* device_;
  Reactor* reactor_;
  std::unique_ptr<ProviderCq> cq_;
  internal::IoSlot* watch_slot_ = nullptr;
  bool armed_ = false;
  unsigned unacked_ = 0;
  int reserved_ = 0;
  int64_t in_flight_ = 0;
  uint64_t completions_ = 0;
  uint64_t events_ = 0;
  uint64_t stray_ = 0;
  std::unordered_map<uint32_t, const WrOwner*> owners_;
};

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_COMPLETION_QUEUE_H_
