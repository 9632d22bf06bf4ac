// The verbs provider: Provider over libibverbs + librdmacm.
#include "transport/verbs/verbs_provider.h"

#include <errno.h>
#include <unistd.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "transport/verbs/internal.h"

namespace coverbs::transport {
namespace {

using verbs_internal::CqCore;
using verbs_internal::Device;
using verbs_internal::ErrnoStatus;
using verbs_internal::PairAddresses;
using verbs_internal::PdCore;
using verbs_internal::VerbsCq;
using verbs_internal::VerbsErrno;
using verbs_internal::VerbsPd;
using verbs_internal::VerbsQp;

std::string DescribeAsyncEvent(const Device& dev, const ibv_async_event& ev,
                               uint32_t* qp_num) {
  const char* name = ibv_event_type_str(ev.event_type);
  switch (ev.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      *qp_num = ev.element.qp->qp_num;
      return absl::StrFormat("%s on QP 0x%x (%s)", name, *qp_num, dev.name);
    case IBV_EVENT_CQ_ERR:
      return absl::StrFormat(
          "%s on a CQ of %s (CQ overrun or protection "
          "error)",
          name, dev.name);
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return absl::StrFormat("%s on SRQ (handle %u) of %s", name,
                             ev.element.srq->handle, dev.name);
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
      return absl::StrFormat("%s on %s port %d", name, dev.name,
                             ev.element.port_num);
    case IBV_EVENT_DEVICE_FATAL:
      return absl::StrFormat("%s: device %s is unusable", name, dev.name);
    default:
      return absl::StrFormat("%s on %s", name, dev.name);
  }
}

class VerbsProvider : public Provider {
 public:
  explicit VerbsProvider(std::shared_ptr<Device> dev) : dev_(std::move(dev)) {}

  const DeviceCaps& caps() const override { return dev_->caps; }

  absl::StatusOr<std::unique_ptr<ProviderPd>> AllocPd() override {
    errno = 0;
    ibv_pd* pd = ibv_alloc_pd(dev_->ctx);
    if (pd == nullptr) {
      const int err = errno != 0 ? errno : ENOMEM;
      return ErrnoStatus(err,
                         absl::StrFormat("ibv_alloc_pd on %s", dev_->name));
    }
    auto core = std::make_shared<PdCore>();
    core->dev = dev_;
    core->pd = pd;
    return std::make_unique<VerbsPd>(std::move(core));
  }

  absl::StatusOr<std::unique_ptr<ProviderCq>> CreateCq(int cqe) override {
    if (cqe <= 0 || (dev_->caps.max_cqe != 0 &&
                     static_cast<uint32_t>(cqe) > dev_->caps.max_cqe)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "CreateCq(%d) on %s: cqe must be in [1, %u] (device max_cqe)", cqe,
          dev_->name, dev_->caps.max_cqe));
    }
    auto core = std::make_shared<CqCore>();
    core->dev = dev_;
    errno = 0;
    core->channel = ibv_create_comp_channel(dev_->ctx);
    if (core->channel == nullptr) {
      const int err = errno != 0 ? errno : EMFILE;
      return ErrnoStatus(
          err, absl::StrFormat("ibv_create_comp_channel on %s", dev_->name));
    }
    int fl = fcntl(core->channel->fd, F_GETFL);
    if (fl < 0 || fcntl(core->channel->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
      return ErrnoStatus(errno, "fcntl(O_NONBLOCK) on a completion channel");
    }
    errno = 0;
    core->cq = ibv_create_cq(dev_->ctx, cqe, nullptr, core->channel, 0);
    if (core->cq == nullptr) {
      const int err = errno != 0 ? errno : ENOMEM;
      return ErrnoStatus(
          err, absl::StrFormat("ibv_create_cq(%d) on %s", cqe, dev_->name));
    }
    return std::make_unique<VerbsCq>(std::move(core));
  }

  int async_fd() const override { return dev_->ctx->async_fd; }

