#include "core/reactor_pool.h"

namespace coverbs {

absl::StatusOr<std::unique_ptr<ReactorPool>> ReactorPool::Create(
    size_t threads, ReactorOptions options) {
  if (threads == 0) threads = 1;
  std::unique_ptr<ReactorPool> pool(new ReactorPool());
  for (size_t i = 0; i < threads; ++i) {
    auto r = Reactor::Create(options);
    if (!r.ok()) return r.status();
    pool->reactors_.push_back(*std::move(r));
  }
  for (size_t i = 0; i < threads; ++i) {
    Reactor* r = pool->reactors_[i].get();
    pool->threads_.emplace_back([r] { r->Run(); });
  }
  return pool;
}

void ReactorPool::Stop() {
  for (auto& r : reactors_) r->Stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

ReactorPool::~ReactorPool() {
  Stop();
  reactors_.clear();
}

}  // namespace coverbs
