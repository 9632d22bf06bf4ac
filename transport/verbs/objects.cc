// PD, MR, CQ, SRQ and QP wrappers of the verbs provider, and error helpers.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <sys/random.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "transport/provider.h"
#include "transport/verbs/internal.h"

namespace coverbs::transport::verbs_internal {

// ---------------------------------------------------------------- errors

int VerbsErrno(int ret, int saved_errno) {
  if (ret == -1 && saved_errno > 0) return saved_errno;
  if (ret < 0) return -ret;
  return ret;
}

absl::Status ErrnoStatus(int err, std::string_view what) {
  return absl::Status(
      absl::ErrnoToStatusCode(err),
      absl::StrFormat("%s: %s (errno %d)", what, std::strerror(err), err));
}

std::string GidToString(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.raw, buf, sizeof(buf));
  return buf;
}

bool GidIsZero(const ibv_gid& gid) {
  for (uint8_t b : gid.raw) {
    if (b != 0) return false;
  }
  return true;
}

bool GidIsIpv4Mapped(const ibv_gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid.raw[i] != 0) return false;
  }
  return gid.raw[10] == 0xff && gid.raw[11] == 0xff;
}

std::string SockaddrToString(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa == nullptr) return "(none)";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    return ntohs(in->sin_port) != 0
               ? absl::StrFormat("%s:%d", buf, ntohs(in->sin_port))
               : std::string(buf);
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    return ntohs(in6->sin6_port) != 0
               ? absl::StrFormat("[%s]:%d", buf, ntohs(in6->sin6_port))
               : std::string(buf);
  }
  return absl::StrFormat("(address family %d)", sa->sa_family);
}

void LogError(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  Log(LogLevel::kError, "verbs", buf, __FILE__, __LINE__);
}

// ---------------------------------------------------------------- cores

void Device::NoteCompletions(const ibv_wc* wc, int n) {
  for (int i = 0; i < n; ++i) {
    if (wc[i].status != IBV_WC_SUCCESS) NoteQpError(wc[i].qp_num);
  }
}

void Device::NoteQpError(uint32_t qp_num) {
  std::lock_guard<std::mutex> lock(qps_mu);
  if (auto it = qps.find(qp_num); it != qps.end()) {
    it->second->set_known_state(IBV_QPS_ERR);
  }
}

Device::~Device() {
  // Everything created on ctx is gone (it all holds a reference to us).
  if (list != nullptr) rdma_free_devices(list);
}

PdCore::~PdCore() {
  if (pd == nullptr) return;
  if (int ret = ibv_dealloc_pd(pd); ret != 0) {
    LogError("ibv_dealloc_pd on %s failed: %s", dev->name.c_str(),
             std::strerror(VerbsErrno(ret, errno)));
  }
}

CqCore::~CqCore() {
  if (cq != nullptr) {
    // The owner should have acked every event it consumed; if not, ack the
    // rest here: ibv_destroy_cq waits until all consumed events are acked.
    if (unacked != 0) ibv_ack_cq_events(cq, unacked);
    if (int ret = ibv_destroy_cq(cq); ret != 0) {
      LogError("ibv_destroy_cq on %s failed: %s", dev->name.c_str(),
               std::strerror(VerbsErrno(ret, errno)));
    }
  }
  if (channel != nullptr) {
    if (int ret = ibv_destroy_comp_channel(channel); ret != 0) {
      LogError("ibv_destroy_comp_channel on %s failed: %s", dev->name.c_str(),
               std::strerror(VerbsErrno(ret, errno)));
    }
  }
}

void CqCore::AddSynthetic(const ibv_wc& wc) {
  std::lock_guard<std::mutex> lock(synthetic_mu);
  synthetic.push_back(wc);
  synthetic_count.store(synthetic.size(), std::memory_order_release);
}

int CqCore::TakeSynthetic(int n, ibv_wc* wc) {
  std::lock_guard<std::mutex> lock(synthetic_mu);
  int taken = 0;
  while (taken < n && !synthetic.empty()) {
    wc[taken++] = synthetic.front();
    synthetic.pop_front();
  }
  synthetic_count.store(synthetic.size(), std::memory_order_release);
  return taken;
}

