// QpCore: the execution of one send work request, under the connection's
// mutex -- checks as a verbs requester and responder make them, the copy
// through the memory-region table, and the completions.
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "transport/loop/qp.h"

namespace coverbs::transport::loop {
namespace {

struct Span {
  char* p;
  uint64_t n;
};

// Copies the bytes of `src` (in order) into `dst` (in order); the caller
// has checked that dst holds at least as many.
void Scatter(const Span* src, int nsrc, const Span* dst) {
  uint64_t doff = 0;
  int d = 0;
  for (int s = 0; s < nsrc; ++s) {
    const char* p = src[s].p;
    uint64_t left = src[s].n;
    while (left > 0) {
      while (dst[d].n == doff) {
        ++d;
        doff = 0;
      }
      const uint64_t n = std::min(left, dst[d].n - doff);
      std::memcpy(dst[d].p + doff, p, n);
      doff += n;
      p += n;
      left -= n;
    }
  }
}

char* At(uint64_t addr) { return reinterpret_cast<char*>(addr); }

}  // namespace

bool QpCore::TakeRecvLocked(RecvWqe* out, ibv_sge* sges) {
  if (cfg_.srq) return cfg_.srq->Take(out, sges);
  if (rq_.empty()) return false;
  *out = rq_.Front();
  std::memcpy(sges, out->sge, sizeof(ibv_sge) * out->num_sge);
  out->sge = sges;
  rq_.Pop();
  return true;
}

QpCore::Outcome QpCore::ExecuteLocked(const ibv_send_wr& wr,
                                      const std::vector<char>* inline_bytes) {
  auto fail = [](ibv_wc_status status, std::string why,
                 std::optional<ibv_event_type> peer_event = std::nullopt) {
    Outcome o;
    o.kind = Outcome::kFailed;
    o.status = status;
    o.why = std::move(why);
    o.peer_event = peer_event;
    return o;
  };
  QpCore* peer = PeerLocked();
  if (peer == nullptr) {
    return fail(IBV_WC_RETRY_EXC_ERR, "the peer QP is gone");
  }
  MrTable::Reader table(MrTable::Get());
  const ibv_wr_opcode op = wr.opcode;
  const bool reads_into_local = op == IBV_WR_RDMA_READ ||
                                op == IBV_WR_ATOMIC_CMP_AND_SWP ||
                                op == IBV_WR_ATOMIC_FETCH_AND_ADD;
  // The local side: where the data comes from (or, for READ and atomics,
  // goes to). Inline data needs no registration.
  Span local[kMaxSge];
  int nlocal = 0;
  uint64_t total = 0;
  if (inline_bytes != nullptr) {
    local[nlocal++] = Span{const_cast<char*>(inline_bytes->data()),
                           inline_bytes->size()};
    total = inline_bytes->size();
  } else {
    const bool is_inline = (wr.send_flags & IBV_SEND_INLINE) != 0;
    for (int i = 0; i < wr.num_sge; ++i) {
      const ibv_sge& sge = wr.sg_list[i];
      if (!is_inline && table.Local(cfg_.pd_id, sge, reads_into_local) ==
                            nullptr) {
        return fail(IBV_WC_LOC_PROT_ERR,
                    absl::StrFormat("%s: local SGE %d (lkey 0x%x, %u bytes) "
                                    "not in a region of this PD",
                                    WrOpcodeName(op), i, sge.lkey,
                                    sge.length));
      }
      local[nlocal++] = Span{At(sge.addr), sge.length};
      total += sge.length;
    }
  }
  const uint64_t raddr = wr.wr.rdma.remote_addr;
  Outcome done;
  switch (op) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM: {
      RecvWqe rwqe;
      ibv_sge rsges[kMaxSge];
      if (!peer->TakeRecvLocked(&rwqe, rsges)) {
        if (cfg_.init.rnr_retry == 7) return Outcome{Outcome::kHeld};
        return fail(IBV_WC_RNR_RETRY_EXC_ERR,
                    "SEND: no receive posted at the peer (finite rnr_retry "
                    "fails at once: the loop provider runs no RNR timer)");
      }
      ibv_wc rwc{};
      rwc.wr_id = rwqe.wr_id;
      rwc.opcode = IBV_WC_RECV;
      rwc.qp_num = peer->qp_num();
      rwc.src_qp = qp_num();
      Span dst[kMaxSge];
      uint64_t room = 0;
      const uint64_t rpd = peer->cfg_.srq ? peer->cfg_.srq->pd_id()
                                          : peer->cfg_.pd_id;
      for (uint32_t i = 0; i < rwqe.num_sge; ++i) {
        if (table.Local(rpd, rwqe.sge[i], true) == nullptr) {
          rwc.status = IBV_WC_LOC_PROT_ERR;
          peer->cfg_.recv_cq->Push(rwc);
          return fail(IBV_WC_REM_OP_ERR,
                      "SEND: the peer's receive has an invalid SGE",
                      IBV_EVENT_QP_FATAL);
        }
        dst[i] = Span{At(rwqe.sge[i].addr), rwqe.sge[i].length};
        room += rwqe.sge[i].length;
      }
      if (total > room) {
        rwc.status = IBV_WC_LOC_LEN_ERR;
        peer->cfg_.recv_cq->Push(rwc);
        return fail(IBV_WC_REM_INV_REQ_ERR,
                    absl::StrFormat("SEND of %u bytes into a receive of %u",
                                    total, room),
                    IBV_EVENT_QP_REQ_ERR);
      }
      Scatter(local, nlocal, dst);
      rwc.status = IBV_WC_SUCCESS;
      rwc.byte_len = static_cast<uint32_t>(total);
      if (op == IBV_WR_SEND_WITH_IMM) {
        rwc.wc_flags = IBV_WC_WITH_IMM;
        rwc.imm_data = wr.imm_data;
      }
      peer->cfg_.recv_cq->Push(rwc);
      return done;
    }
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: {
      if (table.Remote(peer->cfg_.pd_id, wr.wr.rdma.rkey, raddr, total,
                       IBV_ACCESS_REMOTE_WRITE) == nullptr) {
        return fail(IBV_WC_REM_ACCESS_ERR,
                    absl::StrFormat("RDMA_WRITE: rkey 0x%x does not grant "
                                    "remote write on [0x%x, +%u)",
                                    wr.wr.rdma.rkey, raddr, total),
                    IBV_EVENT_QP_ACCESS_ERR);
      }
      RecvWqe rwqe;
      ibv_sge rsges[kMaxSge];
      if (op == IBV_WR_RDMA_WRITE_WITH_IMM &&
          !peer->TakeRecvLocked(&rwqe, rsges)) {
        if (cfg_.init.rnr_retry == 7) return Outcome{Outcome::kHeld};
        return fail(IBV_WC_RNR_RETRY_EXC_ERR,
                    "RDMA_WRITE_WITH_IMM: no receive posted at the peer");
      }
      Span dst{At(raddr), total};
      Scatter(local, nlocal, &dst);
      if (op == IBV_WR_RDMA_WRITE_WITH_IMM) {
        ibv_wc rwc{};
        rwc.wr_id = rwqe.wr_id;
        rwc.status = IBV_WC_SUCCESS;
        rwc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        rwc.byte_len = static_cast<uint32_t>(total);
        rwc.qp_num = peer->qp_num();
        rwc.src_qp = qp_num();
        rwc.wc_flags = IBV_WC_WITH_IMM;
        rwc.imm_data = wr.imm_data;
        peer->cfg_.recv_cq->Push(rwc);
      }
      return done;
    }
    case IBV_WR_RDMA_READ: {
      if (table.Remote(peer->cfg_.pd_id, wr.wr.rdma.rkey, raddr, total,
                       IBV_ACCESS_REMOTE_READ) == nullptr) {
        return fail(IBV_WC_REM_ACCESS_ERR,
                    absl::StrFormat("RDMA_READ: rkey 0x%x does not grant "
                                    "remote read on [0x%x, +%u)",
                                    wr.wr.rdma.rkey, raddr, total),
                    IBV_EVENT_QP_ACCESS_ERR);
      }
      Span src{At(raddr), total};
      Scatter(&src, 1, local);
      done.byte_len = static_cast<uint32_t>(total);
      return done;
    }
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD: {
      const uint64_t a = wr.wr.atomic.remote_addr;
      if (total != 8) {
        return fail(IBV_WC_LOC_LEN_ERR, "atomic: the result SGE is not 8 bytes");
      }
      if ((a & 7) != 0 ||
          table.Remote(peer->cfg_.pd_id, wr.wr.atomic.rkey, a, 8,
                       IBV_ACCESS_REMOTE_ATOMIC) == nullptr) {
        return fail(IBV_WC_REM_ACCESS_ERR,
                    absl::StrFormat("%s: rkey 0x%x does not grant remote "
                                    "atomics on 8 aligned bytes at 0x%x",
                                    WrOpcodeName(op), wr.wr.atomic.rkey, a),
                    IBV_EVENT_QP_ACCESS_ERR);
      }
      // Atomic with respect to other loop atomics from any thread.
      uint64_t* target = reinterpret_cast<uint64_t*>(a);
      uint64_t old;
      if (op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
        old = __atomic_fetch_add(target, wr.wr.atomic.compare_add,
                                 __ATOMIC_SEQ_CST);
      } else {
        old = wr.wr.atomic.compare_add;
        __atomic_compare_exchange_n(target, &old, wr.wr.atomic.swap, false,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
      }
      std::memcpy(local[0].p, &old, 8);
      done.byte_len = 8;
      return done;
    }
    default:
      return fail(IBV_WC_LOC_QP_OP_ERR, "unsupported opcode");
  }
}

// `wr`'s SGE list may be gone (a WR that waited): only its fields are read.
void QpCore::FinishLocked(const ibv_send_wr& wr, const Outcome& o) {
  if (o.kind == Outcome::kDone) {
    if (signaled(wr)) CompleteSendLocked(wr, IBV_WC_SUCCESS, o.byte_len);
    return;
  }
  // An error completes even an unsignaled WR; then the QP (and its peer)
  // enter the error state and flush the WRs posted after it.
  CompleteSendLocked(wr, o.status, 0);
  EnterErrorLocked(IBV_EVENT_QP_FATAL, o.peer_event,
                   absl::StrFormat("%s (wr_id 0x%x): %s: %s",
                                   WrOpcodeName(wr.opcode), wr.wr_id,
                                   ibv_wc_status_str(o.status), o.why));
}

void QpCore::CompleteSendLocked(const ibv_send_wr& wr, ibv_wc_status status,
                                uint32_t byte_len) {
  ibv_wc wc{};
  wc.wr_id = wr.wr_id;
  wc.status = status;
  wc.opcode = WcOpcode(wr.opcode);
  wc.byte_len = byte_len;
  wc.qp_num = qp_num();
  cfg_.send_cq->Push(wc);
}

}  // namespace coverbs::transport::loop
