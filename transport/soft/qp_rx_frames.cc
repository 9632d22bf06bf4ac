// What each incoming frame does (progress thread). qp_rx.cc hands over each
// frame header (StartFrame) and, once its payload is placed, calls
// FinishFrame. First comes the peer's HELLO; then, as responder, requests
// executed strictly in seq order -- SEND into a posted receive, WRITE into a
// checked region, READ and atomics answered through the response ring --
// with ACKs, NAKs and RNR NAKs queued for the transmit side; as requester,
// ACKs, NAKs, RNR NAKs and READ / atomic responses that complete send WRs.
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/qp_internal.h"

namespace coverbs::transport::soft {

bool QpCore::TakeRecv() {
  RecvQueue* q = rq_ ? rq_.get() : cfg_.srq.get();
  if (!q->Take(&cur_recv_)) return false;
  have_cur_recv_ = true;
  return true;
}

uint8_t QpCore::CheckRemote(uint32_t rkey, uint64_t addr, uint64_t len,
                            int access, std::shared_ptr<MrEntry>* out,
                            MrPin* pin) const {
  MrTable::Reader table(MrTable::Get());
  const std::shared_ptr<MrEntry>* mr = table.FindRkey(rkey);
  if (mr == nullptr) return IBV_WC_REM_ACCESS_ERR;
  const MrEntry& e = **mr;
  if (e.pd_id != cfg_.pd_id || (e.access & access) == 0 ||
      !e.Covers(addr, len)) {
    return IBV_WC_REM_ACCESS_ERR;
  }
  // A window serves the QP it is bound to and no other.
  if (e.is_window && e.qp_uid != uid_) return IBV_WC_REM_ACCESS_ERR;
  if (pin != nullptr) {
    return pin->Pin(*mr) ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR;
  }
  if (!e.Usable()) return IBV_WC_REM_ACCESS_ERR;
  *out = *mr;
  return IBV_WC_SUCCESS;
}

void QpCore::QueueCtrl(Ctrl c) {
  ctrl_.push_back(std::move(c));
  Activate();
}

void QpCore::QueueAck(uint64_t seq) {
  if (!ctrl_.empty() && ctrl_.back().op == wire::kAck) {
    ctrl_.back().seq = seq;
    return;
  }
  Ctrl c;
  c.op = wire::kAck;
  c.seq = seq;
  QueueCtrl(std::move(c));
}

void QpCore::RespondError(uint8_t nak_status, const std::string& why) {
  Ctrl c;
  c.op = wire::kNak;
  c.seq = cur_.seq;
  c.syndrome = nak_status;
  QueueCtrl(std::move(c));
  // As a verbs responder: a request refused for its key, range or rights
  // is a remote access violation on this QP (IBV_EVENT_QP_ACCESS_ERR, rxe's
  // and the IB spec's "local access violation WQ error"); one invalid in
  // itself is an invalid request (IBV_EVENT_QP_REQ_ERR); a failure of our
  // own receive stays a QP fatal error.
  ibv_event_type event = IBV_EVENT_QP_FATAL;
  if (nak_status == IBV_WC_REM_ACCESS_ERR) {
    event = IBV_EVENT_QP_ACCESS_ERR;
  } else if (nak_status == IBV_WC_REM_INV_REQ_ERR) {
    event = IBV_EVENT_QP_REQ_ERR;
  }
  EnterError(Cause::kFault, why, event);
}

void QpCore::PushRecvWc(uint8_t status, ibv_wc_opcode op, uint32_t len,
                        bool imm, uint32_t imm_data, bool inv) {
  ibv_wc wc{};
  wc.wr_id = cur_recv_.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = qp_num();
  wc.src_qp = peer_qpn_;
  if (imm) {
    wc.wc_flags = IBV_WC_WITH_IMM;
    wc.imm_data = imm_data;
  } else if (inv) {
    wc.wc_flags = IBV_WC_WITH_INV;
    wc.invalidated_rkey = imm_data;
  }
  have_cur_recv_ = false;
  for (uint32_t k = 0; k < cur_recv_.num_sge; ++k) cur_recv_.mr[k].reset();
  if (!cfg_.recv_cq->Push(wc)) {
    EnterError(Cause::kFault, "receive CQ overrun");
  }
}

void QpCore::RecvFailed(uint8_t recv_status, uint8_t nak_status,
                        const std::string& why) {
  PushRecvWc(recv_status, IBV_WC_RECV, 0, false, 0);
  RespondError(nak_status, why);
}

void QpCore::ProtocolError(const std::string& why) {
  EnterError(Cause::kFault, "protocol error: " + why);
}

void QpCore::StartFrame(const wire::Header& h) {
  cur_ = h;
  if (!hello_rx_) {
    if (h.opcode != wire::kHello || h.addr != wire::kHelloMagic ||
        h.payload_len != 0) {
      ProtocolError("the peer is not a coverbs soft QP (bad hello)");
      return;
    }
    if (h.dma_len != wire::kVersion) {
      ProtocolError(absl::StrFormat("peer speaks version %u, we speak %u",
                                    h.dma_len, wire::kVersion));
      return;
    }
    hello_rx_ = true;
    peer_qpn_ = h.qpn;
    return;
  }
  switch (h.opcode) {
    case wire::kSend:
    case wire::kSendImm:
    case wire::kWrite:
    case wire::kWriteImm:
    case wire::kReadReq:
    case wire::kCmpSwap:
    case wire::kFetchAdd:
      StartRequest(h);
      return;
    case wire::kAck:
      if (h.payload_len != 0) break;
      AckBefore(h.seq + 1);
      return;
    case wire::kNak:
    case wire::kRnrNak: {
      if (h.payload_len != 0) break;
      if (!AckBefore(h.seq)) return;
      if (h.seq != comp_ptr_ || h.seq >= send_ptr_) {
        ProtocolError(absl::StrFormat("NAK for request %u not outstanding",
                                      h.seq));
        return;
      }
      SendWqe& w = Wqe(h.seq);
      if (h.opcode == wire::kNak) {
        uint8_t st = h.syndrome;
        if (st != IBV_WC_REM_ACCESS_ERR && st != IBV_WC_REM_INV_REQ_ERR &&
            st != IBV_WC_REM_OP_ERR) {
          st = IBV_WC_REM_OP_ERR;
        }
        CompleteWqe(h.seq, st);
        EnterError(Cause::kFault,
                   absl::StrFormat("request %u failed at the responder: %s",
                                   h.seq, WcStatusName(st)));
        return;
      }
      uint8_t limit = cfg_.init.rnr_retry;
      if (limit != 7 && w.rnr_retries >= limit) {
        CompleteWqe(h.seq, IBV_WC_RNR_RETRY_EXC_ERR);
        EnterError(Cause::kFault,
                   absl::StrFormat("RNR retries exhausted (rnr_retry %u)",
                                   limit));
        return;
      }
      ++w.rnr_retries;
      // Go back: everything from this request on is sent again.
      send_ptr_ = h.seq;
      rd_atomic_out_ = 0;
      rnr_wait_ = true;
      rnr_until_ = std::chrono::steady_clock::now() + RnrDelay(h.syndrome);
      AddTimer(rnr_until_);
      return;
    }
    case wire::kReadResp:
    case wire::kAtomicResp: {
      if (!AckBefore(h.seq)) return;
      bool read = h.opcode == wire::kReadResp;
      if (h.seq != comp_ptr_ || h.seq >= send_ptr_) {
        ProtocolError(absl::StrFormat("response for request %u not outstanding",
                                      h.seq));
        return;
      }
      SendWqe& w = Wqe(h.seq);
      if (read ? w.opcode != IBV_WR_RDMA_READ : !IsAtomic(w.opcode)) {
        ProtocolError("response does not match the request");
        return;
      }
      if (read ? h.payload_len != w.total
               : h.payload_len != wire::kAtomicRespSize) {
        ProtocolError("response length does not match the request");
        return;
      }
      size_t base = (h.seq % sq_cap_) * max_send_sge_;
      if (read) {
        ndest_ = 0;
        for (uint32_t k = 0; k < w.num_sge; ++k) {
          const ibv_sge& sge = sq_sge_[base + k];
          if (sge.length == 0) continue;
          dests_[ndest_++] = Dest{reinterpret_cast<char*>(sge.addr),
                                  sge.length, sq_mr_[base + k].get()};
        }
        BeginPayload(RxKind::kReadResp, h.payload_len);
      } else {
        ndest_ = 1;
        dests_[0] = Dest{atomic_buf_, wire::kAtomicRespSize, nullptr};
        BeginPayload(RxKind::kAtomicResp, h.payload_len);
      }
      return;
    }
    case wire::kDisconnect:
      EnterError(Cause::kPeerDisconnect, "the peer QP disconnected");
      return;
    default:
      break;
  }
  ProtocolError(absl::StrFormat("unexpected frame opcode %u length %u",
                                h.opcode, h.payload_len));
}

void QpCore::StartRequest(const wire::Header& h) {
  if (ctrl_.size() >= kMaxCtrlBacklog) {
    ProtocolError(absl::StrFormat(
        "request %u while %u responses are still owed (limit %u): the peer "
        "does not read them",
        h.seq, ctrl_.size(), kMaxCtrlBacklog));
    return;
  }
  if (h.seq != expected_seq_) {
    if (rnr_drop_ && h.seq > expected_seq_) {
      // Sent before our RNR NAK reached the requester: dropped, resent later.
      ndest_ = 0;
      BeginPayload(RxKind::kDiscard, h.payload_len);
      return;
    }
    ProtocolError(absl::StrFormat("request %u, expected %u", h.seq,
                                  expected_seq_));
    return;
  }
  rnr_drop_ = false;
  auto rnr = [&] {
    Ctrl c;
    c.op = wire::kRnrNak;
    c.seq = h.seq;
    c.syndrome = cfg_.init.min_rnr_timer;
    QueueCtrl(std::move(c));
    rnr_drop_ = true;
    ndest_ = 0;
    BeginPayload(RxKind::kDiscard, h.payload_len);
  };
  switch (h.opcode) {
    case wire::kSend:
    case wire::kSendImm: {
      if (h.payload_len > kMaxMessage) {
        ProtocolError("SEND larger than 2 GiB");
        return;
      }
      if (!TakeRecv()) {
        rnr();
        return;
      }
      if (cur_recv_.status != IBV_WC_SUCCESS) {
        RecvFailed(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR,
                   "receive WR has an invalid local key");
        return;
      }
      if (h.payload_len > cur_recv_.total) {
        RecvFailed(IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR,
                   absl::StrFormat("SEND of %u bytes into a %u-byte receive",
                                   h.payload_len, cur_recv_.total));
        return;
      }
      ndest_ = 0;
      for (uint32_t k = 0; k < cur_recv_.num_sge; ++k) {
        if (cur_recv_.sge[k].length == 0) continue;
        dests_[ndest_++] = Dest{reinterpret_cast<char*>(cur_recv_.sge[k].addr),
                                cur_recv_.sge[k].length, cur_recv_.mr[k].get()};
      }
      BeginPayload(RxKind::kRecv, h.payload_len);
      return;
    }
    case wire::kWrite:
    case wire::kWriteImm: {
      ndest_ = 0;
      if (h.payload_len > 0) {
        if (CheckRemote(h.rkey, h.addr, h.payload_len, IBV_ACCESS_REMOTE_WRITE,
                        nullptr, &rx_mr_) != IBV_WC_SUCCESS) {
          RespondError(IBV_WC_REM_ACCESS_ERR,
                       absl::StrFormat("RDMA WRITE denied: rkey 0x%x addr "
                                       "0x%x len %u",
                                       h.rkey, h.addr, h.payload_len));
          return;
        }
        ndest_ = 1;
        dests_[0] = Dest{reinterpret_cast<char*>(h.addr), h.payload_len,
                         rx_mr_.get(), true};
      }
      if (h.opcode == wire::kWriteImm && !TakeRecv()) {
        rx_mr_.Reset();
        rnr();
        return;
      }
      BeginPayload(RxKind::kWrite, h.payload_len);
      return;
    }
    case wire::kReadReq: {
      if (h.payload_len != 0) break;
      Ctrl c;
      c.op = wire::kReadResp;
      c.seq = h.seq;
      c.addr = h.addr;
      c.len = h.dma_len;
      if (h.dma_len > 0 &&
          CheckRemote(h.rkey, h.addr, h.dma_len, IBV_ACCESS_REMOTE_READ,
                      &c.mr) != IBV_WC_SUCCESS) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     absl::StrFormat("RDMA READ denied: rkey 0x%x addr 0x%x "
                                     "len %u",
                                     h.rkey, h.addr, h.dma_len));
        return;
      }
      ++expected_seq_;
      QueueCtrl(std::move(c));
      return;
    }
    case wire::kCmpSwap:
    case wire::kFetchAdd:
      if (h.payload_len != wire::kAtomicReqSize) break;
      ndest_ = 1;
      dests_[0] = Dest{atomic_buf_, wire::kAtomicReqSize, nullptr};
      BeginPayload(RxKind::kAtomicReq, h.payload_len);
      return;
    default:
      break;
  }
  ProtocolError(absl::StrFormat("malformed request opcode %u length %u",
                                h.opcode, h.payload_len));
}

