// Internals of the verbs provider, shared by its .cc files. Not a public API:
// include transport/verbs/verbs_provider.h instead.
#ifndef COVERBS_TRANSPORT_VERBS_INTERNAL_H_
#define COVERBS_TRANSPORT_VERBS_INTERNAL_H_

#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>
#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/provider.h"

namespace coverbs::transport::verbs_internal {

// ---------------------------------------------------------------- errors

// The errno behind a verbs return value: verbs return a positive errno, some
// providers (siw) a negative one, a few -1 with errno set.
int VerbsErrno(int ret, int saved_errno);

// A Status whose code follows `err` (absl::ErrnoToStatusCode) and whose
// message is "<what>: <strerror> (errno N)".
absl::Status ErrnoStatus(int err, std::string_view what);

std::string GidToString(const ibv_gid& gid);
bool GidIsZero(const ibv_gid& gid);
bool GidIsIpv4Mapped(const ibv_gid& gid);
std::string SockaddrToString(const sockaddr* sa);

// Prints to stderr; for failures in destructors, which cannot return them.
void LogError(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

class VerbsQp;

// ---------------------------------------------------------------- objects
// Each object holds shared ownership of what it depends on, so the verbs
// objects are destroyed children first whatever the order in which the C++
// wrappers go away.

// The opened device: a context from librdmacm's device list. The list is
// released (rdma_free_devices) last: it holds librdmacm's reference on the
// device. librdmacm never closes the context itself while it lives.
struct Device {
  ibv_context** list = nullptr;  // from rdma_get_devices
  ibv_context* ctx = nullptr;    // one of list[]
  std::string name;
  uint8_t port = 1;
  ibv_device_attr attr{};
  ibv_port_attr port_attr{};
  DeviceCaps caps;
  // RoCE: the chosen GID; its IPv4 address when IPv4-mapped; the ifindex of
  // its netdev (0 when unknown).
  ibv_gid gid{};
  std::optional<in_addr> gid_ipv4;
  uint32_t ndev_ifindex = 0;

  // Set once a connected QP's ibv_query_qp said RESET (siw before Linux
  // 6.x never fills in qp_state): from then on VerbsQp::state() answers from
  // what the provider saw (connected, SetError, error completions polled from
  // its CQs, QP async events).
  std::atomic<bool> qp_state_unreliable{false};
  // SoftiWARP (siw): WRs posted by user space to a QP already in error are
  // never flushed (the kernel flushes only at the transition to ERROR, and
  // only what was posted before). The provider completes them itself with
  // IBV_WC_WR_FLUSH_ERR once it knows the QP is in error.
  bool posts_after_error_unflushed = false;
  // Soft-RoCE (rxe) hands user space the kernel's ib_wc_flags unconverted:
  // a SEND_WITH_INV's receive carries IB_WC_WITH_INVALIDATE (1 << 2), which
  // libibverbs calls IBV_WC_IP_CSUM_OK, instead of IBV_WC_WITH_INV (1 << 3)
  // (seen on Linux 6.1, rdma-core 44; tests/transport/memory_window_test).
  // Poll translates it.
  bool wc_flags_kernel_encoded = false;
  // Poll notes failed completions (and GetAsyncEvent QP errors) in the QPs'
  // known state: needed when either of the above is set.
  bool TrackQpErrors() const {
    return posts_after_error_unflushed ||
           qp_state_unreliable.load(std::memory_order_relaxed);
  }
  std::mutex qps_mu;
  std::unordered_map<uint32_t, VerbsQp*> qps;  // live QPs by number
  // Marks the QPs of failed completions as in error.
  void NoteCompletions(const ibv_wc* wc, int n);
  void NoteQpError(uint32_t qp_num);

  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ~Device();
};

struct PdCore {
  std::shared_ptr<Device> dev;
  ibv_pd* pd = nullptr;
  ~PdCore();
};

struct CqCore {
  std::shared_ptr<Device> dev;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  // Channel events consumed (ibv_get_cq_event) and not yet acknowledged: acked
  // before ibv_destroy_cq, which otherwise waits for them forever.
  unsigned unacked = 0;
  // Flush completions made by the provider (see
  // Device::posts_after_error_unflushed), returned by Poll after the
  // device's own.
  std::mutex synthetic_mu;
  std::deque<ibv_wc> synthetic;
  std::atomic<size_t> synthetic_count{0};
  void AddSynthetic(const ibv_wc& wc);
  int TakeSynthetic(int n, ibv_wc* wc);
  ~CqCore();
};

struct SrqCore {
  std::shared_ptr<PdCore> pd;
  ibv_srq* srq = nullptr;
  ~SrqCore();
};

class VerbsPd : public ProviderPd {
 public:
  explicit VerbsPd(std::shared_ptr<PdCore> core) : core_(std::move(core)) {}
  absl::StatusOr<std::unique_ptr<ProviderMr>> RegisterMemory(
      void* addr, size_t length, int access) override;
  absl::StatusOr<std::unique_ptr<ProviderSrq>> CreateSrq(
      uint32_t max_wr, uint32_t max_sge) override;
  absl::StatusOr<std::unique_ptr<ProviderMw>> AllocMw() override;
  const std::shared_ptr<PdCore>& core() const { return core_; }

 private:
  std::shared_ptr<PdCore> core_;
};

// Device::wc_flags_kernel_encoded: IB_WC_WITH_INVALIDATE -> IBV_WC_WITH_INV.
inline void FixKernelWcFlags(ibv_wc* wc, int n) {
  constexpr unsigned kKernelWithInvalidate = 1u << 2;
  for (int i = 0; i < n; ++i) {
    if (wc[i].wc_flags & kKernelWithInvalidate) {
      wc[i].wc_flags =
          (wc[i].wc_flags & ~kKernelWithInvalidate) | IBV_WC_WITH_INV;
    }
  }
}

class VerbsCq : public ProviderCq {
 public:
  explicit VerbsCq(std::shared_ptr<CqCore> core) : core_(std::move(core)) {}
  int fd() const override { return core_->channel->fd; }
  int capacity() const override { return core_->cq->cqe; }
  int Poll(int n, ibv_wc* wc) override {
    int got = ibv_poll_cq(core_->cq, n, wc);
    if (got > 0 && core_->dev->wc_flags_kernel_encoded) {
      FixKernelWcFlags(wc, got);
    }
    if (got > 0 && core_->dev->TrackQpErrors()) {
      core_->dev->NoteCompletions(wc, got);
    }
    if (got >= 0 && got < n &&
        core_->synthetic_count.load(std::memory_order_acquire) != 0) {
      got += core_->TakeSynthetic(n - got, wc + got);
    }
    return got;
  }
  absl::Status RequestNotify() override;
  int GetEvents() override;
  void AckEvents(unsigned n) override;
  const std::shared_ptr<CqCore>& core() const { return core_; }

 private:
  std::shared_ptr<CqCore> core_;
};

class VerbsSrq : public ProviderSrq {
 public:
  explicit VerbsSrq(std::shared_ptr<SrqCore> core) : core_(std::move(core)) {}
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override;
  const std::shared_ptr<SrqCore>& core() const { return core_; }

 private:
  std::shared_ptr<SrqCore> core_;
};

class VerbsQp : public ProviderQp {
 public:
  // `id` non-null: the QP was created with rdma_create_qp on it and is
  // destroyed with rdma_destroy_qp; `keepalive` keeps `id` alive until then.
  VerbsQp(ibv_qp* qp, rdma_cm_id* id, const ibv_qp_cap& cap,
          std::shared_ptr<PdCore> pd, std::shared_ptr<CqCore> send_cq,
          std::shared_ptr<CqCore> recv_cq, std::shared_ptr<SrqCore> srq,
          std::shared_ptr<void> keepalive);
  ~VerbsQp() override;

  uint32_t qp_num() const override { return qp_->qp_num; }
  uint32_t max_send_wr() const override { return cap_.max_send_wr; }
  uint32_t max_recv_wr() const override { return cap_.max_recv_wr; }
  uint32_t max_inline_data() const override { return cap_.max_inline_data; }
  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad) override;
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override;
  absl::Status SetError() override;
  ibv_qp_state state() const override;

  ibv_qp* qp() const { return qp_; }
  Device& device() const { return *pd_->dev; }
  // What the provider knows of the state, for devices that do not report it.
  void set_known_state(ibv_qp_state s) {
    known_state_.store(s, std::memory_order_relaxed);
  }

 private:
  // Moves the QP to IBV_QPS_ERR (again): rxe flushes receives only at that
  // transition, not those posted while already in error.
  int ModifyToError();
  // Whether to complete posts locally with flush errors (siw, QP in error).
  bool FlushLocally() const {
    return pd_->dev->posts_after_error_unflushed &&
           known_state_.load(std::memory_order_relaxed) == IBV_QPS_ERR;
  }

  ibv_qp* qp_;
  rdma_cm_id* id_;
  ibv_qp_cap cap_;
  std::shared_ptr<PdCore> pd_;
  std::shared_ptr<CqCore> send_cq_;
  std::shared_ptr<CqCore> recv_cq_;
  std::shared_ptr<SrqCore> srq_;
  std::shared_ptr<void> keepalive_;
  // Set by SetError(): every later post re-issues the transition to ERR so
  // that what it posted is flushed on every device.
  bool reflush_ = false;
  std::atomic<ibv_qp_state> known_state_{IBV_QPS_INIT};
};

// ---------------------------------------------------------------- device.cc

// Opens the device, port and GID chosen by `options` (see verbs_provider.h)
// and fills in its caps.
absl::StatusOr<std::shared_ptr<Device>> OpenDevice(
    const ProviderOptions& options);

// The ibv_reg_mr failure as a Status; names RLIMIT_MEMLOCK when the locked
// memory limit is what most likely stopped it.
absl::Status RegMrError(int err, const Device& dev, void* addr, size_t length,
                        int access);

// ---------------------------------------------------------------- qp.cc

// rdma_create_qp on `id` with the objects of `init`; checks that they are
// verbs objects on id->verbs.
absl::StatusOr<std::unique_ptr<VerbsQp>> CreateCmQp(
    rdma_cm_id* id, ProviderPd* pd, const QpInit& init,
    std::shared_ptr<void> keepalive, std::string_view side);

// See FinishEstablishedQp in verbs_provider.h.
absl::Status FinishEstablished(VerbsQp& qp, const QpInit& init);

// ---------------------------------------------------------------- cm_pair.cc

struct PairAddresses {
  sockaddr_storage listen{};            // passive side a listens here
  std::optional<sockaddr_storage> src;  // active side b binds here (if set)
  std::string origin;                   // how the address was chosen
};

// The listen address for CreateConnectedPair on `dev`: $COVERBS_TEST_ADDR,
// else an IPv4 address that rdma_cm binds to `dev` (the RoCE GID's address
// first, then the addresses of its netdev, then every other address).
// $COVERBS_TEST_PEER_ADDR sets the active side's source address.
absl::StatusOr<PairAddresses> FindPairAddresses(const Device& dev);

// Connects a QP on pd_a (passive, accepts) with a QP on pd_b (active,
// connects) through rdma_cm on one event channel; bounded by `timeout_ms`.
absl::StatusOr<QpPair> ConnectPair(const PairAddresses& addrs, ProviderPd* pd_a,
                                   const QpInit& init_a, ProviderPd* pd_b,
                                   const QpInit& init_b, int timeout_ms);

}  // namespace coverbs::transport::verbs_internal

#endif  // COVERBS_TRANSPORT_VERBS_INTERNAL_H_