SrqCore::~SrqCore() {
  if (srq == nullptr) return;
  if (int ret = ibv_destroy_srq(srq); ret != 0) {
    LogError("ibv_destroy_srq on %s failed: %s", pd->dev->name.c_str(),
             std::strerror(VerbsErrno(ret, errno)));
  }
}

// ---------------------------------------------------------------- MR

namespace {

class VerbsMr : public ProviderMr {
 public:
  VerbsMr(std::shared_ptr<PdCore> pd, ibv_mr* mr, int access)
      : pd_(std::move(pd)), mr_(mr), access_(access) {}
  ~VerbsMr() override {
    if (int ret = ibv_dereg_mr(mr_); ret != 0) {
      LogError("ibv_dereg_mr (lkey 0x%x) on %s failed: %s", mr_->lkey,
               pd_->dev->name.c_str(), std::strerror(VerbsErrno(ret, errno)));
    }
  }
  void* addr() const override { return mr_->addr; }
  size_t length() const override { return mr_->length; }
  uint32_t lkey() const override { return mr_->lkey; }
  uint32_t rkey() const override { return mr_->rkey; }
  int access() const override { return access_; }
  ibv_mr* raw() const { return mr_; }

 private:
  std::shared_ptr<PdCore> pd_;
  ibv_mr* mr_;
  int access_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProviderMr>> VerbsPd::RegisterMemory(
    void* addr, size_t length, int access) {
  // Verbs (and iWARP in particular) require LOCAL_WRITE with REMOTE_WRITE or
  // REMOTE_ATOMIC; ibv_reg_mr fails with EINVAL otherwise. Add it.
  if (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) {
    access |= IBV_ACCESS_LOCAL_WRITE;
  }
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(core_->pd, addr, length, access);
  if (mr == nullptr) {
    int err = errno != 0 ? errno : EINVAL;
    return RegMrError(err, *core_->dev, addr, length, access);
  }
  return std::make_unique<VerbsMr>(core_, mr, access);
}

// ---------------------------------------------------------------- MW

namespace {

// A key byte for a window's next bind, unpredictable to a peer and never
// the current one. Why not ibv_inc_rkey: it counts, so from one rkey a peer
// knows every later bind's. Bytes come from getrandom(2), 64 at a time
// per thread (binds are on the landing path).
uint8_t NextKeyByte(uint8_t current) {
  thread_local uint8_t pool[64];
  thread_local size_t left = 0;
  for (;;) {
    if (left == 0) {
      size_t got = 0;
      while (got < sizeof(pool)) {
        ssize_t r = getrandom(pool + got, sizeof(pool) - got, 0);
        if (r > 0) {
          got += static_cast<size_t>(r);
        } else if (r < 0 && errno != EINTR) {
          // No random source (getrandom blocked by a seccomp policy): a
          // counter is all that is left; say so once.
          static bool logged = [] {
            LogError(
                "getrandom failed (%s): memory-window key bytes are "
                "sequential",
                std::strerror(errno));
            return true;
          }();
          (void)logged;
          return static_cast<uint8_t>(current + 1);
        }
      }
      left = sizeof(pool);
    }
    uint8_t b = pool[--left];
    if (b != current) return b;
  }
}

class VerbsMw : public ProviderMw {
 public:
  VerbsMw(std::shared_ptr<PdCore> pd, ibv_mw* mw)
      : pd_(std::move(pd)), mw_(mw), rkey_(mw->rkey) {}
  ~VerbsMw() override {
    if (int ret = ibv_dealloc_mw(mw_); ret != 0) {
      LogError("ibv_dealloc_mw (rkey 0x%x) on %s failed: %s", rkey_,
               pd_->dev->name.c_str(), std::strerror(VerbsErrno(ret, errno)));
    }
  }
  uint32_t rkey() const override { return rkey_; }
  uint32_t PrepareBind(ibv_send_wr& wr, const ProviderMr& mr, uint64_t addr,
                       size_t length, int access) override {
    // rxe finds the window by the rkey in ibv_mw when the WR is posted and
    // refuses the bind unless it is the window's current one (the last
    // bind's, which has executed by now: a window is bound again only after
    // the peer invalidated it); the new rkey keeps the index (upper 24
    // bits) and takes a fresh random key byte (ibv_inc_rkey's rule, with a
    // random step), so that an rkey a peer kept from an earlier bind no
    // longer matches and the next one cannot be told from this one.
    mw_->rkey = rkey_;
    rkey_ = (rkey_ & 0xffffff00U) | NextKeyByte(static_cast<uint8_t>(rkey_));
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = mw_;
    wr.bind_mw.rkey = rkey_;
    wr.bind_mw.bind_info.mr = static_cast<const VerbsMr&>(mr).raw();
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned>(access);
    return rkey_;
  }

