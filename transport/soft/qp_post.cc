// QpCore's application side (any thread): PostSend / PostRecv check each
// work request like verbs and copy it into the send ring (the receive ring
// for PostRecv), SetError marks the QP, and each of them kicks the progress
// thread -- except a PostSend inside a post batch (a reactor's loop
// iteration): its QP is flushed at the end of the batch by the posting
// thread itself (TxInline, qp_tx.cc), one sendmsg for everything the batch
// posted to it (or a few: early transmits, QpCore::PostSend), with no
// hand-off to the progress thread and no wake-up.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "transport/soft/early_tx_gate.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/qp_internal.h"

namespace coverbs::transport::soft {
namespace {

struct DeferredQp {
  std::shared_ptr<QpCore> qp;
  std::shared_ptr<Engine> engine;  // QpCore::engine_ is a plain pointer
};

// The calling thread's post batch (BeginPostBatch / EndPostBatch).
struct PostBatch {
  int depth = 0;
  // Listed by their first post (QpCore::deferred_), again after an early
  // transmit.
  std::vector<DeferredQp> qps;
  // A reactor serving several connections makes no early transmits
  // (QpCore::PostSend): `several` when this batch lists a second QP, or a
  // QP other than the one the last batch with posts listed; then none for
  // kQuietBatches batches with posts after one that was `several`. (The
  // pointer is compared, never followed.)
  static constexpr int kQuietBatches = 16;
  bool several = false;
  int cooldown = 0;
  const QpCore* last_qp = nullptr;
  bool EarlyTx() { return !several && cooldown == 0 && MayOverlap(); }

  // early_tx_gate.h; COVERBS_SOFT_EARLY_TX=on|off forces the decision
  // (tests).
  EarlyTxGate gate;
  bool MayOverlap() {
    static const int forced = [] {
      const char* v = std::getenv("COVERBS_SOFT_EARLY_TX");
      if (v == nullptr) return 0;
      if (std::strcmp(v, "on") == 0) return 1;
      if (std::strcmp(v, "off") == 0) return -1;
      return 0;
    }();
    if (forced != 0) return forced > 0;
    static const int cpus = [] {
      cpu_set_t set;
      return sched_getaffinity(0, sizeof(set), &set) != 0 ? 2 : CPU_COUNT(&set);
    }();
    return gate.MayOverlap(cpus, RunnableTasks);
  }
  // Runnable tasks on the host now, from /proc/loadavg (one pread on an fd
  // kept open), or 0 when it cannot be read.
  static int RunnableTasks() {
    static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[128];
    const ssize_t n = pread(fd, buf, sizeof(buf), 0);
    if (n <= 0) return 0;
    return ParseLoadavgRunnable(std::string_view(buf, static_cast<size_t>(n)));
  }
  // Held back by the last outermost batch (a pure ACK), still deferred_:
  // sent by the next EndPostBatch or FlushHeldAcks.
  std::vector<DeferredQp> held;
  std::vector<DeferredQp> flushing;  // `held` being sent (kept for capacity)

  void List(std::shared_ptr<QpCore> qp, std::shared_ptr<Engine> engine) {
    const QpCore* first = qps.empty() ? last_qp : qps.front().qp.get();
    if (first != nullptr && first != qp.get()) several = true;
    qps.push_back(DeferredQp{std::move(qp), std::move(engine)});
  }
};
thread_local PostBatch t_batch;

}  // namespace

absl::Status QpCore::CheckSendWr(const ibv_send_wr& wr) const {
  switch (wr.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_RDMA_READ:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
    case IBV_WR_SEND_WITH_INV:
      break;
    case IBV_WR_BIND_MW:
    case IBV_WR_LOCAL_INV:
      // No data: the SGE list is not read.
      if ((wr.send_flags & IBV_SEND_INLINE) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "soft: post send on qp %u: IBV_SEND_INLINE on a %s (EINVAL)",
            qp_num(), wr.opcode == IBV_WR_BIND_MW ? "BIND_MW" : "LOCAL_INV"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: opcode %d not supported (EINVAL)",
          qp_num(), static_cast<int>(wr.opcode)));
  }
  if (wr.num_sge < 0 || static_cast<uint32_t>(wr.num_sge) > max_send_sge_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: num_sge %d exceeds max_send_sge %u "
        "(EINVAL)",
        qp_num(), wr.num_sge, max_send_sge_));
  }
  if (wr.num_sge > 0 && wr.sg_list == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: null sg_list (EINVAL)", qp_num()));
  }
  uint64_t total = 0;
  for (int i = 0; i < wr.num_sge; ++i) total += wr.sg_list[i].length;
  if (total > kMaxMessage) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: message of %u bytes exceeds 2 GiB (EINVAL)",
        qp_num(), total));
  }
  if (IsAtomic(wr.opcode) && (wr.num_sge != 1 || wr.sg_list[0].length != 8)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: an atomic needs one 8-byte SGE (EINVAL)",
        qp_num()));
  }
  if ((wr.send_flags & IBV_SEND_INLINE) != 0) {
    if (wr.opcode == IBV_WR_RDMA_READ || IsAtomic(wr.opcode)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: IBV_SEND_INLINE on a READ or atomic "
          "(EINVAL)",
          qp_num()));
    }
    if (total > max_inline_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: post send on qp %u: inline message of %u bytes exceeds "
          "max_inline_data %u (EINVAL)",
          qp_num(), total, max_inline_));
    }
  }
  return absl::OkStatus();
}

