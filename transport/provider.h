// The provider interface: what an RDMA device offers to coverbs.
//
// Three implementations exist, chosen at run time (transport/select.h):
//  - verbs (transport/verbs): a thin pass-through to libibverbs/librdmacm;
//  - soft  (transport/soft): a software RNIC with RC semantics over TCP;
//  - loop  (transport/loop): both ends in one process, every work request
//    executed at once by a memcpy (no wire): the framework's own ceiling.
//
// The interface deliberately mirrors ibverbs and uses its plain structs
// (ibv_send_wr, ibv_recv_wr, ibv_sge, ibv_wc, IBV_* enums) so the verbs
// provider adds nothing on the data path and the soft provider has an exact
// specification to follow. Everything above (awaitables, the completion
// reactor, the conformance suite) is written once against this interface.
//
// Threading: provider objects are used from one reactor thread at a time,
// except where noted. A provider may run its own progress thread (soft does).
//
// Semantics every provider must honour (the conformance suite checks them):
//  - RC ordering; a send/write completion means the peer placed the data.
//  - wr_id is opaque and returned unchanged in the matching ibv_wc.
//  - Unsignaled send WRs (no IBV_SEND_SIGNALED, sq_sig_all false) produce no
//    completion on success, but do produce one with an error status on failure
//    or flush.
//  - A QP in the error state completes every outstanding WR (send and recv)
//    with IBV_WC_WR_FLUSH_ERR, in posting order per queue; WRs posted to a QP
//    in error are completed with IBV_WC_WR_FLUSH_ERR as well.
//  - Posting more WRs than the queue depth fails with ENOMEM (as verbs).
#ifndef COVERBS_TRANSPORT_PROVIDER_H_
#define COVERBS_TRANSPORT_PROVIDER_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace coverbs::transport {

enum class TransportKind {
  kInfiniBand,  // IB link layer
  kRoCE,        // IB transport over Ethernet (rxe, mlx5 RoCE)
  kIWarp,       // iWARP (siw, ...): no immediate data, active side sends first
  kSoft,        // coverbs' software RNIC over TCP
  kLoop,        // in-process, no wire (transport/loop)
};
const char* TransportKindName(TransportKind k);
// Name of a work request opcode ("SEND", "RDMA_WRITE", ...).
const char* WrOpcodeName(ibv_wr_opcode op);
// The completion opcode (ibv_wc.opcode) a send work request of opcode `op`
// completes with: IBV_WC_RDMA_WRITE for both WRITEs, IBV_WC_SEND for both
// SENDs and any opcode without a completion opcode of its own. For
// providers that build completions themselves.
ibv_wc_opcode WcOpcode(ibv_wr_opcode op);

// What the device can do. Upper layers check these instead of assuming IB.
struct DeviceCaps {
  std::string provider;      // "verbs", "soft" or "loop"
  std::string device_name;   // e.g. "rxe0", "siw0", "soft0", "loop"
  TransportKind transport = TransportKind::kSoft;
  uint8_t port = 1;
  int gid_index = -1;        // RoCE: the GID used; -1 when not applicable
  uint32_t max_qp_wr = 0;
  uint32_t max_sge = 0;
  uint32_t max_sge_rd = 0;      // SGEs per RDMA READ (siw: 1); 0 = max_sge
  uint32_t max_cqe = 0;
  uint32_t max_inline_data = 0;
  uint32_t max_srq_wr = 0;
  uint64_t max_mr_size = 0;
  uint32_t max_qp_rd_atom = 0;  // outstanding READ/atomics per QP
  bool atomics = false;         // compare-and-swap, fetch-and-add
  bool write_with_imm = false;  // RDMA_WRITE_WITH_IMM
  bool send_with_imm = false;   // SEND_WITH_IMM
  // iWARP: the active (connecting) side must send the first message.
  bool active_side_sends_first = false;
  // Whether an RDMA READ of a region registered without
  // IBV_ACCESS_REMOTE_READ fails (REM_ACCESS_ERR). siw (Linux 6.1) does not
  // check it and returns the data: on siw, exposing a region lets the peer
  // read it whatever the access flags say (a provider defect).
  bool enforces_remote_read = true;
  // Type-2 memory windows (ProviderPd::AllocMw, IBV_WR_BIND_MW posted on
  // the send queue): a window over part of a region registered with
  // IBV_ACCESS_MW_BIND gets a fresh, unpredictable rkey per bind, usable
  // through the QP it was bound on and no other, and ends when the peer's
  // SEND_WITH_INV (or a LOCAL_INV) names it. soft and rxe have them; siw
  // does not.
  bool memory_windows = false;
  // SEND_WITH_INV: a send that invalidates an rkey of the receiver.
  bool send_with_invalidate = false;
};

