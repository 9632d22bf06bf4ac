#include "transport/rdma_cm_events.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "transport/cm_trace.h"

namespace coverbs::transport::rdma_cm {

struct CmEventChannel::Shared {
  rdma_event_channel* channel = nullptr;
  std::mutex mu;
  std::unordered_map<rdma_cm_id*, CmId*> ids;
  ~Shared() {
    if (channel != nullptr) rdma_destroy_event_channel(channel);
  }
};

namespace {

std::string AddrOf(const sockaddr* sa, uint16_t* port) {
  char buf[INET6_ADDRSTRLEN] = "?";
  *port = 0;
  if (sa == nullptr) return buf;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    *port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    auto* in = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof(buf));
    *port = ntohs(in->sin6_port);
  }
  return buf;
}

// Watches the channel fd and dispatches events until stopped. Holds the
// shared state so the channel outlives the loop.
Task<void> WatchLoop(Reactor* reactor,
                     std::shared_ptr<CmEventChannel::Shared> sh,
                     CmEventChannel* owner) {
  for (;;) {
    auto r = co_await reactor->WaitFd(sh->channel->fd, POLLIN);
    if (!r.ok()) co_return;  // stopped (Worker destroyed)
    rdma_cm_event* ev = nullptr;
    while (rdma_get_cm_event(sh->channel, &ev) == 0) {
      CmEvent e;
      e.type = ev->event;
      e.status = ev->status;
      if (ev->param.conn.private_data != nullptr &&
          ev->param.conn.private_data_len > 0) {
        e.private_data.assign(
            static_cast<const char*>(ev->param.conn.private_data),
            ev->param.conn.private_data_len);
      }
      rdma_cm_id* target = ev->id;
      COVERBS_CM_TRACE(
          "cm event ", rdma_event_str(ev->event), " status ", ev->status,
          " id ", absl::Hex(reinterpret_cast<uintptr_t>(ev->id)), " listen_id ",
          absl::Hex(reinterpret_cast<uintptr_t>(ev->listen_id)));
      if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        target = ev->listen_id;
        auto req = CmId::AdoptRequest(owner, ev->id);
        e.peer_addr = AddrOf(rdma_get_peer_addr(ev->id), &e.peer_port);
        e.request = std::move(req);
      }
      CmId* dest = nullptr;
      {
        std::lock_guard<std::mutex> lock(sh->mu);
        auto it = sh->ids.find(target);
        if (it != sh->ids.end()) dest = it->second;
      }
      if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST && dest == nullptr) {
        // The listener is gone: refuse rather than leave the peer waiting.
        rdma_reject(ev->id, nullptr, 0);
      }
      rdma_ack_cm_event(ev);
      // Delivered after the ack: an id dropped by its owner on delivery
      // (the request above, say) may then be destroyed.
      if (dest != nullptr) dest->Deliver(std::move(e));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CmEventChannel>> CmEventChannel::Create(
    Reactor& reactor) {
  auto sh = std::make_shared<Shared>();
  sh->channel = rdma_create_event_channel();
  if (sh->channel == nullptr) {
    int err = errno;
    return absl::UnavailableError(
        absl::StrCat("rdma_create_event_channel failed: ", strerror(err),
                     " (is rdma_ucm loaded?)"));
  }
  // The reactor waits for readiness; reads must never block it.
  int flags = fcntl(sh->channel->fd, F_GETFL);
  if (flags < 0 || fcntl(sh->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    int err = errno;
    return absl::InternalError(absl::StrCat(
        "cm event channel: fcntl(O_NONBLOCK) failed: ", strerror(err)));
  }
  std::unique_ptr<CmEventChannel> ch(new CmEventChannel(&reactor, sh));
  reactor.Spawn(WatchLoop(&reactor, sh, ch.get()), ch->stop_.get_token());
  return ch;
}

CmEventChannel::~CmEventChannel() { stop_.request_stop(); }

rdma_event_channel* CmEventChannel::channel() const { return shared_->channel; }

// ---------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<CmId>> CmId::Create(CmEventChannel* ch) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(ch->channel(), &id, nullptr, RDMA_PS_TCP) != 0) {
    int err = errno;
    return absl::UnavailableError(
        absl::StrCat("rdma_create_id failed: ", strerror(err)));
  }
  auto c = std::shared_ptr<CmId>(new CmId(ch, id));
  c->Register();
  return c;
}

std::shared_ptr<CmId> CmId::AdoptRequest(CmEventChannel* ch, rdma_cm_id* id) {
  auto c = std::shared_ptr<CmId>(new CmId(ch, id));
  c->Register();
  return c;
}

void CmId::Register() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  shared_->ids[id_] = this;
}