bool QpCore::FillSendWqe(const MrTable::Reader& table, const ibv_send_wr& wr,
                         uint64_t index,
                         std::vector<std::shared_ptr<MrEntry>>* unmapped) {
  size_t i = index % sq_cap_;
  SendWqe& w = sq_[i];
  w.wr_id = wr.wr_id;
  w.opcode = static_cast<uint8_t>(wr.opcode);
  w.status = IBV_WC_SUCCESS;
  w.rnr_retries = 0;
  w.signaled = cfg_.init.sq_sig_all || (wr.send_flags & IBV_SEND_SIGNALED);
  w.solicited = (wr.send_flags & IBV_SEND_SOLICITED) != 0;
  w.inlined = (wr.send_flags & IBV_SEND_INLINE) != 0;
  w.num_sge = static_cast<uint32_t>(wr.num_sge);
  w.imm = (wr.opcode == IBV_WR_SEND_WITH_IMM ||
           wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
              ? wr.imm_data
              : 0;
  w.remote_addr = 0;
  w.rkey = 0;
  w.compare_add = 0;
  w.swap = 0;
  if (IsAtomic(wr.opcode)) {
    w.remote_addr = wr.wr.atomic.remote_addr;
    w.rkey = wr.wr.atomic.rkey;
    w.compare_add = wr.wr.atomic.compare_add;
    w.swap = wr.wr.atomic.swap;
  } else if (wr.opcode == IBV_WR_SEND_WITH_INV) {
    w.rkey = wr.invalidate_rkey;
  } else if (wr.opcode == IBV_WR_BIND_MW || wr.opcode == IBV_WR_LOCAL_INV) {
    // Done now, in posting order with the other binds and invalidations of
    // the QP (a QP in error flushes the WR instead). A WR that reports
    // something -- an error, or a signaled success -- still goes down the
    // send queue, as an empty WRITE that only takes the next sequence
    // number, and completes in order like any other. The usual one (an
    // unsignaled bind of a landing grant) ends here: its frame and the
    // peer's parsing of it were most of a grant's cost on soft.
    w.num_sge = 0;
    w.total = 0;
    if (state_.load(std::memory_order_acquire) != IBV_QPS_RTS) return true;
    if (wr.opcode == IBV_WR_BIND_MW) {
      const ibv_mw_bind_info& b = wr.bind_mw.bind_info;
      w.status = table.BindWindow(
          wr.bind_mw.rkey, cfg_.pd_id, b.mr != nullptr ? b.mr->lkey : 0, b.addr,
          b.length, static_cast<int>(b.mw_access_flags), uid_);
    } else if (auto e = table.UnmapWindow(wr.invalidate_rkey, cfg_.pd_id)) {
      unmapped->push_back(std::move(e));
    } else {
      w.status = IBV_WC_LOC_PROT_ERR;
    }
    return w.status != IBV_WC_SUCCESS || w.signaled;
  } else if (wr.opcode != IBV_WR_SEND && wr.opcode != IBV_WR_SEND_WITH_IMM) {
    w.remote_addr = wr.wr.rdma.remote_addr;
    w.rkey = wr.wr.rdma.rkey;
  }
  w.total = 0;
  if (w.inlined) {
    // Copied now: the buffer is the caller's again when PostSend returns.
    char* dst = sq_inline_.data() + i * max_inline_;
    for (int k = 0; k < wr.num_sge; ++k) {
      const ibv_sge& sge = wr.sg_list[k];
      if (sge.length == 0) continue;
      std::memcpy(dst + w.total, reinterpret_cast<const void*>(sge.addr),
                  sge.length);
      w.total += sge.length;
    }
    return true;
  }
  bool nic_writes = wr.opcode == IBV_WR_RDMA_READ || IsAtomic(wr.opcode);
  for (int k = 0; k < wr.num_sge; ++k) {
    const ibv_sge& sge = wr.sg_list[k];
    size_t j = i * max_send_sge_ + k;
    sq_sge_[j] = sge;
    w.total += sge.length;
    if (sge.length == 0) {
      sq_mr_[j].reset();
      continue;
    }
    const std::shared_ptr<MrEntry>* mr =
        CheckLocalSge(table, cfg_.pd_id, sge, nic_writes);
    if (mr == nullptr) {
      w.status = IBV_WC_LOC_PROT_ERR;
      sq_mr_[j].reset();
    } else {
      sq_mr_[j] = *mr;
    }
  }
  return true;
}

absl::Status QpCore::PostSend(ibv_send_wr* wr, ibv_send_wr** bad) {
  int st = state_.load(std::memory_order_acquire);
  if (st != IBV_QPS_RTS && st != IBV_QPS_ERR) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post send on qp %u: QP is not connected (state %d) (EINVAL)",
        qp_num(), st));
  }
  absl::Status status;
  bool posted = false;
  uint64_t bytes = 0;  // payload of what this call posted
  // Binds and invalidations change the table: lock it exclusively for such
  // a list (one scan of the opcodes first).
  bool windows = false;
  for (const ibv_send_wr* w = wr; w != nullptr && !windows; w = w->next) {
    windows = w->opcode == IBV_WR_BIND_MW || w->opcode == IBV_WR_LOCAL_INV;
  }
  std::vector<std::shared_ptr<MrEntry>> unmapped;
  {
    MrTable::Reader table(MrTable::Get(), windows);
    std::lock_guard<std::mutex> lock(mu_);
    // A bind or invalidation may end at post (FillSendWqe) only if the
    // whole list is then posted: a list posted in part puts the QP in
    // error, and its caller waits for a flush completion of every WR that
    // was posted -- which a WR that never entered the queue would not get.
    bool may_end_at_post = windows;
    if (windows) {
      uint32_t n = 0;
      for (const ibv_send_wr* w = wr; w != nullptr && may_end_at_post;
           w = w->next) {
        may_end_at_post = CheckSendWr(*w).ok();
        ++n;
      }
      may_end_at_post = may_end_at_post && sq_head_ - sq_tail_ + n <= sq_cap_;
    }
    for (; wr != nullptr; wr = wr->next) {
      // (A list that may end binds at post passed every check above.)
      if (!may_end_at_post) status = CheckSendWr(*wr);
      if (status.ok() && sq_head_ - sq_tail_ >= sq_cap_) {
        status = absl::ResourceExhaustedError(absl::StrFormat(
            "soft: post send on qp %u: send queue full (%u WRs) (ENOMEM)",
            qp_num(), sq_cap_));
      }
      if (!status.ok()) {
        if (bad) *bad = wr;
        break;
      }
      if (FillSendWqe(table, *wr, sq_head_, &unmapped) || !may_end_at_post) {
        if (wr->opcode != IBV_WR_BIND_MW && wr->opcode != IBV_WR_LOCAL_INV) {
          bytes += sq_[sq_head_ % sq_cap_].total;  // (binds leave it unset)
        }
        ++sq_head_;
        posted = true;
      }
    }
  }
  // Outside the table lock: ending a window may wait for the progress
  // thread, which takes that lock.
  for (const auto& e : unmapped) MrTable::Get().DropWindow(e);
  if (posted) {
    if (t_batch.depth > 0) {
      if (!deferred_.exchange(true)) {
        // References: the QP or its engine may be destroyed (by another
        // thread, too) before the batch ends.
        t_batch.List(shared_from_this(), engine_->shared_from_this());
      }
      // Large posts do not count: each is already a transfer long enough
      // for the peer to work on as it arrives, and early transmits of them
      // cost more than they gained (64 KiB echo, 0.87x).
      if (bytes <= kEarlyTxMaxBytes) {
        const uint32_t n =
            batch_posts_.fetch_add(1, std::memory_order_relaxed) + 1;
        const uint32_t at = early_tx_at_.load(std::memory_order_relaxed);
        if (n >= at && t_batch.EarlyTx()) {
          // Transmits now; the QP stays on the batch's list (a later post
          // lists it again: flushing twice sends nothing twice).
          FlushDeferred();
          early_tx_at_.store(at * 2, std::memory_order_relaxed);
        }
      }
    } else {
      Kick();
    }
  }
  return status;
}