 private:
  std::shared_ptr<PdCore> pd_;
  ibv_mw* mw_;
  uint32_t rkey_;  // of the last bind prepared
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProviderMw>> VerbsPd::AllocMw() {
  errno = 0;
  ibv_mw* mw = ibv_alloc_mw(core_->pd, IBV_MW_TYPE_2);
  if (mw == nullptr) {
    const int err = errno != 0 ? errno : EOPNOTSUPP;
    return ErrnoStatus(err, absl::StrFormat("ibv_alloc_mw (type 2) on %s",
                                            core_->dev->name));
  }
  return std::make_unique<VerbsMw>(core_, mw);
}

// ---------------------------------------------------------------- SRQ

absl::StatusOr<std::unique_ptr<ProviderSrq>> VerbsPd::CreateSrq(
    uint32_t max_wr, uint32_t max_sge) {
  ibv_srq_init_attr attr{};
  attr.attr.max_wr = max_wr;
  attr.attr.max_sge = max_sge;
  errno = 0;
  ibv_srq* srq = ibv_create_srq(core_->pd, &attr);
  if (srq == nullptr) {
    const int err = errno != 0 ? errno : EINVAL;
    const Device& dev = *core_->dev;
    return ErrnoStatus(
        err,
        absl::StrFormat("ibv_create_srq(max_wr=%u, max_sge=%u) on %s (device "
                        "max_srq_wr=%d, max_srq_sge=%d)",
                        max_wr, max_sge, dev.name, dev.attr.max_srq_wr,
                        dev.attr.max_srq_sge));
  }
  auto core = std::make_shared<SrqCore>();
  core->pd = core_;
  core->srq = srq;
  return std::make_unique<VerbsSrq>(std::move(core));
}

absl::Status VerbsSrq::PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  ibv_recv_wr* local_bad = nullptr;
  if (bad == nullptr) bad = &local_bad;
  errno = 0;
  int ret = ibv_post_srq_recv(core_->srq, wr, bad);
  if (ret == 0) return absl::OkStatus();
  int err = VerbsErrno(ret, errno);
  int index = 0;
  for (ibv_recv_wr* w = wr; w != nullptr && w != *bad; w = w->next) ++index;
  return ErrnoStatus(
      err, absl::StrFormat("ibv_post_srq_recv on SRQ (handle %u, %s) failed "
                           "at WR #%d (wr_id 0x%x)",
                           core_->srq->handle, core_->pd->dev->name, index,
                           *bad != nullptr ? (*bad)->wr_id : 0));
}

// ---------------------------------------------------------------- CQ

absl::Status VerbsCq::RequestNotify() {
  errno = 0;
  int ret = ibv_req_notify_cq(core_->cq, 0);
  if (ret == 0) return absl::OkStatus();
  const int err = VerbsErrno(ret, errno);
  return ErrnoStatus(
      err, absl::StrFormat("ibv_req_notify_cq on %s", core_->dev->name));
}

int VerbsCq::GetEvents() {
  int n = 0;
  for (;;) {
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    // The channel fd is non-blocking: EAGAIN ends the loop.
    if (ibv_get_cq_event(core_->channel, &cq, &cq_context) != 0) break;
    ++n;
    ++core_->unacked;
  }
  return n;
}

void VerbsCq::AckEvents(unsigned n) {
  // Acking more than was consumed would make ibv_destroy_cq wait forever.
  if (n > core_->unacked) n = core_->unacked;
  if (n == 0) return;
  ibv_ack_cq_events(core_->cq, n);
  core_->unacked -= n;
}

// ---------------------------------------------------------------- QP

VerbsQp::VerbsQp(ibv_qp* qp, rdma_cm_id* id, const ibv_qp_cap& cap,
                 std::shared_ptr<PdCore> pd, std::shared_ptr<CqCore> send_cq,
                 std::shared_ptr<CqCore> recv_cq, std::shared_ptr<SrqCore> srq,
                 std::shared_ptr<void> keepalive)
    : qp_(qp),
      id_(id),
      cap_(cap),
      pd_(std::move(pd)),
      send_cq_(std::move(send_cq)),
      recv_cq_(std::move(recv_cq)),
      srq_(std::move(srq)),
      keepalive_(std::move(keepalive)) {
  Device& dev = *pd_->dev;
  std::lock_guard<std::mutex> lock(dev.qps_mu);
  dev.qps[qp_->qp_num] = this;
}

VerbsQp::~VerbsQp() {
  {
    Device& dev = *pd_->dev;
    std::lock_guard<std::mutex> lock(dev.qps_mu);
    dev.qps.erase(qp_->qp_num);
  }
  if (id_ != nullptr) {
    rdma_destroy_qp(id_);  // ibv_destroy_qp + clears id->qp
  } else if (int ret = ibv_destroy_qp(qp_); ret != 0) {
    LogError("ibv_destroy_qp (QP 0x%x) on %s failed: %s", qp_->qp_num,
             pd_->dev->name.c_str(), std::strerror(VerbsErrno(ret, errno)));
  }
  // Members release the CQs, SRQ, PD and the cm ids after the QP is gone.
}

namespace {

ibv_wc FlushWc(uint64_t wr_id, ibv_wc_opcode opcode, uint32_t qp_num) {
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.status = IBV_WC_WR_FLUSH_ERR;
  wc.opcode = opcode;
  wc.qp_num = qp_num;
  return wc;
}

}  // namespace

absl::Status VerbsQp::PostSend(ibv_send_wr* wr, ibv_send_wr** bad) {
  ibv_send_wr* local_bad = nullptr;
  if (bad == nullptr) bad = &local_bad;
  if (FlushLocally()) [[unlikely]] {
    // Every WR completes, signaled or not, as a flushed WR does.
    for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
      send_cq_->AddSynthetic(
          FlushWc(w->wr_id, WcOpcode(w->opcode), qp_->qp_num));
    }
    return absl::OkStatus();
  }
  errno = 0;
  int ret = ibv_post_send(qp_, wr, bad);
  if (ret == 0) {
    if (reflush_) ModifyToError();
    return absl::OkStatus();
  }
  int err = VerbsErrno(ret, errno);
  const ibv_send_wr* failed = *bad != nullptr ? *bad : wr;
  int index = 0;
  for (ibv_send_wr* w = wr; w != nullptr && w != failed; w = w->next) ++index;
  const Device& dev = *pd_->dev;
  std::string hint;
  if (failed != nullptr &&
      (failed->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
       failed->opcode == IBV_WR_SEND_WITH_IMM) &&
      dev.caps.transport == TransportKind::kIWarp) {
    hint =
        "; iWARP has no immediate data (DeviceCaps::write_with_imm and "
        "send_with_imm are false)";
  } else if (failed != nullptr &&
             (failed->opcode == IBV_WR_ATOMIC_CMP_AND_SWP ||
              failed->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) &&
             !dev.caps.atomics) {
    hint = "; the device has no atomics (DeviceCaps::atomics is false)";
  } else if (err == ENOMEM) {
    hint = absl::StrFormat("; send queue full (created with max_send_wr %u)",
                           cap_.max_send_wr);
  } else if (failed != nullptr && (failed->send_flags & IBV_SEND_INLINE)) {
    hint = absl::StrFormat("; inline limit of this QP is %u bytes",
                           cap_.max_inline_data);
  }
  return ErrnoStatus(
      err,
      absl::StrFormat("ibv_post_send on QP 0x%x (%s) failed at WR #%d (%s, "
                      "wr_id 0x%x)%s",
                      qp_->qp_num, dev.name, index,
                      failed != nullptr ? WrOpcodeName(failed->opcode) : "?",
                      failed != nullptr ? failed->wr_id : 0, hint));
}

absl::Status VerbsQp::PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) {
  ibv_recv_wr* local_bad = nullptr;
  if (bad == nullptr) bad = &local_bad;
  if (srq_ == nullptr && FlushLocally()) [[unlikely]] {
    for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
      recv_cq_->AddSynthetic(FlushWc(w->wr_id, IBV_WC_RECV, qp_->qp_num));
    }
    return absl::OkStatus();
  }
  errno = 0;
  int ret = ibv_post_recv(qp_, wr, bad);
  if (ret == 0) {
    if (reflush_) ModifyToError();
    return absl::OkStatus();
  }
  int err = VerbsErrno(ret, errno);
  const ibv_recv_wr* failed = *bad != nullptr ? *bad : wr;
  int index = 0;
  for (ibv_recv_wr* w = wr; w != nullptr && w != failed; w = w->next) ++index;
  std::string hint;
  if (srq_ != nullptr) {
    hint = "; this QP uses an SRQ: post receives to the SRQ";
  } else if (err == ENOMEM) {
    hint = absl::StrFormat("; receive queue full (created with max_recv_wr %u)",
                           cap_.max_recv_wr);
  }
  return ErrnoStatus(
      err, absl::StrFormat(
               "ibv_post_recv on QP 0x%x (%s) failed at WR #%d (RECV, wr_id "
               "0x%x)%s",
               qp_->qp_num, pd_->dev->name, index,
               failed != nullptr ? failed->wr_id : 0, hint));
}

