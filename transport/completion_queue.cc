#include "transport/completion_queue.h"

#include <poll.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "core/log.h"

namespace coverbs::transport {

absl::StatusOr<std::unique_ptr<CompletionQueue>> CompletionQueue::Create(
    Device& device, Reactor& reactor, int cqe) {
  if (cqe <= 0) cqe = DefaultEntries(device);
  auto cq = device.provider()->CreateCq(cqe);
  if (!cq.ok()) return cq.status();
  std::unique_ptr<CompletionQueue> q(
      new CompletionQueue(&device, &reactor, *std::move(cq)));
  reactor.AddPoller(q.get());
  q->WatchChannel();
  return q;
}

int CompletionQueue::DefaultEntries(const Device& device) {
  // 4096 serves eight 256+256 QPs. (Larger CQs once made rdma_create_qp
  // fail with EINVAL on siw: a mapping at offset 0x90000, which the verbs
  // provider now reserves; see PlugSiwMmapOffset.)
  return static_cast<int>(std::min<uint32_t>(
      device.caps().max_cqe ? device.caps().max_cqe : 4096, 4096));
}

CompletionQueue::CompletionQueue(Device* d, Reactor* r,
                                 std::unique_ptr<ProviderCq> cq)
    : device_(d), reactor_(r), cq_(std::move(cq)) {}

CompletionQueue::~CompletionQueue() {
  reactor_->RemovePoller(this);
  if (watch_slot_ != nullptr) reactor_->CancelIo(watch_slot_, /*detach=*/true);
  // Consume and acknowledge every channel event before the CQ goes away.
  int n = cq_->GetEvents();
  if (n > 0) unacked_ += n;
  if (unacked_ > 0) cq_->AckEvents(unacked_);
  if (in_flight_ != 0 || reserved_ != 0) {
    COVERBS_LOG(kWarning, "transport",
                "CompletionQueue on %s destroyed with %d operations in "
                "flight and %d slots reserved",
                device_->name(), in_flight_, reserved_);
  }
}

absl::Status CompletionQueue::Reserve(int n) {
  if (reserved_ + n > cq_->capacity()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "completion queue on %s is full: %d of %d entries reserved, %d more "
        "requested (create the CQ larger or use fewer/smaller QPs)",
        device_->name(), reserved_, cq_->capacity(), n));
  }
  reserved_ += n;
  return absl::OkStatus();
}

void CompletionQueue::WatchChannel() {
  io_uring_sqe* sqe = reactor_->PrepareIo(this, &watch_slot_);
  if (sqe == nullptr) {
    watch_slot_ = nullptr;
    return;
  }
  io_uring_prep_poll_add(sqe, cq_->fd(), POLLIN);
}

void CompletionQueue::OnIoComplete(int32_t res, uint32_t) {
  watch_slot_ = nullptr;
  if (res < 0 && res != -ECANCELED) {
    COVERBS_LOG(kError, "transport", "poll on completion channel of %s: %s",
                device_->name(), strerror(-res));
  }
  int n = cq_->GetEvents();
  if (n > 0) {
    events_ += n;
    unacked_ += n;
    // The event consumed the arm: PrepareToSleep re-arms.
    armed_ = false;
  }
  if (unacked_ >= kAckBatch) {
    cq_->AckEvents(unacked_);
    unacked_ = 0;
  }
  Drain();
  WatchChannel();
}

int CompletionQueue::Drain() {
  int total = 0;
  for (;;) {
    int n = Poll();
    total += n;
    if (n < kPollBatch) return total;
  }
}

int CompletionQueue::Poll() {
  ibv_wc wc[kPollBatch];
  int n = cq_->Poll(kPollBatch, wc);
  if (n <= 0) return 0;
  completions_ += n;
  for (int i = 0; i < n; ++i) {
    WorkRequest* wr = WorkRequest::FromWrId(wc[i].wr_id);
    if (wc[i].status != IBV_WC_SUCCESS) {
      auto it = owners_.find(wc[i].qp_num);
      if (it != owners_.end() && !it->second->HasPosted(wr, wc[i])) {
        ++stray_;
        COVERBS_LOG(kWarning, "transport",
                    "QP 0x%x on %s: a %s completion for a work request it "
                    "does not have posted (already completed: a device "
                    "bug); ignored",
                    wc[i].qp_num, device_->name(),
                    ibv_wc_status_str(wc[i].status));
        continue;
      }
    }
    wr->OnCompletion(wc[i]);
  }
  return n;
}

bool CompletionQueue::PrepareToSleep() {
  if (Drain() > 0) return false;
  if (!armed_) {
    absl::Status s = cq_->RequestNotify();
    if (!s.ok()) {
      COVERBS_LOG(kError, "transport", "arming CQ on %s: %s", device_->name(),
                  s.ToString());
      return true;
    }
    armed_ = true;
    // A completion that arrived before the arm raised no event: catch it.
    if (Drain() > 0) return false;
  }
  return true;
}

}  // namespace coverbs::transport