absl::Status QpCore::PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (!rq_) {
    if (bad) *bad = wr;
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: post recv on qp %u: the QP receives from an SRQ (EINVAL)",
        qp_num()));
  }
  absl::Status s = rq_->Post(wr, bad, qp_num());
  // A QP in error flushes what is posted to it.
  if (state_.load() == IBV_QPS_ERR) Kick();
  return s;
}

void QpCore::RequestError() {
  error_requested_.store(true);
  state_.store(IBV_QPS_ERR);
  Kick();
}

void QpCore::Kick() {
  if (!kicked_.exchange(true)) engine_->Kick(shared_from_this());
}

bool QpCore::FlushDeferred(bool may_hold) {
  // Cleared first: a post from another thread from now on lists the QP
  // again or finds its WR picked up by the TxInline below (which reads the
  // ring's head under mu_ after this store).
  deferred_.store(false);
  batch_posts_.store(0, std::memory_order_relaxed);
  early_tx_at_.store(kFirstEarlyTx, std::memory_order_relaxed);
  // Not under mu_: TxInline takes progress_mu_, which comes first.
  switch (TxInline(may_hold)) {
    case InlineTx::kDone:
      return false;
    case InlineTx::kKick:
      Kick();
      return false;
    case InlineTx::kHeld:
      // Listed again (a post from another thread in between may have
      // listed it too: flushing twice sends nothing twice).
      deferred_.store(true);
      return true;
  }
  return false;
}

