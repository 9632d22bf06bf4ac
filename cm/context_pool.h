// cm::ContextPool: a ReactorPool with one cm::Context per reactor -- what a
// multi-threaded service needs before it listens or connects.
//
//   auto pool = cm::ContextPool::Create(*device, {.threads = 4});
//   server.Start((*pool)->contexts(), "10.0.0.1", 7471);
//
// Each Context is created and destroyed on its own reactor's thread (a
// Context is single-threaded). Destroying the pool destroys the contexts,
// then stops the reactors: every connection and listener on them must be
// gone first (rpc::Server::Shutdown). Thread: Create and the destructor on
// any thread outside the pool.
#ifndef COVERBS_CM_CONTEXT_POOL_H_
#define COVERBS_CM_CONTEXT_POOL_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "cm/context.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "transport/device.h"

namespace coverbs::cm {

class ContextPool {
 public:
  struct Options {
    size_t threads = 1;
    ReactorOptions reactor;  // e.g. poll_mode
    // For every context. Set context.pd to share one protection domain
    // (one MemoryRegion then serves the connections of every reactor); it
    // must outlive the pool.
    ContextOptions context;
  };
  static absl::StatusOr<std::unique_ptr<ContextPool>> Create(
      transport::Device& device, const Options& options);
  static absl::StatusOr<std::unique_ptr<ContextPool>> Create(
      transport::Device& device) {
    return Create(device, Options());
  }
  ~ContextPool();
  ContextPool(const ContextPool&) = delete;
  ContextPool& operator=(const ContextPool&) = delete;

  size_t size() const { return contexts_.size(); }
  Context& context(size_t i) const { return *contexts_[i]; }
  std::vector<Context*> contexts() const;
  ReactorPool& reactors() { return *pool_; }

 private:
  ContextPool() = default;
  std::unique_ptr<ReactorPool> pool_;
  std::vector<std::unique_ptr<Context>> contexts_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_CONTEXT_POOL_H_
