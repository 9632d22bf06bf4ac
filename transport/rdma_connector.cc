#include "transport/rdma_connector.h"

#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/sync.h"
#include "core/timeout.h"
#include "transport/cm_trace.h"
#include "transport/connector_util.h"
#include "transport/rdma_cm_events.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {
namespace {

using connector_util::Annotate;
using connector_util::Bytes;
using connector_util::Endpoint;
using connector_util::ListenAddress;
using connector_util::Resolve;
using connector_util::SocketAddress;
using rdma_cm::CmEvent;
using rdma_cm::CmEventChannel;
using rdma_cm::CmId;

absl::Status EventError(const CmEvent& e, const std::string& where,
                        const char* step) {
  switch (e.type) {
    case RDMA_CM_EVENT_ADDR_ERROR:
      return absl::UnavailableError(
          absl::StrFormat("%s: address resolution failed (%s, status %d)",
                          where, rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return absl::UnavailableError(
          absl::StrFormat("%s: route resolution failed (%s, status %d)", where,
                          rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_UNREACHABLE:
      return absl::UnavailableError(
          absl::StrFormat("%s: unreachable (%s, status %d)", where,
                          rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_REJECTED: {
      std::string reason = DecodeReject(Bytes(e.private_data));
      if (!reason.empty()) {
        return absl::PermissionDeniedError(
            absl::StrCat(where, ": rejected by the peer: ", reason));
      }
      return absl::UnavailableError(absl::StrFormat(
          "%s: connection refused (REJECTED, status %d: no listener on that "
          "port, or a peer that is not coverbs)",
          where, e.status));
    }
    case RDMA_CM_EVENT_CONNECT_ERROR:
      return absl::UnavailableError(
          absl::StrFormat("%s: connection error (%s, status %d)", where,
                          rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      return absl::AbortedError(
          absl::StrCat(where, ": the RDMA device was removed"));
    default:
      return absl::InternalError(absl::StrFormat(
          "%s: unexpected rdma_cm event %s (status %d) during %s", where,
          rdma_event_str(e.type), e.status, step));
  }
}

// Waits for `want`; any other event is the failure it stands for.
Task<absl::StatusOr<CmEvent>> Expect(CmId& id, rdma_cm_event_type want,
                                     absl::Duration timeout,
                                     const std::string& where,
                                     const char* step) {
  auto ev = co_await id.Next(timeout);
  if (!ev.ok()) {
    co_return absl::Status(
        ev.status().code(),
        absl::StrCat(where, ": ", step, ": ", ev.status().message()));
  }
  if (ev->type != want) co_return EventError(*ev, where, step);
  co_return std::move(*ev);
}

// retry_count is this side's QpOptions::retry_cnt (rdma_cm caps it at 7);
// rnr_retry_count is what the peer's sends get, always 7 (forever): a
// receiver that is not ready holds its peer back, never fails it.
rdma_conn_param ConnParam(const Device& device, const std::string& pd,
                          uint8_t retry_cnt) {
  rdma_conn_param p{};
  p.private_data = pd.data();
  p.private_data_len = static_cast<uint8_t>(pd.size());
  uint32_t rd = device.caps().max_qp_rd_atom;
  p.responder_resources =
      static_cast<uint8_t>(std::min<uint32_t>(rd ? rd : 1, 16));
  p.initiator_depth = p.responder_resources;
  p.retry_count = std::min<uint8_t>(retry_cnt, 7);
  p.rnr_retry_count = 7;
  return p;
}

// The QP of one attempt, created on the id and handed to `setup`.
struct AttemptQp {
  QpInit init;
  ProviderQp* qp = nullptr;  // owned by whoever setup.Adopt gave it to
  std::string private_data;
};

absl::StatusOr<AttemptQp> SetUpQp(const std::shared_ptr<CmId>& id,
                                  QpSetup& setup) {
  ProtectionDomain& pd = setup.pd();
  if (id->id()->verbs != VerbsContext(*pd.device()->provider())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the address is on RDMA device ",
        id->id()->verbs ? ibv_get_device_name(id->id()->verbs->device) : "?",
        ", not on the context's device ", pd.device()->name()));
  }
  AttemptQp a;
  a.init = connector_util::InitFor(setup);
  // Without this rdma_cm picks the ACK timeout itself (RoCE, Linux 6.1: the
  // packet lifetime 16 + 1 = 17, 537 ms per retransmission); with it the
  // QP gets QpOptions::timeout, as on every other path. iWARP retransmits
  // by TCP and has no such timer.
  if (pd.device()->caps().transport != TransportKind::kIWarp) {
    uint8_t timeout = a.init.timeout;
    if (rdma_set_option(id->id(), RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT,
                        &timeout, sizeof timeout) != 0) {
      return absl::InternalError(absl::StrCat(
          "rdma_set_option(ACK_TIMEOUT=", timeout, "): ", strerror(errno)));
    }
  }
  auto pqp = CreateQpOnCmId(id->id(), pd.provider(), a.init, id);
  if (!pqp.ok()) return pqp.status();
  auto qp =
      QueuePair::Adopt(std::move(*pqp), setup.cq(), setup.qp_options(), id,
                       &setup.recv_cq());
  if (!qp.ok()) return qp.status();
  a.qp = (*qp)->provider();
  auto data = setup.Adopt(*std::move(qp));
  if (!data.ok()) return data.status();
  a.private_data = *std::move(data);
  return a;
}

// rdma_connect on iWARP makes the TCP connection inside the call (siw: a
// blocking kernel_connect). On the reactor thread that wait is interrupted
// by the thread's own io_uring completions (their task work makes a signal
// pending): siw aborts the half-made TCP connection and the syscall restarts
// -- and siw's listener, which sees the aborted socket before accepting it,
// frees its listening endpoint, so every later connect to that port is
// refused (VM, Linux 6.1, siw dynamic debug: "kernel_bindconnect: error
// -512", then "siw_accept_newconn: error -103" and the listening CEP freed;
// the restarted call then binds the same source port: EADDRNOTAVAIL). A
// thread without a ring makes the call; the reactor goes on meanwhile.
struct OffReactorConnect {
  int rc = 0;
  int err = 0;
  bool done = false;  // set on the reactor thread
  Event finished;
};
Task<absl::Status> WaitForConnect(OffReactorConnect* call) {
  co_return co_await call->finished.Wait();
}

// The signal that interrupts a helper thread's rdma_connect (an empty
// handler without SA_RESTART, so the blocked connect returns EINTR).
// Installed once, and only if the application left the signal at its
// default; 0 when not installed (then the call is waited for).
int ConnectInterruptSignal() {
  static const int sig = [] {
    const int s = SIGRTMIN + 5;
    struct sigaction old {};
    if (s > SIGRTMAX || sigaction(s, nullptr, &old) != 0 ||
        (old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) {
      return 0;
    }
    struct sigaction sa {};
    sa.sa_handler = [](int) {};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    return sigaction(s, &sa, nullptr) == 0 ? s : 0;
  }();
  return sig;
}

// Joins in the waiting frame, also when it is destroyed mid-call (reactor
// teardown), so the call never outlives the id it uses.
struct JoinOnExit {
  std::thread thread;
  ~JoinOnExit() {
    if (!thread.joinable()) return;
    if (int sig = ConnectInterruptSignal()) {
      pthread_kill(thread.native_handle(), sig);
    }
    thread.join();
  }
};

struct ConnectCall {
  int rc = 0;
  int err = 0;
};

// rdma_connect off the reactor (see OffReactorConnect). The id, the QP and
// the private data must outlive the call: past the deadline (or when the
// Connect is cancelled) the call is interrupted and joined, never left
// behind. A call interrupted that way yields DeadlineExceeded / Cancelled.
Task<absl::StatusOr<ConnectCall>> ConnectOffReactor(rdma_cm_id* raw,
                                                    rdma_conn_param param,
                                                    absl::Time deadline,
                                                    absl::Duration timeout,
                                                    const std::string& where) {
  const int sig = ConnectInterruptSignal();
  auto call = std::make_shared<OffReactorConnect>();
  JoinOnExit helper;
  helper.thread =
      std::thread([call, r = Reactor::Current(), raw, param]() mutable {
        call->rc = rdma_connect(raw, &param);
        call->err = errno;
        r->Post([call] {
          call->done = true;
          call->finished.Set();
        });
      });
  absl::Duration left = deadline - absl::Now();
  absl::Status waited = co_await WithTimeout(
      WaitForConnect(call.get()), std::max(left, absl::Milliseconds(1)));
  bool interrupted = false;
  if (!call->done && sig != 0) {
    // siw: a peer that does not answer holds the TCP connect for the
    // kernel's SYN retries (~130 s).
    pthread_kill(helper.thread.native_handle(), sig);
    interrupted = true;
  }
  helper.thread.join();  // prompt once interrupted
  if (call->rc != 0 && interrupted && call->err == EINTR) {
    co_return absl::Status(
        waited.code() == absl::StatusCode::kCancelled
            ? absl::StatusCode::kCancelled
            : absl::StatusCode::kDeadlineExceeded,
        absl::StrCat(where, ": rdma_connect did not finish within ",
                     absl::FormatDuration(timeout),
                     " (the TCP connection was not answered); "
                     "interrupted"));
  }
  co_return ConnectCall{call->rc, call->err};
}

// A fresh id whose address and route are resolved. Such ids are destroyed
// off the reactor until then (rdma_destroy_id blocked for 130 s on siw for
// an unreachable address).
Task<absl::StatusOr<std::shared_ptr<CmId>>> ResolvedId(
    CmEventChannel* ch, const SocketAddress& sa, absl::Duration timeout,
    const std::string& where) {
  auto created = CmId::Create(ch);
  if (!created.ok()) co_return Annotate(created.status(), where);
  std::shared_ptr<CmId> id = *std::move(created);
  id->set_destroy_in_background(true);
  int ms = std::max(static_cast<int>(absl::ToInt64Milliseconds(timeout)), 1);
  SocketAddress dst = sa;
  // rdma_cm has no loopback device: on Linux 6.1 siw fails the address
  // resolution (EINVAL), rxe the route's (ENODEV). Say why.
  const char* hint =
      sa.IsLoopback()
          ? " (a loopback address: rdma_cm reaches only addresses on an RDMA "
            "device's netdev)"
          : "";
  if (rdma_resolve_addr(id->id(), nullptr, dst.get(), ms) != 0) {
    co_return absl::UnavailableError(absl::StrCat(
        where, ": address resolution failed: ", strerror(errno), hint));
  }
  auto ev = co_await Expect(*id, RDMA_CM_EVENT_ADDR_RESOLVED, timeout, where,
                            "address resolution");
  if (!ev.ok()) {
    co_return absl::Status(ev.status().code(),
                           absl::StrCat(ev.status().message(), hint));
  }
  if (rdma_resolve_route(id->id(), ms) != 0) {
    co_return absl::UnavailableError(absl::StrCat(
        where, ": route resolution failed: ", strerror(errno), hint));
  }
  ev = co_await Expect(*id, RDMA_CM_EVENT_ROUTE_RESOLVED, timeout, where,
                       "route resolution");
  if (!ev.ok()) {
    co_return absl::Status(ev.status().code(),
                           absl::StrCat(ev.status().message(), hint));
  }
  id->set_destroy_in_background(false);
  co_return id;
}

class RdmaConnector;

// Finishes an established id: the QP's late attributes, the link.
absl::StatusOr<Established> Finish(const std::shared_ptr<CmId>& id,
                                   const AttemptQp& a, std::string describe,
                                   std::string peer_private_data,
                                   const std::string& where) {
  absl::Status s = FinishEstablishedQp(a.qp, a.init);
  if (!s.ok()) return Annotate(s, where);
  id->SetEstablished(std::move(describe));
  Established e;
  e.link = rdma_cm::MakeVerbsLink(id);
  e.private_data = std::move(peer_private_data);
  return e;
}

class RdmaRequest final : public IncomingRequest {
 public:
  RdmaRequest(CmEvent ev) : id_(std::move(ev.request)) {
    set_peer(std::move(ev.peer_addr), ev.peer_port);
    private_data_ = std::move(ev.private_data);
  }

  Task<absl::StatusOr<std::string>> ReadPrivateData(absl::Time) override {
    co_return private_data_;
  }

  absl::Status Reject(std::string_view reason) override {
    set_rejected(reason);
    if (id_ == nullptr) return absl::OkStatus();
    std::string payload = EncodeReject(reason);
    int rc = rdma_reject(id_->id(), payload.data(),
                         static_cast<uint8_t>(payload.size()));
    int err = errno;
    id_.reset();
    if (rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("rdma_reject failed: ", strerror(err)));
    }
    return absl::OkStatus();
  }

  Task<absl::StatusOr<Established>> Accept(Connector& on, QpSetup& setup,
                                           absl::Time deadline) override;

 private:
  std::shared_ptr<CmId> id_;
  std::string private_data_;
};

class RdmaEndpoint final : public PassiveEndpoint {
 public:
  RdmaEndpoint(std::shared_ptr<CmId> id, std::string address, uint16_t port)
      : id_(std::move(id)), address_(std::move(address)), port_(port) {}

  uint16_t port() const override { return port_; }
  void Close() override { id_.reset(); }

  Task<absl::StatusOr<std::unique_ptr<IncomingRequest>>> Next(
      absl::Duration wait) override {
    std::string where = absl::StrCat("listener ", Endpoint(address_, port_));
    for (;;) {
      std::shared_ptr<CmId> id = id_;  // Close() may drop id_ meanwhile
      if (id == nullptr) {
        co_return absl::CancelledError(absl::StrCat(where, ": closed"));
      }
      auto ev = co_await id->Next(wait);
      if (!ev.ok() &&
          ev.status().code() == absl::StatusCode::kDeadlineExceeded) {
        co_return ev.status();
      }
      if (!ev.ok()) co_return Annotate(ev.status(), where);
      if (ev->type == RDMA_CM_EVENT_CONNECT_REQUEST && ev->request != nullptr) {
        co_return std::unique_ptr<IncomingRequest>(
            new RdmaRequest(*std::move(ev)));
      }
      if (ev->type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
        co_return absl::AbortedError(
            absl::StrCat(where, ": the RDMA device was removed"));
      }
    }
  }

 private:
  std::shared_ptr<CmId> id_;
  std::string address_;
  uint16_t port_;
};

class RdmaConnector final : public Connector {
 public:
  RdmaConnector(Device& device, Reactor& reactor)
      : device_(device), reactor_(reactor) {}

  Device& device() const { return device_; }

  // The event channel, created on first use.
  absl::StatusOr<CmEventChannel*> events() {
    if (events_ == nullptr) {
      auto ch = CmEventChannel::Create(reactor_);
      if (!ch.ok()) return ch.status();
      events_ = *std::move(ch);
    }
    return events_.get();
  }

  Task<absl::StatusOr<Established>> Connect(const ConnectParams& params,
                                            QpSetup& setup) override;

  absl::StatusOr<std::shared_ptr<PassiveEndpoint>> Listen(
      const std::string& address, uint16_t port, int backlog) override {
    std::string where = absl::StrCat("listen on ", Endpoint(address, port));
    auto sa = ListenAddress(address, port);
    if (!sa.ok()) return Annotate(sa.status(), where);
    auto ch = events();
    if (!ch.ok()) return Annotate(ch.status(), where);
    auto id = CmId::Create(*ch);
    if (!id.ok()) return Annotate(id.status(), where);
    if (rdma_bind_addr((*id)->id(), sa->get()) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": rdma_bind_addr: ", strerror(errno)));
    }
    if (rdma_listen((*id)->id(), backlog) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": rdma_listen: ", strerror(errno)));
    }
    uint16_t bound = ntohs(rdma_get_src_port((*id)->id()));
    return std::make_shared<RdmaEndpoint>(*std::move(id), address, bound);
  }

 private:
  // One address of a Connect: `id` and setup's QP are the caller's to
  // discard (QP first) when it fails.
  Task<absl::StatusOr<Established>> ConnectTo(
      const SocketAddress& sa, const ConnectParams& params, QpSetup& setup,
      const std::string& where, const std::string& ep, absl::Time deadline,
      std::shared_ptr<CmId>& id);

  Device& device_;
  Reactor& reactor_;
  std::unique_ptr<CmEventChannel> events_;
};

Task<absl::StatusOr<Established>> RdmaRequest::Accept(Connector& on,
                                                      QpSetup& setup,
                                                      absl::Time deadline) {
  std::string ep = Endpoint(peer_address(), peer_port());
  std::string where = absl::StrCat("accept from ", ep);
  auto* target = dynamic_cast<RdmaConnector*>(&on);
  if (target == nullptr) {
    co_return absl::InvalidArgumentError(
        absl::StrCat(where, ": the target connector is not rdma_cm's"));
  }
  auto ch = target->events();
  if (!ch.ok()) co_return Annotate(ch.status(), where);
  absl::Status s = id_->Migrate(*ch);
  if (!s.ok()) co_return Annotate(s, where);
  auto a = SetUpQp(id_, setup);
  if (!a.ok()) {
    Reject(std::string(a.status().message())).IgnoreError();
    co_return Annotate(a.status(), where);
  }
  rdma_conn_param param =
      ConnParam(target->device(), a->private_data, a->init.retry_cnt);
  if (rdma_accept(id_->id(), &param) != 0) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": rdma_accept failed: ", strerror(errno)));
  }
  auto ev = co_await Expect(*id_, RDMA_CM_EVENT_ESTABLISHED,
                            deadline - absl::Now(), where, "accepting");
  if (!ev.ok()) co_return ev.status();
  co_return Finish(id_, *a, absl::StrCat(target->device().name(), " <- ", ep),
                   "", where);
}

