// CreateConnectedPair of the verbs provider: an in-process rdma_cm connection
// between a passive side `a` (listens, accepts) and an active side `b`
// (resolves, connects), on one non-blocking event channel, bounded by a
// deadline. Works on InfiniBand, RoCE and iWARP alike (iWARP needs rdma_cm).
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "transport/verbs/internal.h"

namespace coverbs::transport::verbs_internal {
namespace {

absl::StatusOr<sockaddr_storage> ParseAddress(const char* env_name,
                                              const char* text) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, text, &in->sin_addr) == 1) {
    in->sin_family = AF_INET;
    return ss;
  }
  if (inet_pton(AF_INET6, text, &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    return ss;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s=\"%s\" is not an IPv4 or IPv6 address literal", env_name, text));
}

sockaddr_storage Ipv4(in_addr a) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  in->sin_family = AF_INET;
  in->sin_addr = a;
  return ss;
}

void SetPort(sockaddr_storage& ss, uint16_t port_be) {
  if (ss.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = port_be;
  } else if (ss.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = port_be;
  }
}

sockaddr* Sa(sockaddr_storage& ss) { return reinterpret_cast<sockaddr*>(&ss); }

const char* CtxName(ibv_context* ctx) {
  return ctx != nullptr ? ibv_get_device_name(ctx->device) : "(no device)";
}

int TimeoutMsFromEnv() {
  if (const char* v = std::getenv("COVERBS_TEST_CM_TIMEOUT_MS")) {
    int ms = std::atoi(v);
    if (ms > 0) return ms;
  }
  return 5000;
}

// The connection state that must outlive both QPs: the cm ids and their event
// channel. Every QP of the pair holds a reference, so it goes last whatever
// the order in which QpPair's members are destroyed. Teardown order:
//   1. the QPs (rdma_destroy_qp, in ~VerbsQp), while the ids still exist;
//   2. Close(): a connection request never accepted is rejected; then
//      rdma_disconnect on b and a (non-blocking on an async channel; errors
//      ignored: the connection may never have been established);
//   3. rdma_destroy_id: a, b, then the listening id; every event we retrieved
//      was acked already, so none of these waits for an ack;
//   4. rdma_destroy_event_channel.
// When CreateConnectedPair fails half-way, Close() runs *before* the QPs are
// destroyed: siw's ibv_destroy_qp waits ~10 s for a connection attempt still
// in flight to time out, unless the attempt was ended first.
struct CmState {
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* listen = nullptr;
  rdma_cm_id* a = nullptr;  // passive, from CONNECT_REQUEST
  rdma_cm_id* b = nullptr;  // active
  bool a_accepted = false;
  bool closed = false;
  std::vector<rdma_cm_id*> extra;  // unexpected connection requests

  void Close() {
    if (closed) return;
    closed = true;
    if (a != nullptr && !a_accepted) rdma_reject(a, nullptr, 0);
    if (b != nullptr) rdma_disconnect(b);
    if (a != nullptr && a_accepted) rdma_disconnect(a);
  }

  ~CmState() {
    Close();
    for (rdma_cm_id* id : {a, b}) {
      if (id != nullptr) rdma_destroy_id(id);
    }
    for (rdma_cm_id* id : extra) rdma_destroy_id(id);
    if (listen != nullptr) rdma_destroy_id(listen);
    if (channel != nullptr) rdma_destroy_event_channel(channel);
  }
};

// Acks a cm event when it goes out of scope.
struct EventGuard {
  rdma_cm_event* ev;
  ~EventGuard() { rdma_ack_cm_event(ev); }
};

// `err`: errno right after the failed call.
absl::Status CmError(int err, std::string_view what, std::string_view stage) {
  return ErrnoStatus(err != 0 ? err : EINVAL,
                     absl::StrFormat("%s (while %s)", what, stage));
}

absl::StatusOr<rdma_event_channel*> NewChannel() {
  errno = 0;
  rdma_event_channel* ch = rdma_create_event_channel();
  if (ch == nullptr) {
    return ErrnoStatus(errno != 0 ? errno : ENODEV,
                       "rdma_create_event_channel (is rdma_ucm loaded?)");
  }
  int fl = fcntl(ch->fd, F_GETFL);
  if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    int err = errno;
    rdma_destroy_event_channel(ch);
    return ErrnoStatus(err, "fcntl(O_NONBLOCK) on the rdma_cm event channel");
  }
  return ch;
}

}  // namespace

