// Internal: per-Worker state owned by the messaging half of the cm layer
// (buffer pools, the shared receive queue, connection ids), created empty by
// Worker::Create and filled lazily, and the internal accessors of a
// Worker.
#ifndef COVERBS_CM_WORKER_SHARED_H_
#define COVERBS_CM_WORKER_SHARED_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stop_token>
#include <unordered_set>
#include <vector>

#include "cm/worker.h"
#include "cm/large_memory_cache.h"
#include "cm/qp_events.h"
#include "transport/connector.h"
#include "transport/memory.h"

namespace coverbs::cm::internal {

struct SrqPool;        // srq_pool.h
class ConnectionImpl;  // connection_impl.h
// Destroys the SRQ; the buffers go with the last Message holding one.
void DetachSrqPool(SrqPool* pool);

struct WorkerShared {
  ~WorkerShared() {
    watch_stop.request_stop();
    if (srq_pool != nullptr) DetachSrqPool(srq_pool);
  }
  // The device's asynchronous QP events (why a connection's QP failed),
  // shared with the device's other Workers; this Worker's reactor watches
  // them until watch_stop.
  std::shared_ptr<QpEvents> qp_events;
  std::stop_source watch_stop;
  // Registered send buffers, by buffer size, shared by the connections.
  std::map<size_t, std::unique_ptr<transport::BufferPool>> send_pools;
  // Rendezvous receive memory (a Message holding some may outlive the
  // Worker, hence shared).
  std::shared_ptr<LargeMemoryCache> large_memory;
  // Landing grants by memory window: blocks that keep their registration.
  std::shared_ptr<LargeMemoryCache> landing_memory;
  // The connections' rendezvous budget events (Worker::rendezvous_usage);
  // atomic: read from any thread.
  std::atomic<uint64_t> rendezvous_deferred{0};
  std::atomic<uint64_t> rendezvous_budget_violations{0};
  std::atomic<uint64_t> rendezvous_done_timeouts{0};
  std::atomic<uint64_t> rendezvous_deferred_by_worker{0};
  // Expose calls refused by ConnectionOptions::max_exposures /
  // max_exposed_bytes (Worker::exposures_refused).
  std::atomic<uint64_t> exposures_refused{0};
  // Bytes held against WorkerOptions::rendezvous_budget by the connections
  // (ConnectionImpl::HoldRendezvous); written on the reactor thread, the
  // atomics mirror it for rendezvous_usage().
  uint64_t rdv_held = 0;
  std::atomic<uint64_t> rdv_held_now{0};
  std::atomic<uint64_t> rdv_held_peak{0};
  // The shared receive queue and its buffers (ConnectionOptions::use_srq);
  // created by the first connection that asks for it.
  SrqPool* srq_pool = nullptr;
  // CQs created when the first one (Worker::cq()) had no room; they go
  // with this struct, after every connection.
  std::vector<std::unique_ptr<transport::CompletionQueue>> more_cqs;
  // A trim of empty CQs is posted to the reactor (ScheduleCqTrim); the
  // token tells it whether this Worker still exists.
  bool trim_posted = false;
  std::shared_ptr<int> trim_token = std::make_shared<int>(0);
  // Every connection of this Worker not yet destroyed or detached
  // (ConnectionImpl registers itself): what ~Worker must end first.
  std::unordered_set<ConnectionImpl*> connections;
};

// A completion queue of `ctx` with `entries` unreserved: the first one
// with room, else a new one (WorkerOptions::max_cqs). ResourceExhausted
// naming the options when none can be had.
absl::StatusOr<transport::CompletionQueue*> CqWithRoom(Worker& ctx,
                                                       int entries);
// After a connection went: soon (on the reactor, outside any poll), the
// CQs added by CqWithRoom that no QP uses any more are destroyed, so a
// burst of connections leaves no descriptors or memory behind.
void ScheduleCqTrim(Worker& ctx);
// ~Worker, before anything of the Worker goes: fails every connection still
// on it (their QPs destroyed, every waiter woken), runs the reactor -- when
// called outside its loop -- until the tasks holding them (an rpc::Client's
// receive loop, calls in flight, internal sends) have unwound and let go,
// then detaches the connections somebody still holds (ConnectionImpl::
// DetachFromWorker) so that they never touch the Worker again.
void ShutdownConnections(Worker& ctx);

// The parts of a Worker only the cm layer uses.
class WorkerAccess {
 public:
  static WorkerShared& Shared(Worker& ctx) { return *ctx.shared_; }
  static const WorkerShared& Shared(const Worker& ctx) {
    return *ctx.shared_;
  }
  // Establishes the Worker's connections (its provider's connector).
  static transport::Connector& Connector(Worker& ctx) {
    return *ctx.connector_;
  }
};

inline WorkerShared& SharedOf(Worker& ctx) {
  return WorkerAccess::Shared(ctx);
}
inline transport::Connector& ConnectorOf(Worker& ctx) {
  return WorkerAccess::Connector(ctx);
}

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_WORKER_SHARED_H_
