#include "transport/soft/queues.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/soft/qp_core.h"

namespace coverbs::transport::soft {
namespace {

// The CQ whose GetEvents is receiving on this thread: its own pushes raise
// no channel event (the caller polls right after).
thread_local const CqCore* t_receiving = nullptr;

constexpr int kReadyBatch = 64;  // epoll events taken per GetEvents

// A socket's data, and (EPOLLRDHUP) its peer's end of stream: an event
// harvested after the end arrived says so, and the reader then knows that a
// short read does not mean drained (QpCore::peer_ended_).
constexpr uint32_t kRxEvents = EPOLLIN | EPOLLRDHUP | EPOLLET;

bool Ended(uint32_t events) {
  return (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
}

}  // namespace

// ---------------------------------------------------------------------------
// CqCore

absl::StatusOr<std::shared_ptr<CqCore>> CqCore::Create(
    int capacity, std::shared_ptr<AsyncQueue> async) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) {
    return absl::InternalError(absl::StrFormat(
        "soft: eventfd for a completion channel: %s", strerror(errno)));
  }
  int epfd = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: readable exactly when fd is
  ev.data.u64 = 0;      // engine ids start at 1
  if (epfd < 0 || epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
    absl::Status s = absl::InternalError(absl::StrFormat(
        "soft: epoll for a completion channel: %s", strerror(errno)));
    if (epfd >= 0) close(epfd);
    close(fd);
    return s;
  }
  return std::shared_ptr<CqCore>(
      new CqCore(capacity, fd, epfd, std::move(async)));
}

CqCore::CqCore(int capacity, int fd, int epfd,
               std::shared_ptr<AsyncQueue> async)
    : fd_(fd), epfd_(epfd), async_(std::move(async)), ring_(capacity) {}

CqCore::~CqCore() {
  close(epfd_);
  close(fd_);
}

bool CqCore::AddRx(uint64_t id, int fd, std::weak_ptr<QpCore> qp) {
  {
    std::lock_guard<std::mutex> lock(rx_mu_);
    rx_[id] = std::move(qp);
  }
  rx_count_.fetch_add(1);
  epoll_event ev{};
  // Edge-triggered: each arrival wakes the reactor once; RxInline reads
  // until the socket is drained (or leaves the rest to the progress thread).
  ev.events = kRxEvents;
  ev.data.u64 = id;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) == 0) return true;
  RemoveRx(id, -1);
  return false;
}

void CqCore::RemoveRx(uint64_t id, int fd) {
  if (fd >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  std::lock_guard<std::mutex> lock(rx_mu_);
  if (rx_.erase(id) > 0) rx_count_.fetch_sub(1);
}

void CqCore::SetRxInterest(uint64_t id, int fd, bool on) {
  epoll_event ev{};
  // Errors and hang-ups are reported even without EPOLLIN: RxInline then
  // finds the QP with the progress thread and leaves it there.
  ev.events = on ? kRxEvents : EPOLLET;
  ev.data.u64 = id;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev);
}

void CqCore::TakeReady(std::vector<ReadyRx>* ready) {
  epoll_event evs[kReadyBatch];
  int n = epoll_wait(epfd_, evs, kReadyBatch, 0);
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 != 0) {
      ready->push_back(ReadyRx{evs[i].data.u64, Ended(evs[i].events)});
    }
  }
}

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
      if (armed_ && t_receiving != this) {
        armed_ = false;
        signal = true;
      }
    }
  }
  if (signal) {
    uint64_t one = 1;
    ssize_t n = write(fd_, &one, sizeof(one));
    (void)n;
  }
  if (report_overrun) {
    if (async_) {
      async_->Push(AsyncEvent{
          IBV_EVENT_CQ_ERR, 0,
          absl::StrFormat("soft: CQ overrun (capacity %d): a completion of "
                          "qp %u was lost",
                          capacity(), wc.qp_num)});
    }
    return false;
  }
  return true;
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
  // Whether the eventfd may hold events (always, when epoll did not say).
  bool channel = true;
  if (rx_count_.load(std::memory_order_relaxed) > 0) {
    Beat();
    epoll_event evs[kReadyBatch];
    int n = epoll_wait(epfd_, evs, kReadyBatch, 0);
    std::shared_ptr<QpCore> qps[kReadyBatch];
    bool ended[kReadyBatch];
    int nq = 0;
    // The eventfd is level-triggered in the set: a full batch may have left
    // it out, a shorter one reports it when it is readable.
    channel = n == kReadyBatch;
    if (n > 0) {
      std::lock_guard<std::mutex> lock(rx_mu_);
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.u64 == 0) {
          channel = true;
          continue;
        }
        // epoll_event is packed: copy the key out rather than bind a
        // reference to a misaligned member (UB).
        const uint64_t key = evs[i].data.u64;
        auto it = rx_.find(key);
        if (it == rx_.end()) continue;
        if (std::shared_ptr<QpCore> qp = it->second.lock()) {
          ended[nq] = Ended(evs[i].events);
          qps[nq++] = std::move(qp);
        }
      }
    }
    const CqCore* outer = t_receiving;
    t_receiving = this;
    for (int i = 0; i < nq; ++i) qps[i]->RxInline(ended[i]);
    t_receiving = outer;
  }
  if (!channel) return 0;
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
// RecvQueue