// A registered memory region. The buffer is owned by the caller and must
// outlive the region.
class ProviderMr {
 public:
  virtual ~ProviderMr() = default;  // deregisters
  virtual void* addr() const = 0;
  virtual size_t length() const = 0;
  virtual uint32_t lkey() const = 0;
  virtual uint32_t rkey() const = 0;
  virtual int access() const = 0;  // IBV_ACCESS_* flags as registered
};

// A type-2 memory window (DeviceCaps::memory_windows). Unbound when
// allocated; bound by an IBV_WR_BIND_MW work request that PrepareBind fills
// in, posted on a QP's send queue; the bind lasts until the peer's
// SEND_WITH_INV (or a LOCAL_INV) names its rkey, after which it may be
// bound again with the next rkey. Destroying it invalidates it.
class ProviderMw {
 public:
  virtual ~ProviderMw() = default;  // deallocates
  // The rkey of the last bind prepared (before any: the allocated one; 0
  // on soft).
  virtual uint32_t rkey() const = 0;
  // Fills `wr` (opcode, window, region, range, access) to bind this window
  // to [addr, addr+length) of `mr` -- a region of the same provider and PD
  // registered with IBV_ACCESS_MW_BIND -- with the next rkey, and returns
  // that rkey. The caller posts `wr`; the window's rkey is valid once the
  // send queue executed it, i.e. for the peer from any later WR of the QP.
  virtual uint32_t PrepareBind(ibv_send_wr& wr, const ProviderMr& mr,
                               uint64_t addr, size_t length, int access) = 0;
};

// A completion queue with a completion channel.
//
// Completion-channel mechanics, identical for both providers:
//  - fd() becomes readable when a completion arrived on an armed CQ;
//  - RequestNotify() arms the CQ for the next completion (one-shot);
//  - GetEvents() consumes pending channel events without blocking (fd is
//    non-blocking) and returns how many it consumed; each must be
//    acknowledged with AckEvents before the CQ is destroyed.
class ProviderCq {
 public:
  virtual ~ProviderCq() = default;  // acks nothing: callers ack first
  virtual int fd() const = 0;
  virtual int capacity() const = 0;
  // Like ibv_poll_cq: returns the number of completions written to wc (<= n),
  // or a negative errno.
  virtual int Poll(int n, ibv_wc* wc) = 0;
  virtual absl::Status RequestNotify() = 0;
  virtual int GetEvents() = 0;
  virtual void AckEvents(unsigned n) = 0;
  // Called in pairs by the reactor that polls this CQ, on its thread, around
  // each loop iteration (core's Poller::BeginIteration / EndIteration). A
  // provider may hold back the transmission of work posted from this thread
  // in between, and must have handed it on when EndBatch returns (the soft
  // provider sends the frames of one iteration in one TCP write). Hardware
  // providers have nothing to hold back.
  virtual void BeginBatch() {}
  virtual void EndBatch() {}
};

class ProviderSrq {
 public:
  virtual ~ProviderSrq() = default;
  virtual absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) = 0;
};

struct QpInit {
  ProviderCq* send_cq = nullptr;
  ProviderCq* recv_cq = nullptr;
  ProviderSrq* srq = nullptr;  // optional
  uint32_t max_send_wr = 128;
  uint32_t max_recv_wr = 128;
  uint32_t max_send_sge = 4;
  uint32_t max_recv_sge = 4;
  uint32_t max_inline_data = 0;
  bool sq_sig_all = false;
  // RNR behaviour of the requester (as ibv_qp_attr.rnr_retry / min_rnr_timer).
  uint8_t rnr_retry = 7;     // 7 = infinite
  uint8_t min_rnr_timer = 12;  // IB encoding; 12 = 0.64 ms
  uint8_t retry_cnt = 7;
  uint8_t timeout = 14;        // local ACK timeout, IB encoding
};

