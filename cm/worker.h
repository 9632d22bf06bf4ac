// cm::Worker: what one reactor needs to run connections.
//
// (The name is UCX's for the same thing, ucp_worker: a thread's
// communication resources. It was cm::Context until the name was found to
// suggest an ibv_context, which it is not.)
//
// One Worker per Reactor (thread). It owns the protection domain (unless
// one is shared in), the completion queues the reactor's connections
// complete into (a first one, and more as connections fill them, up to
// max_cqs), the registered buffer pools connections draw their
// receive rings and send buffers from, the registration cache used for
// zero-copy rendezvous, and the transport::Connector that establishes its
// connections (verbs: rdma_cm, its event channel watched by the reactor;
// soft: TCP setup).
//
// Lifetime: the Reactor outlives the Worker, and the Worker every Listener
// created on it. Connections should be closed before their Worker goes;
// when they are not, destroying the Worker ends them -- any order works:
//  - The destructor fails every connection still on the Worker ("closed
//    locally: the cm::Worker was destroyed"): its QP goes to the error
//    state, every waiter (receives, sends, an rpc::Client's calls) wakes
//    with that status.
//  - Destroyed outside the reactor's loop (RunMain, a test's thread, a
//    thread after Run returned), it then runs the loop until the tasks
//    holding those connections -- an rpc::Client's receive loop and calls
//    in flight, internal sends, a Close under way -- have unwound and let
//    go, bounded (5 s), and the posted work requests flushed.
//  - A connection still held after that (a cm::Connection or rpc::Client
//    the application keeps past its Worker) is detached: the QP, link,
//    receive ring and registrations go now, and the object stays valid
//    and down (status, close_cause, name; operations fail with its status,
//    Close returns at once; worker() and qp() must not be used). It may be
//    destroyed later, after the Reactor too. Messages it delivered stay
//    valid.
//  - Destroyed inside its reactor's loop (from a task, or a function
//    posted to it as cm::WorkerPool does) it cannot run the loop: the
//    connections are failed and detached at once, and no task may still be
//    suspended on them -- an internal send still waiting for its
//    completion would return its buffer to the Worker's freed pool (logged
//    as a warning). Close them first, or destroy the Worker outside the
//    loop.
// The peer of a connection ended this way sees it end without a GOODBYE.
// Thread: used only from its reactor's thread.
#ifndef COVERBS_CM_WORKER_H_
#define COVERBS_CM_WORKER_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "transport/completion_queue.h"
#include "transport/device.h"
#include "transport/memory.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {
class Connector;
}  // namespace coverbs::transport

namespace coverbs::cm {

namespace internal {
struct WorkerShared;  // worker_shared.h
class WorkerAccess;
}  // namespace internal

struct WorkerOptions {
  // Entries per completion queue (0: CompletionQueue's default, at most
  // 4096; the first CQ gets srq_depth more, for the SRQ's receives). Each connection reserves its worst case on one CQ
  // (ConnectionOptions::send_depth + 10, plus recv_credits + 6 without an
  // SRQ: 144 with the defaults, 26 with the SRQ); when no CQ has room the
  // Worker creates another, up to max_cqs (with the defaults: 28
  // connections per CQ, 1,792 per Worker).
  int cq_entries = 0;
  int max_cqs = 64;
  // Share a PD between workers (e.g. one PD for every reactor of a
  // ReactorPool so one MemoryRegion serves all connections). Not owned.
  transport::ProtectionDomain* pd = nullptr;
  // Shared receive queue for every connection of this worker that asks
  // for it (ConnectionOptions::use_srq): at most srq_depth receives of
  // srq_buffer_size bytes, posted as connections need them. The SRQ
  // reserves srq_depth entries of the CQ (cq_entries). 0 = no SRQ.
  //
  // The buffers are small by default because the SRQ is for many mostly
  // idle connections, where each connection's promised receives (its window
  // plus 6 reserve) are most of its memory: 8 x 2112 B = 16.5 KiB instead of
  // 8 x 8256 B. A connection announces the buffer size in its handshake, so
  // its peer sends only payloads up to srq_buffer_size - 16 eagerly and
  // larger ones by RDMA WRITE (landing buffers, else the rendezvous).
  uint32_t srq_depth = 0;
  uint32_t srq_buffer_size = 2048 + 64;
  // Rendezvous receive memory kept mapped for reuse after its message is
  // gone, so large transfers do not fault in fresh pages (each transfer
  // still registers its own rkey); on a device without memory windows
  // (soft, siw) landing grants come from it too. At most this much idle,
  // and beyond one block per size no more than is in use: a Worker whose
  // connections closed keeps one block per size it served. 0 = allocate
  // and free per transfer.
  size_t rendezvous_cache_bytes = 64ull << 20;
  // Rendezvous and landed receive memory all of this Worker's connections
  // may hold for their peers at once -- granted and awaiting DONE, or
  // received and not yet taken by Recv -- on top of each connection's own
  // ConnectionOptions::rendezvous_budget. Beyond it a request's CTS waits
  // (its sender waits, no connection ends) and no landing grant is
  // renewed, until Recv takes messages or transfers end; with nothing
  // held on the Worker one message goes whatever the budget. Deferred
  // requests look again every 1-64 ms. 0: no Worker-wide bound.
  uint64_t rendezvous_budget = 1ull << 30;
};

class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(
      Reactor& reactor, transport::Device& device, WorkerOptions options = {});
  ~Worker();
  Worker(const Worker&) = delete;

