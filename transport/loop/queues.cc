#include "transport/loop/queues.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/loop/qp.h"

namespace coverbs::transport::loop {

// ---------------------------------------------------------------------------
// CqCore

absl::StatusOr<std::shared_ptr<CqCore>> CqCore::Create(
    int capacity, std::shared_ptr<AsyncQueue> async) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) {
    return absl::InternalError(absl::StrFormat(
        "loop: eventfd for a completion channel: %s", strerror(errno)));
  }
  return std::shared_ptr<CqCore>(new CqCore(capacity, fd, std::move(async)));
}

CqCore::~CqCore() { close(fd_); }

bool CqCore::Push(const ibv_wc& wc) {
  bool signal = false;
  bool report_overrun = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (overrun_) return false;
    if (head_ - tail_ >= ring_.size()) {
      overrun_ = true;
      overrun_seen_.store(true, std::memory_order_release);
      report_overrun = true;
    } else {
      ring_[head_ % ring_.size()] = wc;
      ++head_;
      count_.store(head_ - tail_, std::memory_order_release);
      signal = armed_;
      armed_ = false;
    }
  }
  if (signal) {
    uint64_t one = 1;
    ssize_t n = write(fd_, &one, sizeof(one));
    (void)n;
  }
  if (report_overrun && async_) {
    async_->Push(AsyncEvent{
        IBV_EVENT_CQ_ERR, 0,
        absl::StrFormat("loop: CQ overrun (capacity %d): a completion of qp "
                        "%u was lost",
                        capacity(), wc.qp_num)});
  }
  return !report_overrun;
}

int CqCore::Poll(int n, ibv_wc* out) {
  if (n <= 0) return n == 0 ? 0 : -EINVAL;
  if (count_.load(std::memory_order_acquire) == 0) {
    return overrun_seen_.load(std::memory_order_acquire) ? -EOVERFLOW : 0;
  }
  std::lock_guard<std::mutex> lock(mu_);
  int got = 0;
  while (got < n && tail_ != head_) {
    out[got++] = ring_[tail_ % ring_.size()];
    ++tail_;
  }
  count_.store(head_ - tail_, std::memory_order_release);
  if (got == 0 && overrun_) return -EOVERFLOW;
  return got;
}

void CqCore::RequestNotify() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
}

int CqCore::GetEvents() {
  uint64_t v = 0;
  ssize_t n = read(fd_, &v, sizeof(v));
  if (n != sizeof(v)) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  events_ += v;
  return static_cast<int>(v);
}

void CqCore::AckEvents(unsigned n) {
  std::lock_guard<std::mutex> lock(mu_);
  acked_ += n;
}

uint64_t CqCore::unacked_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_ > acked_ ? events_ - acked_ : 0;
}

// ---------------------------------------------------------------------------
// RecvRing and SrqCore

absl::Status RecvRing::Post(ibv_recv_wr* wr, ibv_recv_wr** bad,
                            const char* who, uint32_t num) {
  for (; wr != nullptr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > max_sge_ ||
        (wr->num_sge > 0 && wr->sg_list == nullptr)) {
      if (bad) *bad = wr;
      return absl::InvalidArgumentError(absl::StrFormat(
          "loop: post recv on %s %u: num_sge %d (0..%u) or a null sg_list "
          "(EINVAL)",
          who, num, wr->num_sge, max_sge_));
    }
    if (head_ - tail_ >= capacity_) {
      if (bad) *bad = wr;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "loop: post recv on %s %u: receive queue full (%u WRs) (ENOMEM)",
          who, num, capacity_));
    }
    const size_t i = head_ % capacity_;
    ids_[i] = wr->wr_id;
    counts_[i] = static_cast<uint32_t>(wr->num_sge);
    if (wr->num_sge > 0) {
      std::memcpy(&sges_[i * std::max<uint32_t>(max_sge_, 1)], wr->sg_list,
                  sizeof(ibv_sge) * wr->num_sge);
    }
    ++head_;
  }
  return absl::OkStatus();
}

RecvWqe RecvRing::Front() const {
  const size_t i = tail_ % capacity_;
  return RecvWqe{ids_[i], counts_[i],
                 &sges_[i * std::max<uint32_t>(max_sge_, 1)]};
}

absl::Status SrqCore::Post(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::vector<std::shared_ptr<QpCore>> qps;
  absl::Status s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = ring_.Post(wr, bad, "SRQ of PD", static_cast<uint32_t>(pd_id_));
    qps.reserve(qps_.size());
    for (auto it = qps_.begin(); it != qps_.end();) {
      if (std::shared_ptr<QpCore> q = it->lock()) {
        qps.push_back(std::move(q));
        ++it;
      } else {
        it = qps_.erase(it);
      }
    }
  }
  // Outside the lock: a held SEND takes the receive through Take.
  for (const auto& q : qps) q->ReleaseHeldSends();
  return s;
}

bool SrqCore::Take(RecvWqe* out, ibv_sge* sges) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_.empty()) return false;
  RecvWqe w = ring_.Front();
  std::memcpy(sges, w.sge, sizeof(ibv_sge) * w.num_sge);
  w.sge = sges;
  ring_.Pop();
  *out = w;
  return true;
}

void SrqCore::Attach(std::weak_ptr<QpCore> qp) {
  std::lock_guard<std::mutex> lock(mu_);
  qps_.push_back(std::move(qp));
}

}  // namespace coverbs::transport::loop
