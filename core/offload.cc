#include "core/offload.h"

#include <pthread.h>

#include <algorithm>

namespace coverbs {
namespace internal {

void OffloadJob::Execute() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (claimed_) return;  // cancelled before it started: never runs
  }
  Run();
  std::lock_guard<std::mutex> lock(mu_);
  if (claimed_) return;  // cancelled while running: the result is dropped
  claimed_ = true;
  // Under mu_: Detach (the frame going away) cannot slip in between.
  if (reactor_ != nullptr) reactor_->Schedule(waiter_);
}

void OffloadJob::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (claimed_) return;
  claimed_ = true;
  cancelled_ = true;
  if (reactor_ != nullptr) reactor_->Schedule(waiter_);
}

void OffloadJob::Detach() {
  std::lock_guard<std::mutex> lock(mu_);
  claimed_ = true;
  reactor_ = nullptr;
}

}  // namespace internal

OffloadPool::OffloadPool(size_t threads) {
  threads = std::max<size_t>(threads, 1);
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
  }
}

OffloadPool::~OffloadPool() {
  std::deque<std::shared_ptr<internal::OffloadJob>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  for (auto& job : left) job->Cancel();
  for (std::thread& t : threads_) t.join();
}

OffloadPool& OffloadPool::Default() {
  static OffloadPool* pool =
      new OffloadPool(std::max<size_t>(4, std::thread::hardware_concurrency()));
  return *pool;
}

void OffloadPool::Submit(std::shared_ptr<internal::OffloadJob> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      queue_.push_back(std::move(job));
      job = nullptr;
    }
  }
  if (job) {
    job->Cancel();  // the pool is shutting down
    return;
  }
  cv_.notify_one();
}

void OffloadPool::Loop() {
  pthread_setname_np(pthread_self(), "coverbs-offload");
  for (;;) {
    std::shared_ptr<internal::OffloadJob> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->Execute();
  }
}

}  // namespace coverbs