// An RC queue pair. Created by a connector (test pair factory, cm layer) in
// the connected (RTS) state.
class ProviderQp {
 public:
  virtual ~ProviderQp() = default;  // destroys the QP; callers drain first
  virtual uint32_t qp_num() const = 0;
  // Actual capacities after creation (may exceed what was asked).
  virtual uint32_t max_send_wr() const = 0;
  virtual uint32_t max_recv_wr() const = 0;
  virtual uint32_t max_inline_data() const = 0;
  // Like ibv_post_send / ibv_post_recv; errors name the QP and the reason.
  virtual absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad) = 0;
  virtual absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) = 0;
  // Moves the QP to IBV_QPS_ERR: every outstanding WR is flushed.
  virtual absl::Status SetError() = 0;
  virtual ibv_qp_state state() const = 0;
};

class ProviderPd {
 public:
  virtual ~ProviderPd() = default;
  // Registers [addr, addr+length) with IBV_ACCESS_* flags. Fails with
  // ResourceExhausted naming RLIMIT_MEMLOCK when the locked-memory limit is
  // what stopped it.
  virtual absl::StatusOr<std::unique_ptr<ProviderMr>> RegisterMemory(
      void* addr, size_t length, int access) = 0;
  virtual absl::StatusOr<std::unique_ptr<ProviderSrq>> CreateSrq(
      uint32_t max_wr, uint32_t max_sge) = 0;
  // A type-2 memory window; Unimplemented where caps().memory_windows is
  // false.
  virtual absl::StatusOr<std::unique_ptr<ProviderMw>> AllocMw() {
    return absl::UnimplementedError("memory windows are not supported");
  }
};

// Asynchronous device/QP events (ibv_get_async_event), already decoded.
struct AsyncEvent {
  ibv_event_type type;
  uint32_t qp_num = 0;  // for QP events
  std::string description;
};

// Creates a connected RC QP pair on one provider, for tests and benchmarks
// that do not go through the cm layer. Both QPs belong to `pd_a` / `pd_b`
// (which may be the same PD). The soft provider connects them over a real
// loopback TCP connection; the verbs provider uses rdma_cm on the address in
// COVERBS_TEST_ADDR (default: the first address of the device's netdev), which
// also works on iWARP.
struct QpPair {
  // Provider-specific connection state that must outlive the QPs (cm ids):
  // declared first so that it is destroyed last.
  std::shared_ptr<void> keepalive;
  std::unique_ptr<ProviderQp> a;
  std::unique_ptr<ProviderQp> b;
};

class Provider {
 public:
  virtual ~Provider() = default;
  virtual const DeviceCaps& caps() const = 0;
  virtual absl::StatusOr<std::unique_ptr<ProviderPd>> AllocPd() = 0;
  virtual absl::StatusOr<std::unique_ptr<ProviderCq>> CreateCq(int cqe) = 0;
  // fd readable when AsyncEvent is pending; -1 if the provider has none.
  virtual int async_fd() const = 0;
  // Non-blocking; NotFound when nothing is pending.
  virtual absl::StatusOr<AsyncEvent> GetAsyncEvent() = 0;
  // See QpPair. Blocking (it is for tests and benchmark setup); bounded by a
  // timeout so that it never hangs.
  virtual absl::StatusOr<QpPair> CreateConnectedPair(ProviderPd* pd_a,
                                                     const QpInit& init_a,
                                                     ProviderPd* pd_b,
                                                     const QpInit& init_b) = 0;
};

// Which provider to open.
enum class ProviderKind {
  kDefault,  // COVERBS_PROVIDER from the environment, else kAuto
  kAuto,     // verbs if ibv_get_device_list finds a device, else soft
  kVerbs,    // rdma-core: a real NIC, Soft-RoCE (rxe) or SoftiWARP (siw)
  kSoft,     // the software RNIC over TCP
  kLoop,     // in-process, both ends in this process (never chosen by kAuto)
};
// "auto", "verbs", "soft" or "loop", as flags and COVERBS_PROVIDER spell
// them (InvalidArgument naming the four otherwise); "" is kDefault.
absl::StatusOr<ProviderKind> ParseProviderKind(std::string_view name);
std::string_view ProviderKindName(ProviderKind kind);

struct ProviderOptions {
  ProviderKind kind = ProviderKind::kDefault;
  // verbs: device name (e.g. "rxe0"); empty = first device with an active
  // port. Empty: COVERBS_DEVICE from the environment.
  std::string device;
  uint8_t port = 0;     // 0 = first active port
  int gid_index = -1;   // -1 = prefer a RoCEv2 IPv4-mapped GID
};

// Opens the provider chosen by `options` and logs the choice once per process.
absl::StatusOr<std::unique_ptr<Provider>> OpenProvider(
    const ProviderOptions& options = {});

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_PROVIDER_H_
