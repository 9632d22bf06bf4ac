#include "cm/qp_events.h"

#include <poll.h>

#include <utility>

#include "absl/status/status.h"
#include "core/log.h"
#include "transport/errors.h"

namespace coverbs::cm::internal {

std::shared_ptr<QpEvents> QpEvents::For(transport::Device& device) {
  static std::mutex mu;
  static auto* tables =
      new absl::flat_hash_map<transport::Device*, std::weak_ptr<QpEvents>>();
  std::lock_guard<std::mutex> lock(mu);
  // Devices come and go (tests open many): drop the tables nobody holds.
  absl::erase_if(*tables, [](const auto& e) { return e.second.expired(); });
  std::weak_ptr<QpEvents>& slot = (*tables)[&device];
  std::shared_ptr<QpEvents> t = slot.lock();
  if (t == nullptr) {
    t = std::make_shared<QpEvents>(device);
    slot = t;
  }
  return t;
}

Task<void> QpEvents::Watch(std::weak_ptr<QpEvents> table, int fd,
                           Reactor* reactor) {
  if (fd < 0) co_return;
  for (;;) {
    absl::StatusOr<uint32_t> ready = co_await reactor->WaitFd(fd, POLLIN);
    // Only the Workers hold the table: once they are gone, so may be the
    // device (and its address may serve another one).
    std::shared_ptr<QpEvents> self = table.lock();
    if (self == nullptr) co_return;
    if (!ready.ok()) {
      if (!absl::IsCancelled(ready.status())) {
        COVERBS_LOG(kWarning, "cm",
                    "no longer watching the asynchronous events of %s: %s",
                    self->device_.Describe(), ready.status().ToString());
      }
      co_return;
    }
    std::lock_guard<std::mutex> lock(self->mu_);
    self->DrainLocked();
  }
}

void QpEvents::Track(uint32_t qp_num) {
  std::lock_guard<std::mutex> lock(mu_);
  tracked_[qp_num].reset();
}

void QpEvents::Forget(uint32_t qp_num) {
  std::lock_guard<std::mutex> lock(mu_);
  tracked_.erase(qp_num);
}

std::optional<transport::AsyncEvent> QpEvents::ErrorOf(uint32_t qp_num) {
  std::lock_guard<std::mutex> lock(mu_);
  DrainLocked();
  auto it = tracked_.find(qp_num);
  if (it == tracked_.end()) return std::nullopt;
  return it->second;
}

void QpEvents::DrainLocked() {
  device_.DrainAsyncEvents(
      [this](const transport::AsyncEvent& ev) { RecordLocked(ev); });
}

void QpEvents::RecordLocked(const transport::AsyncEvent& ev) {
  switch (ev.type) {
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_QP_REQ_ERR: {
      // IBV_EVENT_QP_FATAL is not kept: soft raises it for a lost TCP
      // connection too, and what ends a connection then is the link, which
      // the flush already says ("peer gone").
      auto it = tracked_.find(ev.qp_num);
      if (it != tracked_.end() && !it->second.has_value()) it->second = ev;
      return;
    }
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
      return;  // news about one QP or the fabric, not a device fault
    default:
      // A device, port or CQ fault: the connections it ends say so through
      // their completions; this says what the device reported.
      COVERBS_LOG(kWarning, "cm", "%s: %s (%s)", device_.Describe(),
                  transport::AsyncEventName(ev.type), ev.description);
      return;
  }
}

}  // namespace coverbs::cm::internal
