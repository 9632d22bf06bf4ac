#include "cm/context_pool.h"

#include <future>
#include <utility>

namespace coverbs::cm {

absl::StatusOr<std::unique_ptr<ContextPool>> ContextPool::Create(
    transport::Device& device, const Options& options) {
  auto pool = ReactorPool::Create(options.threads, options.reactor);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<ContextPool> cp(new ContextPool());
  cp->pool_ = *std::move(pool);
  for (size_t i = 0; i < cp->pool_->size(); ++i) {
    std::promise<absl::StatusOr<std::unique_ptr<Context>>> p;
    auto f = p.get_future();
    ReactorPool* rp = cp->pool_.get();
    rp->Post(i, [&p, &device, rp, i, &options]() {
      p.set_value(Context::Create(rp->reactor(i), device, options.context));
    });
    auto ctx = f.get();
    if (!ctx.ok()) return ctx.status();  // the destructor cleans up the rest
    cp->contexts_.push_back(*std::move(ctx));
  }
  return cp;
}

ContextPool::~ContextPool() {
  for (size_t i = 0; i < contexts_.size(); ++i) {
    std::promise<void> p;
    auto f = p.get_future();
    pool_->Post(i, [this, &p, i]() {
      contexts_[i].reset();
      p.set_value();
    });
    f.get();
  }
  if (pool_) pool_->Stop();
}

std::vector<Context*> ContextPool::contexts() const {
  std::vector<Context*> v;
  v.reserve(contexts_.size());
  for (const auto& c : contexts_) v.push_back(c.get());
  return v;
}

}  // namespace coverbs::cm