int VerbsQp::ModifyToError() {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  errno = 0;
  int ret = ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
  return ret == 0 ? 0 : VerbsErrno(ret, errno);
}

absl::Status VerbsQp::SetError() {
  int err = ModifyToError();
  if (err == 0) {
    reflush_ = true;
    set_known_state(IBV_QPS_ERR);
    return absl::OkStatus();
  }
  return ErrnoStatus(
      err, absl::StrFormat("ibv_modify_qp(IBV_QPS_ERR) on QP 0x%x (%s)",
                           qp_->qp_num, pd_->dev->name));
}

ibv_qp_state VerbsQp::state() const {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  const ibv_qp_state known = known_state_.load(std::memory_order_relaxed);
  if (ibv_query_qp(qp_, &attr, IBV_QP_STATE, &init) != 0) {
    return pd_->dev->qp_state_unreliable ? known : IBV_QPS_UNKNOWN;
  }
  if (attr.qp_state == IBV_QPS_RESET && pd_->dev->qp_state_unreliable) {
    return known;
  }
  return attr.qp_state;
}

absl::Status FinishEstablished(VerbsQp& qp, const QpInit& init) {
  qp.set_known_state(IBV_QPS_RTS);
  {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init_attr{};
    if (ibv_query_qp(qp.qp(), &attr, IBV_QP_STATE, &init_attr) == 0 &&
        attr.qp_state == IBV_QPS_RESET) {
      qp.device().qp_state_unreliable = true;  // connected, yet "RESET"
    }
  }
  if (qp.device().caps.transport == TransportKind::kIWarp) {
    return absl::OkStatus();  // TCP below: no RNR NAKs
  }
  const uint8_t min_rnr_timer = init.min_rnr_timer;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.min_rnr_timer = min_rnr_timer;
  errno = 0;
  int ret = ibv_modify_qp(qp.qp(), &attr, IBV_QP_STATE | IBV_QP_MIN_RNR_TIMER);
  if (ret == 0) return absl::OkStatus();
  const int err = VerbsErrno(ret, errno);
  return ErrnoStatus(
      err,
      absl::StrFormat("ibv_modify_qp(RTS->RTS, min_rnr_timer=%u) on QP 0x%x "
                      "(%s)",
                      min_rnr_timer, qp.qp_num(), qp.device().name));
}

