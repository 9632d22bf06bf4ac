#include "cm/srq_pool.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"
#include "cm/worker_shared.h"
#include "cm/wire.h"
#include "core/log.h"

namespace coverbs::cm {
namespace internal {

void DetachSrqPool(SrqPool* pool) { pool->Detach(); }

absl::StatusOr<SrqPool*> SrqPool::For(Worker& ctx) {
  WorkerShared& sh = SharedOf(ctx);
  if (sh.srq_pool != nullptr) return sh.srq_pool;
  const WorkerOptions& o = ctx.options();
  if (o.srq_depth == 0) {
    return absl::FailedPreconditionError(
        "ConnectionOptions::use_srq needs a Worker with a shared receive "
        "queue (WorkerOptions::srq_depth > 0)");
  }
  if (o.srq_buffer_size <= kHeaderSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions::srq_buffer_size ", o.srq_buffer_size,
                     " does not hold a message header"));
  }
  auto srq =
      transport::SharedReceiveQueue::Create(ctx.pd(), ctx.cq(), o.srq_depth, 1);
  if (!srq.ok()) {
    return absl::Status(
        srq.status().code(),
        absl::StrCat("creating the Worker's shared receive queue (",
                     o.srq_depth, " receives): ", srq.status().message()));
  }
  auto* pool = new SrqPool();
  pool->srq = std::move(*srq);
  pool->capacity = o.srq_depth;
  pool->slot_size = (size_t{o.srq_buffer_size} + 63) & ~size_t{63};
  sh.srq_pool = pool;
  return pool;
}

}  // namespace internal

Worker::SrqUsage Worker::srq_usage() const {
  SrqUsage u;
  const internal::SrqPool* p = shared_->srq_pool;
  if (p == nullptr) return u;
  u.buffers = p->slots;
  u.posted = p->srq->posted();
  u.promised = p->committed;
  u.bytes = size_t{p->slots} * p->slot_size;
  return u;
}

namespace internal {

absl::Status SrqPool::Reserve(uint32_t n, uint32_t limit, Worker& ctx) {
  while (Free() < n && !unposted.empty()) {
    RecvSlot* s = unposted.back();
    unposted.pop_back();
    if (!Post(s)) break;
  }
  while (Free() < n) {
    if (slots >= limit) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the shared receive queue is full: %d of %d receives promised "
          "(WorkerOptions::srq_depth)",
          committed, capacity));
    }
    // Grow by at least 64 buffers (one registration each time).
    uint32_t want = static_cast<uint32_t>(n - Free());
    uint32_t count = std::min(limit - slots, std::max<uint32_t>(want, 64));
    size_t bytes = (slot_size * count + 4095) & ~size_t{4095};
    Chunk c;
    c.mem = static_cast<std::byte*>(std::aligned_alloc(4096, bytes));
    if (c.mem == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", bytes, " bytes of SRQ receive buffers"));
    }
    auto mr = ctx.pd().Register(c.mem, bytes, IBV_ACCESS_LOCAL_WRITE);
    if (!mr.ok()) {
      std::free(c.mem);
      return absl::Status(mr.status().code(),
                          absl::StrCat("registering SRQ receive buffers: ",
                                       mr.status().message()));
    }
    c.mr = std::move(*mr);
    c.slots.reset(new RecvSlot[count]);
    slots += count;
    for (uint32_t i = 0; i < count; ++i) {
      RecvSlot& s = c.slots[i];
      s.pool = this;
      s.data = c.mem + i * slot_size;
      s.lkey = c.mr.lkey();
    }
    RecvSlot* first = c.slots.get();
    chunks.push_back(std::move(c));
    for (uint32_t i = 0; i < count; ++i) {
      if (!Post(first + i)) {
        return absl::UnavailableError(
            "posting receives to the shared receive queue failed");
      }
    }
  }
  committed += n;
  return absl::OkStatus();
}

bool SrqPool::Post(RecvSlot* s) {
  LocalBuffer b{s->data, static_cast<uint32_t>(slot_size), s->lkey};
  absl::Status st = srq->PostRecv(s, std::span<const LocalBuffer>(&b, 1));
  if (!st.ok()) {
    COVERBS_LOG(kError, "cm", "reposting an SRQ receive: %s", st.ToString());
    unposted.push_back(s);
    return false;
  }
  s->posted = true;
  return true;
}

void SrqPool::OnRecv(RecvSlot* s, const ibv_wc& wc) {
  s->posted = false;
  auto it = by_qp.find(wc.qp_num);
  // A completion of a connection that is gone (its QP was destroyed with
  // the message already in the CQ) only gives the buffer back.
  if (it != by_qp.end()) it->second->OnRecv(s, wc);
  if (!s->posted && !s->held) Post(s);
}

void SrqPool::Release(RecvSlot* s) {
  s->held = false;
  --held;
  if (detached) {
    if (held == 0) delete this;
    return;
  }
  auto it = conns.find(s->conn_id);
  if (it != conns.end()) {
    it->second->ReturnSlot(s);
  } else {
    Post(s);
  }
}

}  // namespace internal
}  // namespace coverbs::cm
