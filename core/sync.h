// Coroutine synchronization primitives: Event, Semaphore, WaitGroup and a
// bounded Channel<T>.
//
// All of them are thread-safe: waiters and signallers may run on different
// reactors (threads). A waiter is always resumed on the reactor it suspended
// on, through that reactor's ready queue (never inline in the signaller).
// Waiting never allocates: the waiter node lives in the awaiting frame.
// Every wait honours the awaiting coroutine's ambient stop token and then
// yields absl::CancelledError. Waiters are served in FIFO order.
#ifndef COVERBS_CORE_SYNC_H_
#define COVERBS_CORE_SYNC_H_

#include <atomic>
#include <cassert>
#include <coroutine>
#include <cstddef>
#include <mutex>
#include <optional>
#include <stop_token>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/intrusive.h"
#include "core/reactor.h"
#include "core/task.h"

namespace coverbs {

namespace internal {

// A suspended coroutine parked on a primitive's list.
struct SyncWaiter : ListNode<SyncWaiter> {
  std::coroutine_handle<> handle;
  Reactor* reactor = nullptr;
  bool cancelled = false;
  size_t amount = 0;  // Semaphore permits wanted
  void* value = nullptr;  // Channel: T* to deliver from / into
  bool value_ok = false;  // Channel: a value was transferred
  void Wake() { reactor->Schedule(handle); }
};

// Common awaiter machinery: `Prim` provides, all called with mu_ held,
// TryLocked(waiter) (true if the operation completed without waiting),
// WaitersFor(waiter) (its list), OnWaiterParkedLocked() (after the waiter
// was linked) and OnWaiterCancelledLocked() (after a waiter left unserved).
template <typename Prim>
class SyncAwaiterBase {
 public:
  explicit SyncAwaiterBase(Prim* p) : prim_(p) {}
  SyncAwaiterBase(const SyncAwaiterBase&) = delete;
  ~SyncAwaiterBase() {
    cb_.reset();
    // A waiter that never parked, or was resumed (the waker unlinked it under
    // mu_ before scheduling it, and the resumption happens after that), has
    // nothing to undo: no lock, which is most waits on the message path.
    if (!parked_ || resumed_) return;
    // Frame destroyed while parked (reactor shutdown): unlink.
    std::lock_guard<std::mutex> lock(prim_->mu_);
    if (node_.linked()) {
      prim_->WaitersFor(node_).erase(&node_);
      prim_->OnWaiterCancelledLocked();
    }
  }
  bool await_ready() const noexcept { return false; }
  template <typename P>
  bool await_suspend(std::coroutine_handle<P> h) {
    std::stop_token token = StopTokenOf(h);
    node_.handle = h;
    node_.reactor = Reactor::Current();
    assert(node_.reactor != nullptr && "sync waits need a running Reactor");
    {
      std::lock_guard<std::mutex> lock(prim_->mu_);
      if (prim_->TryLocked(node_)) return false;
      if (token.stop_requested()) {
        node_.cancelled = true;
        return false;
      }
      prim_->WaitersFor(node_).push_back(&node_);
      parked_ = true;
      prim_->OnWaiterParkedLocked();
    }
    // After unlocking: the callback may run inline and takes the lock.
    if (token.stop_possible()) cb_.emplace(std::move(token), Canceller{this});
    return true;
  }

 protected:
  struct Canceller {
    SyncAwaiterBase* self;
    void operator()() const noexcept {
      std::lock_guard<std::mutex> lock(self->prim_->mu_);
      if (!self->node_.linked()) return;  // already woken
      self->prim_->WaitersFor(self->node_).erase(&self->node_);
      self->node_.cancelled = true;
      self->prim_->OnWaiterCancelledLocked();
      self->node_.Wake();
    }
  };
  void Finish() {
    cb_.reset();
    resumed_ = true;
  }

  Prim* prim_;
  SyncWaiter node_;
  bool parked_ = false;   // linked into a waiter list by await_suspend
  bool resumed_ = false;  // await_resume ran
  std::optional<std::stop_callback<Canceller>> cb_;
};

}  // namespace internal

// A manual-reset event: Wait() completes once Set() was called, until Reset().
class Event {
 public:
  explicit Event(bool initially_set = false) : set_(initially_set) {}
  Event(const Event&) = delete;

