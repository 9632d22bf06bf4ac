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

bool Event::is_set() const {
  // A snapshot either way; the acquire pairs with Set's release, so what
  // the setter wrote before Set() is visible to a caller that sees true.
  return set_.load(std::memory_order_acquire);
}

bool Semaphore::TryAcquire(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiters_.empty() && count_ >= n) {
    count_ -= n;
    return true;
  }
  return false;
}

void Semaphore::Release(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  count_ += n;
  GrantLocked();
}

void Semaphore::GrantLocked() {
  while (internal::SyncWaiter* w = waiters_.front()) {
    if (count_ < w->amount) break;
    count_ -= w->amount;
    waiters_.erase(w);
    w->Wake();
  }
}

size_t Semaphore::available() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

size_t Semaphore::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.size();
}

void WaitGroup::Add(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  count_ += n;
}

void WaitGroup::Done() {
  std::lock_guard<std::mutex> lock(mu_);
  assert(count_ > 0 && "WaitGroup::Done without Add");
  if (count_ == 0) return;
  if (--count_ == 0) {
    while (internal::SyncWaiter* w = waiters_.pop_front()) w->Wake();
  }
}

size_t WaitGroup::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

}  // namespace coverbs
