// The client side's per-connection state and the pieces every test's
// driver uses: a window of operations in flight, the registered local
// memory, the parameter message and the server's verdict.
#ifndef COVERBS_BENCH_DRIVER_H_
#define COVERBS_BENCH_DRIVER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/protocol.h"
#include "bench/report.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "core/sync.h"
#include "core/task.h"
#include "rpc/client.h"
#include "transport/device.h"

namespace coverbs::bench {

using Clock = std::chrono::steady_clock;

// What one connection's driver measured in one run.
struct ConnRun {
  Clock::time_point start, end;
  std::vector<int64_t> lat_ns;
  uint64_t ops = 0, errors = 0, mismatches = 0;
  std::string first_error;
  void Error(const absl::Status& s) {
    if (errors++ == 0) first_error = s.ToString();
  }
  void Mismatch(std::string what) {
    if (mismatches++ == 0) first_error = std::move(what);
  }
};

struct ClientConn {
  cm::Worker* ctx = nullptr;
  size_t reactor = 0;
  std::unique_ptr<cm::Connection> conn;
  std::unique_ptr<rpc::Client> rpc;
  // Registered local memory, kept across runs (grown on demand).
  std::vector<std::byte> mem;
  transport::MemoryRegion mr;
};

// Operations completed so far, all connections (the progress line).
extern std::atomic<uint64_t> g_progress_ops;

struct RunSpec {
  Test test;
  uint64_t size;
  uint64_t iters;
  int depth;
  bool verify;
  int64_t corrupt_message = -1;
  std::stop_token stop;  // the run's limit (--run_timeout)
};

// A window of `depth` operations in flight over `slots` local buffers.
struct Window {
  explicit Window(int depth) : free_slots(depth), sem(depth) {
    for (int i = 0; i < depth; ++i) free_slots[i] = depth - 1 - i;
  }
  std::vector<int> free_slots;
  Semaphore sem;
  WaitGroup wg;
};

// Takes a free slot, waiting while `depth` operations are in flight.
Task<absl::StatusOr<int>> TakeSlot(Window* w);
// Waits for every operation of the window, even when the run is being
// cancelled: they reference the window and the registered memory.
Task<void> Drain(Window* w);

// Grows the connection's registered memory to at least `bytes`.
Task<absl::Status> EnsureMemory(ClientConn* c, size_t bytes);
// Local buffer number `slot` of `size` bytes in that memory.
transport::LocalBuffer Slot(ClientConn* c, int slot, size_t size);

// Sends the parameters and, at the end, reads the server's verdict.
Task<absl::Status> SendParams(ClientConn* c, const Params& p);
Task<absl::Status> ReadReply(ClientConn* c, ConnRun* out,
                             Reply* rep_out = nullptr);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_DRIVER_H_
