#include "cm/worker_pool.h"

#include <future>
#include <utility>

namespace coverbs::cm {

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(
    transport::Device& device, const Options& options) {
  auto pool = ReactorPool::Create(options.threads, options.reactor);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<WorkerPool> cp(new WorkerPool());
  cp->pool_ = *std::move(pool);
  for (size_t i = 0; i < cp->pool_->size(); ++i) {
    std::promise<absl::StatusOr<std::unique_ptr<Worker>>> p;
    auto f = p.get_future();
    ReactorPool* rp = cp->pool_.get();
    rp->Post(i, [&p, &device, rp, i, &options]() {
      p.set_value(Worker::Create(rp->reactor(i), device, options.worker));
    });
    auto ctx = f.get();
    if (!ctx.ok()) return ctx.status();  // the destructor cleans up the rest
    cp->workers_.push_back(*std::move(ctx));
  }
  return cp;
}

WorkerPool::~WorkerPool() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    std::promise<void> p;
    auto f = p.get_future();
    pool_->Post(i, [this, &p, i]() {
      workers_[i].reset();
      p.set_value();
    });
    f.get();
  }
  if (pool_) pool_->Stop();
}

std::vector<Worker*> WorkerPool::workers() const {
  std::vector<Worker*> v;
  v.reserve(workers_.size());
  for (const auto& c : workers_) v.push_back(c.get());
  return v;
}

}  // namespace coverbs::cm
