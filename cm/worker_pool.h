// cm::WorkerPool: a ReactorPool with one cm::Worker per reactor -- what a
// multi-threaded service needs before it listens or connects.
//
//   auto pool = cm::WorkerPool::Create(*device, {.threads = 4});
//   server.Start((*pool)->workers(), "10.0.0.1", 7471);
//
// Each Worker is created and destroyed on its own reactor's thread (a
// Worker is single-threaded). Destroying the pool destroys the workers,
// then stops the reactors: every connection and listener on them must be
// gone first (rpc::Server::Shutdown). Thread: Create and the destructor on
// any thread outside the pool.
#ifndef COVERBS_CM_WORKER_POOL_H_
#define COVERBS_CM_WORKER_POOL_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "transport/device.h"

namespace coverbs::cm {

class WorkerPool {
 public:
  struct Options {
    size_t threads = 1;
    ReactorOptions reactor;  // e.g. poll_mode
    // For every worker. Set worker.pd to share one protection domain
    // (one MemoryRegion then serves the connections of every reactor); it
    // must outlive the pool.
    WorkerOptions worker;
  };
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(
      transport::Device& device, const Options& options);
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(
      transport::Device& device) {
    return Create(device, Options());
  }
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  size_t size() const { return workers_.size(); }
  Worker& worker(size_t i) const { return *workers_[i]; }
  std::vector<Worker*> workers() const;
  ReactorPool& reactors() { return *pool_; }

 private:
  WorkerPool() = default;
  std::unique_ptr<ReactorPool> pool_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_WORKER_POOL_H_