absl::StatusOr<PairAddresses> FindPairAddresses(const Device& dev) {
  PairAddresses out;
  if (const char* peer = std::getenv("COVERBS_TEST_PEER_ADDR");
      peer != nullptr && *peer != '\0') {
    auto src = ParseAddress("COVERBS_TEST_PEER_ADDR", peer);
    if (!src.ok()) return src.status();
    out.src = *src;
  }
  if (const char* addr = std::getenv("COVERBS_TEST_ADDR");
      addr != nullptr && *addr != '\0') {
    auto listen = ParseAddress("COVERBS_TEST_ADDR", addr);
    if (!listen.ok()) return listen.status();
    out.listen = *listen;
    out.origin = "COVERBS_TEST_ADDR";
    return out;
  }

  // Candidates, best first: the RoCE GID's own IPv4 address, the IPv4
  // addresses of the GID's netdev, every other IPv4 address (loopback last).
  struct Candidate {
    in_addr addr;
    std::string ifname;
  };
  std::vector<Candidate> first, rest, loopback;
  if (dev.gid_ipv4.has_value()) first.push_back({*dev.gid_ipv4, "GID"});
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      if (!(i->ifa_flags & IFF_UP)) continue;
      Candidate c{reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr,
                  i->ifa_name};
      if (i->ifa_flags & IFF_LOOPBACK) {
        loopback.push_back(c);
      } else if (dev.ndev_ifindex != 0 &&
                 if_nametoindex(i->ifa_name) == dev.ndev_ifindex) {
        first.push_back(c);
      } else {
        rest.push_back(c);
      }
    }
    freeifaddrs(ifs);
  }
  std::vector<Candidate> all = first;
  all.insert(all.end(), rest.begin(), rest.end());
  all.insert(all.end(), loopback.begin(), loopback.end());

  // rdma_cm decides which device an address belongs to: bind and look.
  auto ch = NewChannel();
  if (!ch.ok()) return ch.status();
  std::vector<std::string> tried;
  bool found = false;
  for (const Candidate& c : all) {
    sockaddr_storage ss = Ipv4(c.addr);
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(*ch, &id, nullptr, RDMA_PS_TCP) != 0) break;
    const std::string name = SockaddrToString(Sa(ss));
    if (rdma_bind_addr(id, Sa(ss)) != 0) {
      tried.push_back(absl::StrFormat("%s (%s): bind failed: %s", name,
                                      c.ifname, std::strerror(errno)));
    } else if (id->verbs != dev.ctx) {
      tried.push_back(absl::StrFormat("%s (%s): device %s", name, c.ifname,
                                      CtxName(id->verbs)));
    } else {
      out.listen = ss;
      out.origin = absl::StrFormat("%s on %s", name, c.ifname);
      found = true;
    }
    rdma_destroy_id(id);
    if (found) break;
  }
  rdma_destroy_event_channel(*ch);
  if (!found) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "no IP address routes to device %s for rdma_cm (tried: %s). rdma_cm "
        "needs an address on the device's netdev, not on lo (e.g. `ip addr "
        "add 10.11.0.1/24 dev <netdev>`), or set COVERBS_TEST_ADDR",
        dev.name, tried.empty() ? "none" : absl::StrJoin(tried, "; ")));
  }
  return out;
}