  void Set();
  void Reset();
  // The acquire pairs with Set's release: what the setter wrote before
  // Set() is visible to a caller that sees true. (Inline: the send and
  // receive paths ask several times per message.)
  bool is_set() const { return set_.load(std::memory_order_acquire); }

  class Awaiter : public internal::SyncAwaiterBase<Event> {
   public:
    using SyncAwaiterBase::SyncAwaiterBase;
    // Already set: no suspension and no lock (acquire pairs with Set).
    bool await_ready() const noexcept {
      return prim_->set_.load(std::memory_order_acquire);
    }
    absl::Status await_resume() {
      Finish();
      if (node_.cancelled) return absl::CancelledError("event wait cancelled");
      return absl::OkStatus();
    }
  };
  // Yields OK once set, or Cancelled.
  Awaiter Wait() { return Awaiter(this); }
  // Wait() for at most `timeout`: OK once set, DeadlineExceeded when the
  // time ran out (the wait is cancelled and finished first), Cancelled.
  Task<absl::Status> WaitFor(absl::Duration timeout);

 private:
  friend class internal::SyncAwaiterBase<Event>;
  bool TryLocked(internal::SyncWaiter&) {
    return set_.load(std::memory_order_relaxed);
  }
  internal::IntrusiveList<internal::SyncWaiter>& WaitersFor(
      internal::SyncWaiter&) {
    return waiters_;
  }
  void OnWaiterParkedLocked() {}
  void OnWaiterCancelledLocked() {}

  mutable std::mutex mu_;
  // Written under mu_; atomic so that is_set() (several times per message
  // on the send path) needs no lock.
  std::atomic<bool> set_;
  internal::IntrusiveList<internal::SyncWaiter> waiters_;
};

// Counting semaphore with FIFO fairness: a large Acquire at the head is not
// overtaken by later small ones (so credits are granted in order).
//
// TryAcquire and Release take no lock while nobody waits (the common case on
// a connection's credit and send windows): the permits and a "waiters"
// bit share one atomic word, changed by compare-and-swap. While the bit is
// set every change happens under mu_, so waiters keep their FIFO order.
class Semaphore {
 public:
  explicit Semaphore(size_t initial = 0) : state_(uint64_t{initial} << 1) {}
  Semaphore(const Semaphore&) = delete;

  // Inline: a message goes through several of these (send turn, credits,
  // buffer pool, receive queue, rpc admission) on each side; the call was
  // a good part of their cost.
  [[gnu::always_inline]] bool TryAcquire(size_t n = 1) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s & kWaitersBit) == 0 && s >= Permits(n)) {
      if (state_.compare_exchange_weak(s, s - Permits(n),
                                       std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        return true;
      }
    }
    return false;
  }
  void Release(size_t n = 1) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s & kWaitersBit) == 0) {
      if (state_.compare_exchange_weak(s, s + Permits(n),
                                       std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        return;
      }
    }
    ReleaseToWaiters(n);
  }
  size_t available() const;
  size_t waiters() const;
  // Whether TryAcquire(n) would succeed now, without taking anything: for
  // an owner thread that would take the permits and give them back before
  // anything else runs (a check instead of two atomic updates).
  bool WouldAcquire(size_t n = 1) const {
    const uint64_t s = state_.load(std::memory_order_acquire);
    return (s & kWaitersBit) == 0 && s >= Permits(n);
  }

  class Awaiter : public internal::SyncAwaiterBase<Semaphore> {
   public:
    Awaiter(Semaphore* s, size_t n) : SyncAwaiterBase(s) { node_.amount = n; }
    // Permits free and nobody queued: taken without suspending or locking
    // (TryAcquire fails while waiters are queued, so FIFO order holds). A
    // connection's send path and an rpc call's admission take this path
    // several times per message.
    bool await_ready() noexcept { return prim_->TryAcquire(node_.amount); }
    absl::Status await_resume() {
      Finish();
      if (node_.cancelled) {
        return absl::CancelledError("semaphore acquire cancelled");
      }
      return absl::OkStatus();
    }
  };
  // Yields OK once `n` permits were taken, or Cancelled (nothing taken).
  Awaiter Acquire(size_t n = 1) { return Awaiter(this, n); }

 private:
  friend class internal::SyncAwaiterBase<Semaphore>;
  static constexpr uint64_t kWaitersBit = 1;
  static constexpr uint64_t Permits(uint64_t n) { return n << 1; }
  bool TryLocked(internal::SyncWaiter& w) { return TryAcquire(w.amount); }
  // Release while waiters are queued: under mu_, in FIFO order.
  void ReleaseToWaiters(size_t n);
  internal::IntrusiveList<internal::SyncWaiter>& WaitersFor(
      internal::SyncWaiter&) {
    return waiters_;
  }
  // From now on changes go through mu_; the permits may already suffice
  // (released before the bit was set).
  void OnWaiterParkedLocked() {
    state_.fetch_or(kWaitersBit, std::memory_order_acq_rel);
    GrantLocked();
  }
  // A cancelled head may have been blocking smaller requests behind it.
  void OnWaiterCancelledLocked() { GrantLocked(); }
  // Serves waiters in order while permits last; clears the bit when none
  // is left.
  void GrantLocked();

  mutable std::mutex mu_;
  std::atomic<uint64_t> state_;  // permits << 1 | kWaitersBit
  internal::IntrusiveList<internal::SyncWaiter> waiters_;  // guarded by mu_
};