CmId::~CmId() {
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->ids.erase(id_);
  }
  // Keep the channel alive until the id is gone.
  std::shared_ptr<CmEventChannel::Shared> keep = shared_;
  if (destroy_in_background_) {
    std::thread([id = id_, keep] { rdma_destroy_id(id); }).detach();
    return;
  }
  rdma_destroy_id(id_);
}

void CmId::Deliver(CmEvent ev) {
  if (established_) {
    switch (ev.type) {
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
      case RDMA_CM_EVENT_TIMEWAIT_EXIT: {
        bool was_down = down_;
        down_ = true;
        down_event_.Set();
        if (!was_down) {
          down_why_ =
              ev.type == RDMA_CM_EVENT_DEVICE_REMOVAL
                  ? absl::AbortedError("connection lost: RDMA device removed")
                  : absl::UnavailableError(absl::StrCat(
                        "connection lost: ", rdma_event_str(ev.type),
                        " from the rdma_cm"));
        }
        if (!was_down && !local_disconnect_ && on_down_) {
          absl::Status why = down_why_;
          auto fn = std::move(on_down_);
          on_down_ = nullptr;
          fn(std::move(why));
        }
        return;
      }
      default:
        return;  // nothing else matters once established
    }
  }
  events_.push_back(std::move(ev));
  signal_.Set();
}

Task<absl::StatusOr<CmEvent>> CmId::Next(absl::Duration timeout) {
  if (events_.empty()) {
    signal_.Reset();
    auto wait = signal_.WaitFor(timeout);
    absl::Status s = co_await std::move(wait);
    if (!s.ok() && events_.empty()) co_return s;
  }
  CmEvent e = std::move(events_.front());
  events_.pop_front();
  co_return e;
}

absl::Status CmId::Migrate(CmEventChannel* to) {
  if (to == channel_) return absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->ids.erase(id_);
  }
  if (rdma_migrate_id(id_, to->channel()) != 0) {
    int err = errno;
    Register();
    return absl::InternalError(
        absl::StrCat("rdma_migrate_id failed: ", strerror(err)));
  }
  channel_ = to;
  shared_ = to->shared_;
  Register();
  return absl::OkStatus();
}

void CmId::SetEstablished(std::string describe) {
  established_ = true;
  describe_ = std::move(describe);
  // Anything queued meanwhile (a quick DISCONNECTED) now counts as down.
  std::deque<CmEvent> left;
  left.swap(events_);
  for (CmEvent& e : left) Deliver(std::move(e));
}

void CmId::Disconnect() {
  if (disconnect_called_) return;
  disconnect_called_ = true;
  if (!down_) local_disconnect_ = true;
  // Also after the peer's DISCONNECTED: on IB/RoCE this sends the DREP the
  // peer waits for (it would otherwise time out in DREQ_SENT). Moves the
  // QP to error.
  rdma_disconnect(id_);
}

Task<absl::Status> CmId::WaitDown(absl::Duration timeout) {
  if (down_) co_return absl::OkStatus();
  auto wait = down_event_.WaitFor(timeout);
  absl::Status s = co_await std::move(wait);
  if (!s.ok()) {
    co_return absl::Status(
        s.code(),
        absl::StrCat(describe_, ": waiting for DISCONNECTED: ", s.message()));
  }
  co_return absl::OkStatus();
}

void CmId::OnDown(std::function<void(absl::Status)> fn) {
  if (down_ && !local_disconnect_) {
    // Down before anyone listened: a DISCONNECTED that came right after
    // ESTABLISHED, queued until SetEstablished replayed it. Tell now (from
    // the reactor, not inside the caller's set-up). Before, such a
    // connection was never told and outlived its peer (seen on rxe).
    channel_->reactor().Post(
        [fn = std::move(fn), why = down_why_]() mutable { fn(why); });
    return;
  }
  on_down_ = std::move(fn);
}

namespace {
class VerbsLink final : public ConnectionLink {
 public:
  explicit VerbsLink(std::shared_ptr<CmId> id) : id_(std::move(id)) {}
  void Disconnect() override { id_->Disconnect(); }
  Task<absl::Status> WaitDown(absl::Duration t) override {
    return id_->WaitDown(t);
  }
  void OnDown(std::function<void(absl::Status)> fn) override {
    id_->OnDown(std::move(fn));
  }
  std::string Describe() const override { return id_->Describe(); }

 private:
  std::shared_ptr<CmId> id_;
};
}  // namespace

std::unique_ptr<ConnectionLink> MakeVerbsLink(std::shared_ptr<CmId> id) {
  return std::make_unique<VerbsLink>(std::move(id));
}

}  // namespace coverbs::transport::rdma_cm