  Reactor& reactor() const { return *reactor_; }
  transport::Device& device() const { return *device_; }
  transport::ProtectionDomain& pd() const { return *pd_; }
  // The first completion queue (the shared receive queue's receives
  // complete here); connections may be on others (cq_count()).
  transport::CompletionQueue& cq() const { return *cq_; }
  int cq_count() const;
  transport::RegistrationCache& registrations() { return *reg_cache_; }
  const WorkerOptions& options() const { return options_; }

  // The shared receive queue (ConnectionOptions::use_srq); zeros before
  // the first connection that uses it.
  struct SrqUsage {
    uint32_t buffers = 0;  // allocated (and registered), <= srq_depth
    uint32_t posted = 0;   // of those, posted in the SRQ now
    int64_t promised = 0;  // receives promised to connections
    size_t bytes = 0;      // memory of the buffers
  };
  SrqUsage srq_usage() const;

  // Rendezvous receive memory of this Worker's connections
  // (ConnectionOptions::rendezvous_budget bounds each connection's share
  // before its application takes the messages). Safe from any thread.
  struct RendezvousUsage {
    // Blocks of the rendezvous cache out in use -- granted to a peer,
    // queued for Recv, or held by a Message -- and kept idle for reuse
    // (rendezvous_cache_bytes). On devices without memory windows (soft,
    // siw) landing grants come from the same cache and count here too.
    size_t in_use_bytes = 0;
    size_t idle_bytes = 0;
    // Since the Worker was made, over its connections: requests whose
    // CTS was deferred by the budget, connections ended for breaking it,
    // and connections ended for a DONE that did not come in time
    // (ConnectionOptions::rendezvous_done_timeout).
    uint64_t deferred = 0;
    uint64_t budget_violations = 0;
    uint64_t done_timeouts = 0;
    // Bytes held against WorkerOptions::rendezvous_budget now (settled when
    // a connection looks: messages Recv took since may still count), the
    // most ever held, and of `deferred` the requests deferred by the
    // Worker's budget rather than their connection's.
    uint64_t held_bytes = 0;
    uint64_t held_bytes_peak = 0;
    uint64_t deferred_by_worker = 0;
  };
  RendezvousUsage rendezvous_usage() const;
  // Expose calls of this Worker's connections refused by their exposure
  // bounds (ConnectionOptions::max_exposures, max_exposed_bytes) since the
  // Worker was made. Safe from any thread.
  uint64_t exposures_refused() const;

 private:
  friend class internal::WorkerAccess;
  Worker() = default;
  Reactor* reactor_ = nullptr;
  transport::Device* device_ = nullptr;
  WorkerOptions options_;
  std::unique_ptr<transport::ProtectionDomain> owned_pd_;
  transport::ProtectionDomain* pd_ = nullptr;
  std::unique_ptr<transport::CompletionQueue> cq_;
  std::unique_ptr<transport::RegistrationCache> reg_cache_;
  std::unique_ptr<transport::Connector> connector_;
  std::unique_ptr<internal::WorkerShared> shared_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_WORKER_H_