absl::StatusOr<QpPair> ConnectPair(const PairAddresses& addrs, ProviderPd* pd_a,
                                   const QpInit& init_a, ProviderPd* pd_b,
                                   const QpInit& init_b, int timeout_ms) {
  auto* vpd_a = dynamic_cast<VerbsPd*>(pd_a);
  auto* vpd_b = dynamic_cast<VerbsPd*>(pd_b);
  if (vpd_a == nullptr || vpd_b == nullptr) {
    return absl::InvalidArgumentError(
        "CreateConnectedPair: pd_a and pd_b must be non-null PDs of the verbs "
        "provider");
  }
  if (timeout_ms <= 0) timeout_ms = TimeoutMsFromEnv();
  const Device& dev_a = *vpd_a->core()->dev;
  const Device& dev_b = *vpd_b->core()->dev;
  const bool ib_cm = dev_a.caps.transport != TransportKind::kIWarp;

  auto state = std::make_shared<CmState>();
  auto ch = NewChannel();
  if (!ch.ok()) return ch.status();
  state->channel = *ch;

  sockaddr_storage listen_addr = addrs.listen;
  const std::string where = SockaddrToString(Sa(listen_addr));
  // Passive side: bind and listen on port 0 (any free port).
  errno = 0;
  if (rdma_create_id(state->channel, &state->listen, nullptr, RDMA_PS_TCP)) {
    const int err = errno;
    return CmError(err, "rdma_create_id", "creating the listening id");
  }
  if (rdma_bind_addr(state->listen, Sa(listen_addr)) != 0) {
    const int err = errno;
    return CmError(
        err, absl::StrFormat("rdma_bind_addr(%s) [%s]", where, addrs.origin),
        "binding the listening id");
  }
  if (state->listen->verbs != nullptr && state->listen->verbs != dev_a.ctx) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "listen address %s [%s] belongs to device %s, but pd_a is on %s", where,
        addrs.origin, CtxName(state->listen->verbs), dev_a.name));
  }
  if (rdma_listen(state->listen, 4) != 0) {
    const int err = errno;
    return CmError(err, absl::StrFormat("rdma_listen(%s)", where), "listening");
  }
  SetPort(listen_addr, rdma_get_src_port(state->listen));
  const std::string dst = SockaddrToString(Sa(listen_addr));

  // Active side: resolve address, then route, then connect.
  if (rdma_create_id(state->channel, &state->b, nullptr, RDMA_PS_TCP) != 0) {
    const int err = errno;
    return CmError(err, "rdma_create_id", "creating the active id");
  }
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto remaining_ms = [&]() -> int {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - Clock::now());
    return left.count() > 0 ? static_cast<int>(left.count()) : 0;
  };
  sockaddr_storage src{};
  if (addrs.src.has_value()) src = *addrs.src;
  if (rdma_resolve_addr(state->b, addrs.src.has_value() ? Sa(src) : nullptr,
                        Sa(listen_addr), std::max(1, remaining_ms())) != 0) {
    const int err = errno;
    return CmError(
        err,
        absl::StrFormat(
            "rdma_resolve_addr(%s -> %s)",
            addrs.src.has_value() ? SockaddrToString(Sa(src)) : "any", dst),
        "resolving the address");
  }

  std::unique_ptr<VerbsQp> qp_a, qp_b;
  // On failure, end the connection attempt before qp_a/qp_b are destroyed
  // (declared after them, so destroyed first).
  struct CloseOnFailure {
    CmState* state;
    ~CloseOnFailure() {
      if (state != nullptr) state->Close();
    }
  } close_on_failure{state.get()};
  bool est_a = false, est_b = false;
  std::string stage = "resolving the address of " + dst;
  // How IB CM (InfiniBand, RoCE) applies the retry counts, as seen on rxe:
  // the connect request's retry_count goes to *both* QPs; its
  // rnr_retry_count goes to the passive QP, and the accept's to the active
  // QP. So each side's rnr_retry travels in the other side's parameters, and
  // retry_cnt is init_b's for both (RTS->RTS cannot change it). iWARP has no
  // such counters (TCP retransmits).
  auto conn_param = [](uint8_t retry_cnt, uint8_t peer_rnr_retry) {
    rdma_conn_param p{};
    p.responder_resources = RDMA_MAX_RESP_RES;  // device maximum
    p.initiator_depth = RDMA_MAX_INIT_DEPTH;
    p.retry_count = retry_cnt > 7 ? 7 : retry_cnt;
    p.rnr_retry_count = peer_rnr_retry > 7 ? 7 : peer_rnr_retry;
    return p;
  };
  auto set_ack_timeout = [&](rdma_cm_id* id, uint8_t timeout) -> absl::Status {
    if (!ib_cm) return absl::OkStatus();  // TCP timers on iWARP
    if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT,
                        &timeout, sizeof(timeout)) != 0) {
      const int err = errno;
      return CmError(
          err, absl::StrFormat("rdma_set_option(ACK_TIMEOUT=%u)", timeout),
          stage);
    }
    return absl::OkStatus();
  };

  while (!(est_a && est_b)) {
    rdma_cm_event* ev = nullptr;
    errno = 0;
    if (rdma_get_cm_event(state->channel, &ev) != 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        const int err = errno;
        return CmError(err, "rdma_get_cm_event", stage);
      }
      int left = remaining_ms();
      if (left == 0) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "CreateConnectedPair: no progress after %d ms while %s (listen "
            "%s [%s] on %s, active side on %s); set "
            "COVERBS_TEST_CM_TIMEOUT_MS to wait longer",
            timeout_ms, stage, dst, addrs.origin, dev_a.name, dev_b.name));
      }
      pollfd pfd{state->channel->fd, POLLIN, 0};
      poll(&pfd, 1, left);
      continue;
    }
    EventGuard guard{ev};
    const rdma_cm_event_type type = ev->event;
    rdma_cm_id* id = ev->id;
    switch (type) {
      case RDMA_CM_EVENT_ADDR_RESOLVED: {
        stage = "resolving the route to " + dst;
        if (rdma_resolve_route(state->b, std::max(1, remaining_ms())) != 0) {
          const int err = errno;
          return CmError(err, "rdma_resolve_route", stage);
        }
        break;
      }
      case RDMA_CM_EVENT_ROUTE_RESOLVED: {
        stage = "connecting to " + dst;
        if (auto s = set_ack_timeout(state->b, init_b.timeout); !s.ok()) {
          return s;
        }
        auto qp = CreateCmQp(state->b, pd_b, init_b, state, "b");
        if (!qp.ok()) return qp.status();
        qp_b = std::move(*qp);
        rdma_conn_param p = conn_param(init_b.retry_cnt, init_a.rnr_retry);
        // iWARP: rdma_connect makes the TCP connection inside the call.
        // On a thread with an io_uring (a reactor's: the tests call this
        // from one) the wait is interrupted by the ring's task work, and
        // siw aborts the half-made connection: "Connection reset by peer"
        // for ~1 in 15 conformance runs. A thread without a ring makes the
        // call (cm's connector does the same, rdma_connector.cc).
        int rc = 0, err = 0;
        if (state->b->verbs != nullptr &&
            state->b->verbs->device->transport_type == IBV_TRANSPORT_IWARP) {
          std::thread([&] {
            rc = rdma_connect(state->b, &p);
            err = errno;
          }).join();
        } else {
          rc = rdma_connect(state->b, &p);
          err = errno;
        }
        if (rc != 0) return CmError(err, "rdma_connect", stage);
        break;
      }
      case RDMA_CM_EVENT_CONNECT_REQUEST: {
        if (state->a != nullptr) {
          // Not ours (someone else found the port): refuse it.
          state->extra.push_back(id);
          rdma_reject(id, nullptr, 0);
          break;
        }
        state->a = id;
        stage = "accepting on " + dst;
        if (auto s = set_ack_timeout(state->a, init_a.timeout); !s.ok()) {
          return s;
        }
        auto qp = CreateCmQp(state->a, pd_a, init_a, state, "a");
        if (!qp.ok()) return qp.status();
        qp_a = std::move(*qp);
        rdma_conn_param p = conn_param(init_b.retry_cnt, init_b.rnr_retry);
        if (rdma_accept(state->a, &p) != 0) {
          const int err = errno;
          return CmError(err, "rdma_accept", stage);
        }
        state->a_accepted = true;
        break;
      }
      case RDMA_CM_EVENT_ESTABLISHED:
        if (id == state->a) est_a = true;
        if (id == state->b) est_b = true;
        stage = "waiting for ESTABLISHED on the other side";
        break;
      case RDMA_CM_EVENT_ADDR_ERROR:
      case RDMA_CM_EVENT_ROUTE_ERROR:
      case RDMA_CM_EVENT_CONNECT_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE:
      case RDMA_CM_EVENT_REJECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_ADDR_CHANGE:
      case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      default: {
        const int status = ev->status;
        std::string detail;
        if (type == RDMA_CM_EVENT_REJECTED) {
          detail = absl::StrFormat("reject reason %d", status);
        } else if (status < 0) {
          detail =
              absl::StrFormat("%s (status %d)", std::strerror(-status), status);
        } else {
          detail = absl::StrFormat("status %d", status);
        }
        const char* side = id == state->a   ? "a (passive)"
                           : id == state->b ? "b (active)"
                                            : "listener";
        auto code = type == RDMA_CM_EVENT_REJECTED ||
                            type == RDMA_CM_EVENT_UNREACHABLE ||
                            type == RDMA_CM_EVENT_CONNECT_ERROR
                        ? absl::StatusCode::kUnavailable
                        : absl::StatusCode::kFailedPrecondition;
        return absl::Status(
            code, absl::StrFormat(
                      "CreateConnectedPair: rdma_cm event %s on side %s while "
                      "%s: %s (listen %s [%s] on %s, active side on %s)",
                      rdma_event_str(type), side, stage, detail, dst,
                      addrs.origin, dev_a.name, dev_b.name));
      }
    }
  }

  // IB CM connects with min_rnr_timer 0 (655 ms): set what was asked.
  if (auto s = FinishEstablished(*qp_a, init_a); !s.ok()) return s;
  if (auto s = FinishEstablished(*qp_b, init_b); !s.ok()) return s;
  for (VerbsQp* qp : {qp_a.get(), qp_b.get()}) {
    if (ibv_qp_state st = qp->state(); st != IBV_QPS_RTS) {
      return absl::InternalError(absl::StrFormat(
          "CreateConnectedPair: QP 0x%x is in state %d, not RTS, after "
          "ESTABLISHED",
          qp->qp_num(), static_cast<int>(st)));
    }
  }
  close_on_failure.state = nullptr;  // connected
  QpPair pair;
  pair.a = std::move(qp_a);
  pair.b = std::move(qp_b);
  pair.keepalive = std::move(state);
  return pair;
}

}  // namespace coverbs::transport::verbs_internal