const std::shared_ptr<MrEntry>* CheckLocalSge(const MrTable::Reader& table,
                                              uint64_t pd_id,
                                              const ibv_sge& sge,
                                              bool nic_writes) {
  const std::shared_ptr<MrEntry>* mr = table.FindLkey(sge.lkey);
  if (mr == nullptr) return nullptr;
  const MrEntry& e = **mr;
  if (e.pd_id != pd_id || !e.Covers(sge.addr, sge.length)) return nullptr;
  if (nic_writes && (e.access & IBV_ACCESS_LOCAL_WRITE) == 0) return nullptr;
  return mr;
}

RecvQueue::RecvQueue(uint32_t capacity, uint32_t max_sge, uint64_t pd_id)
    : capacity_(capacity),
      max_sge_(max_sge),
      pd_id_(pd_id),
      slots_(capacity),
      sges_(static_cast<size_t>(capacity) * max_sge),
      mrs_(static_cast<size_t>(capacity) * max_sge) {}

absl::Status RecvQueue::Post(ibv_recv_wr* wr, ibv_recv_wr** bad,
                             uint32_t qp_num) {
  MrTable::Reader table(MrTable::Get());
  std::lock_guard<std::mutex> lock(mu_);
  for (; wr != nullptr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > max_sge_) {
      if (bad) *bad = wr;
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post recv on qp %u: num_sge %d exceeds max_recv_sge %u "
          "(EINVAL)",
          qp_num, wr->num_sge, max_sge_));
    }
    if (wr->num_sge > 0 && wr->sg_list == nullptr) {
      if (bad) *bad = wr;
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post recv on qp %u: null sg_list (EINVAL)", qp_num));
    }
    if (head_ - tail_ >= capacity_) {
      if (bad) *bad = wr;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "soft: post recv on qp %u: receive queue full (%u WRs) (ENOMEM)",
          qp_num, capacity_));
    }
    size_t i = head_ % capacity_;
    Slot& s = slots_[i];
    s.wr_id = wr->wr_id;
    s.num_sge = static_cast<uint32_t>(wr->num_sge);
    s.status = IBV_WC_SUCCESS;
    s.total = 0;
    for (uint32_t k = 0; k < s.num_sge; ++k) {
      const ibv_sge& sge = wr->sg_list[k];
      sges_[i * max_sge_ + k] = sge;
      s.total += sge.length;
      const std::shared_ptr<MrEntry>* mr =
          sge.length == 0 ? nullptr : CheckLocalSge(table, pd_id_, sge, true);
      if (mr == nullptr) {
        mrs_[i * max_sge_ + k].reset();
        if (sge.length != 0) s.status = IBV_WC_LOC_PROT_ERR;
      } else {
        mrs_[i * max_sge_ + k] = *mr;
      }
    }
    ++head_;
  }
  return absl::OkStatus();
}

bool RecvQueue::Take(RecvWqe* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tail_ == head_) return false;
  size_t i = tail_ % capacity_;
  const Slot& s = slots_[i];
  out->wr_id = s.wr_id;
  out->num_sge = s.num_sge;
  out->status = s.status;
  out->total = s.total;
  for (uint32_t k = 0; k < s.num_sge; ++k) {
    out->sge[k] = sges_[i * max_sge_ + k];
    out->mr[k] = std::move(mrs_[i * max_sge_ + k]);
  }
  ++tail_;
  return true;
}

void RecvQueue::TakeAllIds(std::vector<uint64_t>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (; tail_ != head_; ++tail_) {
    size_t i = tail_ % capacity_;
    out->push_back(slots_[i].wr_id);
    for (uint32_t k = 0; k < slots_[i].num_sge; ++k) {
      mrs_[i * max_sge_ + k].reset();
    }
  }
}

}  // namespace coverbs::transport::soft