// Waits for a set of activities: Add(n) before starting them, Done() as each
// ends; Wait() completes when the count reaches zero.
class WaitGroup {
 public:
  WaitGroup() = default;
  WaitGroup(const WaitGroup&) = delete;

  void Add(size_t n = 1);
  void Done();
  size_t count() const;

  class Awaiter : public internal::SyncAwaiterBase<WaitGroup> {
   public:
    using SyncAwaiterBase::SyncAwaiterBase;
    absl::Status await_resume() {
      Finish();
      if (node_.cancelled) {
        return absl::CancelledError("wait group wait cancelled");
      }
      return absl::OkStatus();
    }
  };
  Awaiter Wait() { return Awaiter(this); }

 private:
  friend class internal::SyncAwaiterBase<WaitGroup>;
  bool TryLocked(internal::SyncWaiter&) {
    return count_.load(std::memory_order_acquire) == 0;
  }
  internal::IntrusiveList<internal::SyncWaiter>& WaitersFor(
      internal::SyncWaiter&) {
    return waiters_;
  }
  void OnWaiterParkedLocked() {}
  void OnWaiterCancelledLocked() {}

  mutable std::mutex mu_;
  // Add and Done change it without the lock; the Done that reaches zero
  // takes mu_ to wake the waiters, which checked it under mu_.
  std::atomic<size_t> count_{0};
  internal::IntrusiveList<internal::SyncWaiter> waiters_;
};

// Bounded multi-producer multi-consumer channel. Send waits while the buffer
// is full; Recv waits while it is empty. Close() wakes every waiter: pending
// and later sends fail with FailedPrecondition, receives drain what is
// buffered and then fail with OutOfRange.
template <typename T>
class Channel {
 public:
  explicit Channel(size_t capacity) : capacity_(capacity ? capacity : 1) {
    buf_.reserve(capacity_);
    for (size_t i = 0; i < capacity_; ++i) buf_.emplace_back();
  }
  Channel(const Channel&) = delete;

