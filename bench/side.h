// One side of the bench (the server's or the client's): a device, a pool of
// reactors and one cm::Worker per reactor; and the CPU time of that pool's
// threads, which the bench reports per message.
#ifndef COVERBS_BENCH_SIDE_H_
#define COVERBS_BENCH_SIDE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "core/task.h"
#include "transport/device.h"

namespace coverbs::bench {

// The device and one cm::Worker per reactor of a pool (cm::WorkerPool).
struct Side {
  std::unique_ptr<transport::Device> device;
  std::unique_ptr<cm::WorkerPool> workers;  // goes before the device

  // Opens the device --provider / --device name.
  static absl::StatusOr<std::unique_ptr<Side>> Create(int threads,
                                                      PollMode poll);
  ReactorPool& pool() { return workers->reactors(); }
};

// The options of every bench connection, from --depth.
cm::ConnectionOptions BenchConnectionOptions();

// CPU (seconds) of every reactor thread of `pool`, from a thread outside it.
double PoolCpuBlocking(ReactorPool& pool);
// The same from a coroutine on one of the pool's reactors.
Task<double> PoolCpuAsync(ReactorPool* pool);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_SIDE_H_