void QpCore::DeferTx(std::shared_ptr<Engine> engine) {
  if (t_batch.depth > 0) {
    if (!deferred_.exchange(true)) {
      t_batch.List(shared_from_this(), std::move(engine));
    }
    return;
  }
  FlushDeferred();
}

void BeginPostBatch() { ++t_batch.depth; }

namespace {

void FlushHeld() {
  t_batch.flushing.swap(t_batch.held);
  for (DeferredQp& d : t_batch.flushing) d.qp->FlushDeferred();
  t_batch.flushing.clear();
}

}  // namespace

void EndPostBatch() {
  if (t_batch.depth > 0) --t_batch.depth;
  // Every end flushes (an inner one too): nothing posted waits for an outer
  // batch that may be waiting for it. Flushing posts nothing, so the list
  // does not change under us. The one exception: at the end of an
  // outermost batch (a reactor's iteration), a QP that owes only the ACK
  // of what the iteration received is held for one more batch, since the
  // response to it (the RPC layer runs the handler in the next iteration)
  // then carries it in the same write, and the peer wakes once instead of
  // twice. Held ones go out at the next EndPostBatch whatever they hold,
  // or before the reactor sleeps (FlushHeldAcks), or at worst from the
  // progress thread's 10 ms check (Engine::CheckReactors).
  bool outermost = t_batch.depth == 0;
  if (!t_batch.held.empty()) FlushHeld();
  if (t_batch.qps.empty()) return;
  const QpCore* first = t_batch.qps.front().qp.get();
  for (DeferredQp& d : t_batch.qps) {
    if (d.qp->FlushDeferred(outermost)) t_batch.held.push_back(std::move(d));
  }
  t_batch.qps.clear();
  if (outermost) {
    t_batch.last_qp = first;
    if (t_batch.several) {
      t_batch.cooldown = PostBatch::kQuietBatches;
    } else if (t_batch.cooldown > 0) {
      --t_batch.cooldown;
    }
  }
  t_batch.several = false;
}

void FlushHeldAcks() {
  if (t_batch.depth == 0 && !t_batch.held.empty()) FlushHeld();
}

}  // namespace coverbs::transport::soft