  // Non-blocking variants; false / nullopt when they would wait.
  bool TrySend(T& v);
  std::optional<T> TryRecv();
  void Close();
  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return size_;
  }
  size_t capacity() const { return capacity_; }

  class SendAwaiter : public internal::SyncAwaiterBase<Channel> {
   public:
    SendAwaiter(Channel* c, T v) : internal::SyncAwaiterBase<Channel>(c), v_(std::move(v)) {
      this->node_.value = &v_;
      this->node_.amount = 1;  // marks a sender
    }
    absl::Status await_resume() {
      this->Finish();
      if (this->node_.cancelled) return absl::CancelledError("channel send cancelled");
      if (!this->node_.value_ok) {
        return absl::FailedPreconditionError("channel closed: send failed");
      }
      return absl::OkStatus();
    }

   private:
    T v_;
  };
  class RecvAwaiter : public internal::SyncAwaiterBase<Channel> {
   public:
    explicit RecvAwaiter(Channel* c) : internal::SyncAwaiterBase<Channel>(c) {
      this->node_.value = &slot_;
      this->node_.amount = 0;  // marks a receiver
    }
    absl::StatusOr<T> await_resume() {
      this->Finish();
      if (this->node_.cancelled) {
        return absl::CancelledError("channel receive cancelled");
      }
      if (!this->node_.value_ok) {
        return absl::OutOfRangeError("channel closed and drained");
      }
      return std::move(*slot_);
    }

   private:
    std::optional<T> slot_;
  };

  SendAwaiter Send(T v) { return SendAwaiter(this, std::move(v)); }
  RecvAwaiter Recv() { return RecvAwaiter(this); }

 private:
  friend class internal::SyncAwaiterBase<Channel>;
  internal::IntrusiveList<internal::SyncWaiter>& WaitersFor(
      internal::SyncWaiter& w) {
    return w.amount ? senders_ : receivers_;
  }
  void OnWaiterParkedLocked() {}
  void OnWaiterCancelledLocked() {}

  void PushLocked(T&& v) {
    buf_[(head_ + size_) % capacity_].emplace(std::move(v));
    ++size_;
  }
  T PopLocked() {
    T v = std::move(*buf_[head_]);
    buf_[head_].reset();
    head_ = (head_ + 1) % capacity_;
    --size_;
    return v;
  }
  // Moves the first parked sender's value into the buffer (after a pop).
  void RefillFromSenderLocked() {
    if (size_ < capacity_ && !senders_.empty()) {
      internal::SyncWaiter* s = senders_.pop_front();
      PushLocked(std::move(*static_cast<T*>(s->value)));
      s->value_ok = true;
      s->Wake();
    }
  }
  bool SendLocked(T& v) {
    if (closed_) return false;
    if (!receivers_.empty()) {  // buffer is empty: hand over directly
      internal::SyncWaiter* r = receivers_.pop_front();
      static_cast<std::optional<T>*>(r->value)->emplace(std::move(v));
      r->value_ok = true;
      r->Wake();
      return true;
    }
    if (size_ < capacity_) {
      PushLocked(std::move(v));
      return true;
    }
    return false;
  }
  bool TryLocked(internal::SyncWaiter& w) {
    if (w.amount) {  // sender
      if (closed_) return true;  // fails in await_resume (value_ok false)
      T& v = *static_cast<T*>(w.value);
      if (SendLocked(v)) {
        w.value_ok = true;
        return true;
      }
      return false;
    }
    // receiver
    if (size_ > 0) {
      static_cast<std::optional<T>*>(w.value)->emplace(PopLocked());
      w.value_ok = true;
      RefillFromSenderLocked();
      return true;
    }
    return closed_;  // closed and empty: fail without waiting
  }

  mutable std::mutex mu_;
  const size_t capacity_;
  std::vector<std::optional<T>> buf_;
  size_t head_ = 0;
  size_t size_ = 0;
  bool closed_ = false;
  internal::IntrusiveList<internal::SyncWaiter> senders_;
  internal::IntrusiveList<internal::SyncWaiter> receivers_;
};

template <typename T>
bool Channel<T>::TrySend(T& v) {
  std::lock_guard<std::mutex> lock(mu_);
  return SendLocked(v);
}

template <typename T>
std::optional<T> Channel<T>::TryRecv() {
  std::lock_guard<std::mutex> lock(mu_);
  if (size_ == 0) return std::nullopt;
  T v = PopLocked();
  RefillFromSenderLocked();
  return v;
}

template <typename T>
void Channel<T>::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  while (internal::SyncWaiter* s = senders_.pop_front()) s->Wake();
  while (internal::SyncWaiter* r = receivers_.pop_front()) r->Wake();
}

}  // namespace coverbs

#endif  // COVERBS_CORE_SYNC_H_
