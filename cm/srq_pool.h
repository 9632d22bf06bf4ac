// Internal: the Worker's shared receive queue and its buffers
// (ConnectionOptions::use_srq).
#ifndef COVERBS_CM_SRQ_POOL_H_
#define COVERBS_CM_SRQ_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cm/worker.h"
#include "cm/recv_buffers.h"
#include "transport/queue_pair.h"

namespace coverbs::cm::internal {

// SRQ mode (ConnectionOptions::use_srq): the Worker's shared receive queue
// and the buffers posted to it, shared by the connections that use it.
//
// No RNR with a correct peer still holds: every connection is promised
// receives for each credit its peer holds plus its reserve receives
// (kCreditReserve + kCtsReserve), and `committed` (the sum of those
// promises) never exceeds the receives posted. A connection starts with
// srq_initial_credits; its receiver lends a busy sender more (up to
// recv_credits, from receives nobody was promised) and takes them back when
// the sender stops running out (see ConnectionImpl::Replenish). The memory
// of an idle connection is therefore its current window plus 6 buffers
// instead of recv_credits + 6.
//
// Messages may outlive the connection and the Worker: the pool goes away
// with the last held buffer (the SRQ and the registrations go with the
// Worker, so the NIC no longer writes into them).
struct SrqPool {
  struct Chunk {
    std::byte* mem = nullptr;
    MemoryRegion mr;
    std::unique_ptr<RecvSlot[]> slots;
  };
  std::unique_ptr<transport::SharedReceiveQueue> srq;
  size_t slot_size = 0;
  uint32_t capacity = 0;  // buffers at most (WorkerOptions::srq_depth)
  uint32_t slots = 0;     // buffers allocated
  int64_t committed = 0;  // receives promised to connections
  uint32_t held = 0;      // buffers owned by Messages
  bool detached = false;  // the Worker is gone
  std::vector<Chunk> chunks;
  std::vector<RecvSlot*> unposted;  // a post failed; retried on Reserve
  absl::flat_hash_map<uint64_t, ConnectionImpl*> conns;  // by connection id
  absl::flat_hash_map<uint32_t, ConnectionImpl*> by_qp;

  ~SrqPool() {
    for (Chunk& c : chunks) {
      c.mr.Deregister();
      std::free(c.mem);
    }
  }
  static absl::StatusOr<SrqPool*> For(Worker& ctx);
  // Receives posted and promised to nobody.
  int64_t Free() const {
    return static_cast<int64_t>(srq->posted()) - committed;
  }
  // Promises `n` receives, posting more buffers (up to `limit` in all) if
  // the free ones are too few.
  absl::Status Reserve(uint32_t n, uint32_t limit, Worker& ctx);
  // Lending stops short of the last quarter of the capacity, which is kept
  // for new connections' initial grants.
  bool CanLend(uint32_t n, Worker& ctx) {
    return Reserve(n, capacity - capacity / 4, ctx).ok();
  }
  bool Post(RecvSlot* s);
  void OnRecv(RecvSlot* s, const ibv_wc& wc);
  void Release(RecvSlot* s);
  void Detach() {
    srq.reset();  // discards the posted receives: the NIC is done with them
    for (Chunk& c : chunks) c.mr.Deregister();
    detached = true;
    if (held == 0) delete this;
  }
};

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_SRQ_POOL_H_
