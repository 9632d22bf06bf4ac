// Implementation details of QpCore shared by its .cc files: the sizes and
// limits more than one of them needs, and small opcode helpers. QpCore is
// defined across qp_core.cc (life cycle, error state), qp_post.cc
// (application side), qp_rx.cc and qp_rx_frames.cc (receive), qp_tx.cc
// (transmit, send-queue completions) and qp_timers.cc (timers). A private
// header of //transport/soft (listed in srcs): nothing outside the soft
// provider includes it.
#ifndef COVERBS_TRANSPORT_SOFT_QP_INTERNAL_H_
#define COVERBS_TRANSPORT_SOFT_QP_INTERNAL_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>

namespace coverbs::transport::soft {

inline constexpr size_t kRbufSize = 64 * 1024;  // receive staging buffer
// Transmit arena: frame headers and inline data.
inline constexpr size_t kArenaSize = 32 * 1024;
inline constexpr size_t kMaxSegs = 256;  // iovecs per sendmsg
inline constexpr uint64_t kMaxMessage = 1ULL << 31;
// A payload with more than this left is received by the progress thread
// even on a reactor-received QP (StartBulkRx): on loopback it then copies
// out what it just sent while that is in cache, and on the other core
// than the reactor (1 MiB soft send_bw was ~0.55x with the reactor
// copying).
inline constexpr size_t kInlineBulk = 256 * 1024;
// Small frames in a row after which such a QP goes back to the reactor.
inline constexpr uint32_t kBulkExitFrames = 16;

// Responses and acknowledgements a responder may owe before it stops
// taking requests. A peer that honours max_qp_rd_atom (128) is owed at most
// 128 READ / atomic responses with an ACK between each two, and one NAK or
// RNR NAK; more means it sends requests without reading what it is owed,
// and each would cost memory here (the queue grows): a protocol error.
inline constexpr size_t kMaxCtrlBacklog = 4 * 128;

inline bool IsAtomic(uint8_t op) {
  return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

inline const char* WcStatusName(uint8_t s) {
  return ibv_wc_status_str(static_cast<ibv_wc_status>(s));
}

}  // namespace coverbs::transport::soft

#endif  // COVERBS_TRANSPORT_SOFT_QP_INTERNAL_H_