Task<absl::StatusOr<Established>> RdmaConnector::Connect(
    const ConnectParams& params, QpSetup& setup) {
  std::string ep = Endpoint(params.address, params.port);
  std::string where = absl::StrCat("connect to ", ep);
  auto addresses =
      co_await Resolve(params.address, params.port, params.resolve_timeout);
  if (!addresses.ok()) co_return Annotate(addresses.status(), where);
  const absl::Time deadline = absl::Now() + params.connect_timeout;
  // Every address in turn while the peer is unreachable or refuses (no
  // listener there): a host name may have several, one per family.
  for (size_t i = 0;; ++i) {
    const SocketAddress& a = (*addresses)[i];
    const std::string at =
        addresses->size() == 1 && a.Numeric() == params.address
            ? where
            : absl::StrCat(where, " (", Endpoint(a.Numeric(), params.port),
                           ")");
    std::shared_ptr<CmId> id;
    auto e = co_await ConnectTo(a, params, setup, at, ep, deadline, id);
    if (e.ok() || e.status().code() != absl::StatusCode::kUnavailable ||
        i + 1 == addresses->size() || absl::Now() >= deadline) {
      co_return e;
    }
    setup.Discard();  // the QP before the id it was created on
    id.reset();
  }
}

Task<absl::StatusOr<Established>> RdmaConnector::ConnectTo(
    const SocketAddress& sa, const ConnectParams& params, QpSetup& setup,
    const std::string& where, const std::string& ep, absl::Time deadline,
    std::shared_ptr<CmId>& id) {
  auto ch = events();
  if (!ch.ok()) co_return Annotate(ch.status(), where);
  absl::StatusOr<AttemptQp> a = absl::UnknownError("no attempt");
  // iWARP: an EADDRNOTAVAIL from rdma_connect (the TCP source port rdma_cm
  // chose is still taken) is retried with a fresh id and QP after a
  // growing, jittered pause until the connect deadline. A refusal fails at
  // once, as REJECTED does on IB/RoCE. (Refusals of a live listener and
  // most EADDRNOTAVAILs came from calling rdma_connect on the reactor
  // thread; see OffReactorConnect.)
  uint64_t jitter = reinterpret_cast<uintptr_t>(&setup) >> 4;
  for (int attempt = 0;; ++attempt) {
    if (a.ok()) setup.Discard();  // the QP before the id it was created on
    id.reset();
    auto resolved = co_await ResolvedId(*ch, sa, params.resolve_timeout, where);
    if (!resolved.ok()) co_return resolved.status();
    id = *std::move(resolved);
    a = SetUpQp(id, setup);
    if (!a.ok()) co_return Annotate(a.status(), where);
    rdma_conn_param param =
        ConnParam(device_, a->private_data, a->init.retry_cnt);
    ConnectCall call;
    if (device_.caps().transport == TransportKind::kIWarp) {
      auto c = co_await ConnectOffReactor(id->id(), param, deadline,
                                          params.connect_timeout, where);
      if (!c.ok()) co_return c.status();
      call = *c;
    } else {
      call.rc = rdma_connect(id->id(), &param);
      call.err = errno;
    }
    if (call.rc == 0) break;
    COVERBS_CM_TRACE(where, ": rdma_connect attempt ", attempt, " on id ",
                     absl::Hex(reinterpret_cast<uintptr_t>(id->id())), ": ",
                     strerror(call.err));
    if (call.err == EADDRNOTAVAIL) {
      int base = std::min(10 << std::min(attempt, 4), 160);
      jitter = jitter * 6364136223846793005ull + 1442695040888963407ull;
      absl::Duration pause =
          absl::Milliseconds(base + static_cast<int>((jitter >> 33) % base));
      if (absl::Now() + pause < deadline) {
        absl::Status slept = co_await Reactor::Current()->Sleep(pause);
        if (!slept.ok()) co_return Annotate(slept, where);
        continue;
      }
    }
    co_return absl::UnavailableError(absl::StrCat(
        where, ": rdma_connect failed: ", strerror(call.err),
        attempt > 0
            ? absl::StrCat(" (", attempt + 1, " attempts within ",
                           absl::FormatDuration(params.connect_timeout), ")")
            : ""));
  }
  auto ev =
      co_await Expect(*id, RDMA_CM_EVENT_ESTABLISHED,
                      std::max(deadline - absl::Now(), absl::ZeroDuration()),
                      where, "connecting");
  if (!ev.ok()) co_return ev.status();
  co_return Finish(id, *a, absl::StrCat(device_.name(), " -> ", ep),
                   std::move(ev->private_data), where);
}

}  // namespace

std::unique_ptr<Connector> CreateRdmaConnector(Device& device,
                                               Reactor& reactor) {
  return std::make_unique<RdmaConnector>(device, reactor);
}

}  // namespace coverbs::transport
