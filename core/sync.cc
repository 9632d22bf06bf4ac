#include "core/sync.h"

#include "core/timeout.h"

namespace coverbs {

void Event::Set() {
  std::lock_guard<std::mutex> lock(mu_);
  set_.store(true, std::memory_order_release);
  while (internal::SyncWaiter* w = waiters_.pop_front()) w->Wake();
}

void Event::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  set_.store(false, std::memory_order_release);
}

Task<absl::Status> Event::WaitFor(absl::Duration timeout) {
  auto wait = [](Event* e) -> Task<absl::Status> {
    auto w = e->Wait();
    co_return co_await w;
  };
  auto timed = WithTimeout(wait(this), timeout);
  co_return co_await std::move(timed);
}

void Semaphore::ReleaseToWaiters(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.fetch_add(Permits(n), std::memory_order_acq_rel);
  GrantLocked();
}

void Semaphore::GrantLocked() {
  // While waiters are linked the bit is set, so only code under mu_ changes
  // state_ here.
  while (internal::SyncWaiter* w = waiters_.front()) {
    if (state_.load(std::memory_order_acquire) < Permits(w->amount)) break;
    state_.fetch_sub(Permits(w->amount), std::memory_order_acq_rel);
    waiters_.erase(w);
    w->Wake();
  }
  if (waiters_.empty()) {
    state_.fetch_and(~kWaitersBit, std::memory_order_acq_rel);
  }
}

size_t Semaphore::available() const {
  return state_.load(std::memory_order_acquire) >> 1;
}

size_t Semaphore::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.size();
}

void WaitGroup::Add(size_t n) { count_.fetch_add(n, std::memory_order_acq_rel); }

void WaitGroup::Done() {
  size_t c = count_.load(std::memory_order_acquire);
  do {
    assert(c > 0 && "WaitGroup::Done without Add");
    if (c == 0) return;
  } while (!count_.compare_exchange_weak(c, c - 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire));
  if (c != 1) return;
  // Reached zero: a waiter either saw zero under mu_ or is linked by now.
  std::lock_guard<std::mutex> lock(mu_);
  while (internal::SyncWaiter* w = waiters_.pop_front()) w->Wake();
}

size_t WaitGroup::count() const {
  return count_.load(std::memory_order_acquire);
}

}  // namespace coverbs