void QpCore::FinishFrame() {
  const wire::Header& h = cur_;
  switch (rx_kind_) {
    case RxKind::kDiscard:
      return;
    case RxKind::kRecv:
      if (rx_err_) {
        RecvFailed(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR,
                   "receive buffer deregistered while a SEND landed in it");
        return;
      }
      if ((h.flags & wire::kFlagInvalidate) != 0) {
        // Only a window bound to this QP: another QP's, or a region, is an
        // invalid request (as rxe).
        if (h.opcode != wire::kSend ||
            !MrTable::Get().InvalidateByPeer(h.rkey, cfg_.pd_id, uid_)) {
          RecvFailed(IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_INV_REQ_ERR,
                     absl::StrFormat("SEND_WITH_INV of rkey 0x%x, not a "
                                     "window bound to this QP",
                                     h.rkey));
          return;
        }
        ++expected_seq_;
        QueueAck(h.seq);
        PushRecvWc(IBV_WC_SUCCESS, IBV_WC_RECV, h.payload_len, false, h.rkey,
                   true);
        return;
      }
      ++expected_seq_;
      QueueAck(h.seq);
      PushRecvWc(IBV_WC_SUCCESS, IBV_WC_RECV, h.payload_len,
                 h.opcode == wire::kSendImm, h.imm);
      return;
    case RxKind::kWrite:
      rx_mr_.Reset();
      if (rx_err_) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     "target region deregistered during an RDMA WRITE");
        return;
      }
      ++expected_seq_;
      QueueAck(h.seq);
      if (h.opcode == wire::kWriteImm) {
        PushRecvWc(IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, h.payload_len,
                   true, h.imm);
      }
      return;
    case RxKind::kAtomicReq: {
      std::shared_ptr<MrEntry> mr;
      if ((h.addr & 7) != 0 ||
          CheckRemote(h.rkey, h.addr, 8, IBV_ACCESS_REMOTE_ATOMIC, &mr) !=
              IBV_WC_SUCCESS) {
        RespondError(IBV_WC_REM_ACCESS_ERR,
                     absl::StrFormat("atomic denied: rkey 0x%x addr 0x%x",
                                     h.rkey, h.addr));
        return;
      }
      uint64_t compare_add = wire::GetLe64(atomic_buf_);
      uint64_t swap = wire::GetLe64(atomic_buf_ + 8);
      auto* target = reinterpret_cast<uint64_t*>(h.addr);
      uint64_t orig;
      if (h.opcode == wire::kCmpSwap) {
        orig = compare_add;
        __atomic_compare_exchange_n(target, &orig, swap, false,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
      } else {
        orig = __atomic_fetch_add(target, compare_add, __ATOMIC_SEQ_CST);
      }
      ++expected_seq_;
      Ctrl c;
      c.op = wire::kAtomicResp;
      c.seq = h.seq;
      c.value = orig;
      QueueCtrl(std::move(c));
      return;
    }
    case RxKind::kReadResp:
    case RxKind::kAtomicResp: {
      uint64_t i = h.seq;
      uint8_t st = IBV_WC_SUCCESS;
      if (rx_kind_ == RxKind::kAtomicResp) {
        size_t j = (i % sq_cap_) * max_send_sge_;
        const ibv_sge& sge = sq_sge_[j];
        if (sq_mr_[j] && sq_mr_[j]->Usable()) {
          uint64_t v = wire::GetLe64(atomic_buf_);
          std::memcpy(reinterpret_cast<void*>(sge.addr), &v, 8);
        } else {
          st = IBV_WC_LOC_PROT_ERR;
        }
      } else if (rx_err_) {
        st = IBV_WC_LOC_PROT_ERR;
      }
      CompleteWqe(i, st);
      PublishTail();
      if (st != IBV_WC_SUCCESS) {
        EnterError(Cause::kFault,
                   "local buffer deregistered while a response landed in it");
      }
      Activate();
      return;
    }
  }
}

}  // namespace coverbs::transport::soft