  absl::StatusOr<AsyncEvent> GetAsyncEvent() override {
    ibv_async_event ev{};
    errno = 0;
    if (ibv_get_async_event(dev_->ctx, &ev) != 0) {
      int err = errno != 0 ? errno : EAGAIN;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        return absl::NotFoundError(
            absl::StrFormat("no asynchronous event pending on %s", dev_->name));
      }
      return ErrnoStatus(
          err, absl::StrFormat("ibv_get_async_event on %s", dev_->name));
    }
    AsyncEvent out;
    out.type = ev.event_type;
    out.description = DescribeAsyncEvent(*dev_, ev, &out.qp_num);
    if (dev_->TrackQpErrors() && (ev.event_type == IBV_EVENT_QP_FATAL ||
                                  ev.event_type == IBV_EVENT_QP_REQ_ERR ||
                                  ev.event_type == IBV_EVENT_QP_ACCESS_ERR)) {
      dev_->NoteQpError(out.qp_num);
    }
    ibv_ack_async_event(&ev);  // after reading ev.element
    return out;
  }

  absl::StatusOr<QpPair> CreateConnectedPair(ProviderPd* pd_a,
                                             const QpInit& init_a,
                                             ProviderPd* pd_b,
                                             const QpInit& init_b) override {
    absl::StatusOr<PairAddresses> addrs = Addresses();
    if (!addrs.ok()) return addrs.status();
    // siw's in-kernel TCP occasionally refuses a connection set up right
    // after many others (EADDRNOTAVAIL: no free source port yet;
    // ECONNREFUSED); both are transient, so try a few times.
    absl::StatusOr<QpPair> pair;
    for (int attempt = 0; attempt < 3; ++attempt) {
      pair = verbs_internal::ConnectPair(*addrs, pd_a, init_a, pd_b, init_b,
                                         /*timeout_ms=*/0);
      if (pair.ok()) break;
      std::string m(pair.status().message());
      bool transient = m.find("(errno 99)") != std::string::npos ||
                       m.find("(errno 111)") != std::string::npos;
      if (!transient) break;
      usleep(20000 * (attempt + 1));
    }
    return pair;
  }

  const std::shared_ptr<Device>& device() const { return dev_; }

 private:
  // Found once (it binds rdma_cm ids to candidate addresses), then cached.
  absl::StatusOr<PairAddresses> Addresses() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!addrs_.has_value()) {
      auto found = verbs_internal::FindPairAddresses(*dev_);
      if (!found.ok()) return found.status();
      addrs_ = *std::move(found);
    }
    return *addrs_;
  }

  std::shared_ptr<Device> dev_;
  std::mutex mu_;
  std::optional<PairAddresses> addrs_;
};

}  // namespace

bool VerbsDevicesPresent() {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return false;
  ibv_free_device_list(list);
  return num > 0;
}

absl::StatusOr<std::unique_ptr<Provider>> OpenVerbsProvider(
    const ProviderOptions& options) {
  auto dev = verbs_internal::OpenDevice(options);
  if (!dev.ok()) return dev.status();
  return std::make_unique<VerbsProvider>(*std::move(dev));
}

ibv_context* VerbsContext(const Provider& provider) {
  const auto* p = dynamic_cast<const VerbsProvider*>(&provider);
  return p != nullptr ? p->device()->ctx : nullptr;
}

ibv_pd* VerbsPdHandle(ProviderPd* pd) {
  auto* p = dynamic_cast<VerbsPd*>(pd);
  return p != nullptr ? p->core()->pd : nullptr;
}

ibv_cq* VerbsCqHandle(ProviderCq* cq) {
  auto* c = dynamic_cast<VerbsCq*>(cq);
  return c != nullptr ? c->core()->cq : nullptr;
}

ibv_qp* VerbsQpHandle(ProviderQp* qp) {
  auto* q = dynamic_cast<VerbsQp*>(qp);
  return q != nullptr ? q->qp() : nullptr;
}

absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQpOnCmId(
    rdma_cm_id* id, ProviderPd* pd, const QpInit& init,
    std::shared_ptr<void> keepalive) {
  if (id == nullptr)
    return absl::InvalidArgumentError("CreateQpOnCmId: null id");
  auto qp = verbs_internal::CreateCmQp(id, pd, init, std::move(keepalive),
                                       "on cm id");
  if (!qp.ok()) return qp.status();
  return std::unique_ptr<ProviderQp>(std::move(*qp));
}

absl::Status FinishEstablishedQp(ProviderQp* qp, const QpInit& init) {
  auto* q = dynamic_cast<VerbsQp*>(qp);
  if (q == nullptr) {
    return absl::InvalidArgumentError(
        "FinishEstablishedQp: not a QP of the verbs provider");
  }
  return verbs_internal::FinishEstablished(*q, init);
}

}  // namespace coverbs::transport