absl::StatusOr<std::unique_ptr<VerbsQp>> CreateCmQp(
    rdma_cm_id* id, ProviderPd* pd, const QpInit& init,
    std::shared_ptr<void> keepalive, std::string_view side) {
  auto* vpd = dynamic_cast<VerbsPd*>(pd);
  auto* send_cq = dynamic_cast<VerbsCq*>(init.send_cq);
  auto* recv_cq = dynamic_cast<VerbsCq*>(init.recv_cq);
  auto* srq = init.srq != nullptr ? dynamic_cast<VerbsSrq*>(init.srq) : nullptr;
  if (vpd == nullptr || send_cq == nullptr || recv_cq == nullptr ||
      (init.srq != nullptr && srq == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "QP %s: the PD, send_cq, recv_cq (and srq) must be objects of the "
        "verbs provider, non-null",
        side));
  }
  const Device& dev = *vpd->core()->dev;
  if (id->verbs != dev.ctx || send_cq->core()->dev->ctx != dev.ctx ||
      recv_cq->core()->dev->ctx != dev.ctx ||
      (srq != nullptr && srq->core()->pd->dev->ctx != dev.ctx)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "QP %s: the rdma_cm id is on device %s but the PD is on %s, send_cq on "
        "%s, recv_cq on %s%s: all must be on the id's device (open a provider "
        "on that device)",
        side,
        id->verbs != nullptr ? ibv_get_device_name(id->verbs->device)
                             : "(none)",
        dev.name, send_cq->core()->dev->name, recv_cq->core()->dev->name,
        srq != nullptr ? ", srq on " + srq->core()->pd->dev->name : ""));
  }
  ibv_qp_init_attr attr{};
  attr.send_cq = send_cq->core()->cq;
  attr.recv_cq = recv_cq->core()->cq;
  attr.srq = srq != nullptr ? srq->core()->srq : nullptr;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = init.sq_sig_all ? 1 : 0;
  attr.cap.max_send_wr = init.max_send_wr;
  attr.cap.max_recv_wr = srq != nullptr ? 0 : init.max_recv_wr;
  attr.cap.max_send_sge = init.max_send_sge;
  attr.cap.max_recv_sge = srq != nullptr ? 0 : init.max_recv_sge;
  attr.cap.max_inline_data = init.max_inline_data;
  errno = 0;
  if (rdma_create_qp(id, vpd->core()->pd, &attr) != 0) {
    int err = errno != 0 ? errno : EINVAL;
    // The cause first: a listener sends this text as its reject reason,
    // which is cut at 140 bytes.
    return absl::Status(
        absl::ErrnoToStatusCode(err),
        absl::StrFormat(
            "rdma_create_qp (side %s) on %s: %s (errno %d); requested "
            "send_wr=%u recv_wr=%u send_sge=%u recv_sge=%u inline=%u%s; "
            "device max_qp_wr=%d max_sge=%d max_inline_data=%u",
            side, dev.name, std::strerror(err), err, init.max_send_wr,
            init.max_recv_wr, init.max_send_sge, init.max_recv_sge,
            init.max_inline_data, srq != nullptr ? " (with SRQ)" : "",
            dev.attr.max_qp_wr, dev.attr.max_sge, dev.caps.max_inline_data));
  }
  std::shared_ptr<SrqCore> srq_core;
  if (srq != nullptr) srq_core = srq->core();
  return std::make_unique<VerbsQp>(id->qp, id, attr.cap, vpd->core(),
                                   send_cq->core(), recv_cq->core(),
                                   std::move(srq_core), std::move(keepalive));
}

}  // namespace coverbs::transport::verbs_internal
