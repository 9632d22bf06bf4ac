// Connection establishment for both providers.
//
// verbs: rdma_cm (resolve address, resolve route, connect / listen, accept),
//   every event through the Context's CmEventChannel.
// soft:  the same steps over a TCP connection made on the reactor: the
//   connector sends a request frame carrying the handshake, the listener
//   answers with an accept frame (its handshake) or a reject frame (the
//   reason); then the socket is handed to the soft QPs, whose own wire
//   protocol starts right after the frames.
//   Frame: u32 magic "CVBS", u8 kind (1 request, 2 accept, 3 reject),
//   u8 pad, u16 length, then `length` bytes (<= kMaxFrame).
#include "cm/listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/context_shared.h"
#include "core/timeout.h"
#include "transport/cm_trace.h"
#include "transport/rdma_cm_events.h"
#include "transport/soft/soft_provider.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::cm {

using transport::rdma_cm::CmEvent;
using transport::rdma_cm::CmId;

namespace {

constexpr uint32_t kFrameMagic = 0x53425643;  // "CVBS"
constexpr uint8_t kFrameRequest = 1, kFrameAccept = 2, kFrameReject = 3;
constexpr size_t kFrameHeader = 8;
constexpr size_t kMaxFrame = 512;

bool IsSoft(const Context& ctx) {
  return ctx.device().caps().provider == "soft";
}

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address,
                                         uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  std::string a = address == "localhost" ? "127.0.0.1" : address;
  if (a.empty()) a = "0.0.0.0";
  if (inet_pton(AF_INET, a.c_str(), &sa.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", address, "' is not a numeric IPv4 address (coverbs resolves no "
        "host names)"));
  }
  return sa;
}

std::string Endpoint(const std::string& a, uint16_t p) {
  return absl::StrCat(a, ":", p);
}

transport::QpInit InitFor(Context& ctx, const transport::QpOptions& o) {
  transport::QpInit i;
  i.send_cq = ctx.cq().provider();
  i.recv_cq = ctx.cq().provider();
  i.srq = o.srq;
  i.max_send_wr = o.max_send_wr;
  i.max_recv_wr = o.max_recv_wr;
  i.max_send_sge = o.max_send_sge;
  i.max_recv_sge = o.max_recv_sge;
  i.max_inline_data =
      std::min(o.max_inline_data, ctx.device().caps().max_inline_data);
  i.rnr_retry = o.rnr_retry;
  i.min_rnr_timer = o.min_rnr_timer;
  i.retry_cnt = o.retry_cnt;
  i.timeout = o.timeout;
  return i;
}

struct ConnectArgs {
  std::string address;
  uint16_t port = 0;
  ConnectOptions options;
};

// --- Soft: non-blocking socket helpers on the reactor.

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

Task<absl::Status> WaitIo(int fd, uint32_t events, absl::Time deadline) {
  auto wait = [](int fd, uint32_t ev) -> Task<absl::Status> {
    auto r = co_await Reactor::Current()->WaitFd(fd, ev);
    co_return r.status();
  };
  absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) {
    co_return absl::DeadlineExceededError("timed out");
  }
  co_return co_await WithTimeout(wait(fd, events), left);
}

Task<absl::Status> WriteAll(int fd, const std::string& data,
                            absl::Time deadline) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      absl::Status s = co_await WaitIo(fd, POLLOUT, deadline);
      if (!s.ok()) co_return s;
      continue;
    }
    co_return absl::UnavailableError(
        absl::StrCat("send failed: ", strerror(errno)));
  }
  co_return absl::OkStatus();
}

// Reads exactly `n` bytes: never more, because the soft QP's wire protocol
// follows the frames on the same socket.
Task<absl::Status> ReadExact(int fd, char* buf, size_t n, absl::Time deadline) {
  size_t off = 0;
  while (off < n) {
    ssize_t r = recv(fd, buf + off, n - off, 0);
    if (r > 0) {
      off += r;
      continue;
    }
    if (r == 0) {
      co_return absl::UnavailableError("the peer closed the connection");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      absl::Status s = co_await WaitIo(fd, POLLIN, deadline);
      if (!s.ok()) co_return s;
      continue;
    }
    co_return absl::UnavailableError(
        absl::StrCat("recv failed: ", strerror(errno)));
  }
  co_return absl::OkStatus();
}

std::string Frame(uint8_t kind, const std::string& body) {
  std::string out(kFrameHeader + body.size(), '\0');
  std::memcpy(out.data(), &kFrameMagic, 4);
  out[4] = static_cast<char>(kind);
  uint16_t len = static_cast<uint16_t>(body.size());
  std::memcpy(out.data() + 6, &len, 2);
  std::memcpy(out.data() + kFrameHeader, body.data(), body.size());
  return out;
}

struct FrameIn {
  uint8_t kind = 0;
  std::string body;
};

Task<absl::StatusOr<FrameIn>> ReadFrame(int fd, absl::Time deadline) {
  char hdr[kFrameHeader];
  absl::Status s = co_await ReadExact(fd, hdr, kFrameHeader, deadline);
  if (!s.ok()) co_return s;
  uint32_t magic;
  uint16_t len;
  std::memcpy(&magic, hdr, 4);
  std::memcpy(&len, hdr + 6, 2);
  if (magic != kFrameMagic) {
    co_return absl::InvalidArgumentError(absl::StrFormat(
        "setup frame with bad magic 0x%08x: not a coverbs soft peer", magic));
  }
  if (len > kMaxFrame) {
    co_return absl::InvalidArgumentError(
        absl::StrFormat("setup frame of %d bytes (max %d)", len, kMaxFrame));
  }
  FrameIn f;
  f.kind = static_cast<uint8_t>(hdr[4]);
  f.body.resize(len);
  s = co_await ReadExact(fd, f.body.data(), len, deadline);
  if (!s.ok()) co_return s;
  co_return f;
}

std::string PeerOf(int fd, uint16_t* port) {
  sockaddr_in sa{};
  socklen_t l = sizeof(sa);
  char buf[INET_ADDRSTRLEN] = "?";
  *port = 0;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &l) == 0) {
    inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof(buf));
    *port = ntohs(sa.sin_port);
  }
  return buf;
}

class SoftLink final : public transport::ConnectionLink {
 public:
  SoftLink(transport::QueuePair* qp, std::string describe)
      : qp_(qp), describe_(std::move(describe)) {}
  // The soft QP owns the socket: moving it to error closes the socket, and
  // the peer's QP errors out and flushes.
  void Disconnect() override {
    if (!qp_->in_error()) qp_->SetError("disconnect").IgnoreError();
  }
  Task<absl::Status> WaitDown(absl::Duration) override {
    co_return absl::OkStatus();
  }
  void OnDown(std::function<void(absl::Status)>) override {}
  std::string Describe() const override { return describe_; }

 private:
  transport::QueuePair* qp_;
  std::string describe_;
};

// Builds the QP and the (unstarted) connection; receives are posted before
// anything is sent to the peer.
absl::StatusOr<std::unique_ptr<Connection>> NewSoftConnection(
    Context& ctx, const ConnectionOptions& o, bool active) {
  auto qos = Connection::QpOptionsFor(ctx, o);
  if (!qos.ok()) return qos.status();
  const transport::QpOptions& qo = *qos;
  auto pqp = transport::soft::CreateQp(ctx.pd().provider(), InitFor(ctx, qo));
  if (!pqp.ok()) return pqp.status();
  auto qp = transport::QueuePair::Adopt(std::move(*pqp), ctx.cq(), qo);
  if (!qp.ok()) return qp.status();
  return Connection::CreateUnstarted(ctx, std::move(*qp), o, active);
}

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// The connecting side's private data: its handshake with the application's
// bytes (or, in tests, raw bytes standing in for it).
absl::StatusOr<std::string> PrivateData(const Connection& conn,
                                        const ConnectOptions& o) {
  if (!o.raw_private_data_for_test.empty()) return o.raw_private_data_for_test;
  Handshake h = conn.LocalHandshake();
  h.app_data = o.app_data;
  return EncodeHandshake(h);
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> SoftConnect(
    Context& ctx, std::unique_ptr<ConnectArgs> args) {
  const std::string& address = args->address;
  const uint16_t port = args->port;
  const ConnectOptions& o = args->options;
  std::string ep = Endpoint(address, port);
  std::string where = absl::StrCat("connect to ", ep);
  auto sa = ParseAddress(address, port);
  if (!sa.ok()) co_return Annotate(sa.status(), where);
  absl::Time deadline = absl::Now() + o.connect_timeout;
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": socket: ", strerror(errno)));
  }
  transport::soft::ConfigureSocket(fd.get());
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&*sa), sizeof(*sa)) !=
          0 &&
      errno != EINPROGRESS) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": unreachable: ", strerror(errno)));
  }
  absl::Status s = co_await WaitIo(fd.get(), POLLOUT, deadline);
  if (!s.ok()) co_return Annotate(s, absl::StrCat(where, ": TCP connect"));
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    co_return absl::UnavailableError(absl::StrCat(
        where, ": unreachable: ", strerror(err),
        err == ECONNREFUSED ? " (no listener on that port)" : ""));
  }
  auto conn = NewSoftConnection(ctx, o.connection, /*active=*/true);
  if (!conn.ok()) co_return Annotate(conn.status(), where);
  auto pd = PrivateData(**conn, o);
  if (!pd.ok()) co_return Annotate(pd.status(), where);
  s = co_await WriteAll(fd.get(), Frame(kFrameRequest, *pd), deadline);
  if (!s.ok()) co_return Annotate(s, absl::StrCat(where, ": sending the request"));
  auto reply = co_await ReadFrame(fd.get(), deadline);
  if (!reply.ok()) {
    co_return Annotate(reply.status(),
                       absl::StrCat(where, ": waiting for the answer"));
  }
  if (reply->kind == kFrameReject) {
    std::string reason = DecodeReject(Bytes(reply->body));
    co_return absl::PermissionDeniedError(absl::StrCat(
        where, ": rejected by the peer: ",
        reason.empty() ? "(no reason given)" : reason));
  }
  if (reply->kind != kFrameAccept) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        where, ": unexpected setup frame kind ", reply->kind));
  }
  auto peer_h = DecodeHandshake(Bytes(reply->body));
  if (!peer_h.ok()) {
    co_return Annotate(peer_h.status(),
                       absl::StrCat(where, ": the peer's handshake"));
  }
  absl::Status cs = transport::soft::ConnectQp((*conn)->qp().provider(),
                                               fd.release());
  if (!cs.ok()) co_return Annotate(cs, where);
  PeerInfo peer;
  peer.address = address;
  peer.port = port;
  peer.handshake = *std::move(peer_h);
  cs = (*conn)->Start(
      std::move(peer),
      std::make_unique<SoftLink>(&(*conn)->qp(), absl::StrCat("soft -> ", ep)));
  if (!cs.ok()) co_return cs;
  co_return std::move(*conn);
}

// --- Verbs.

absl::Status EventError(const CmEvent& e, const std::string& where,
                        const char* step) {
  switch (e.type) {
    case RDMA_CM_EVENT_ADDR_ERROR:
      return absl::UnavailableError(absl::StrFormat(
          "%s: address resolution failed (%s, status %d)", where,
          rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return absl::UnavailableError(absl::StrFormat(
          "%s: route resolution failed (%s, status %d)", where,
          rdma_event_str(e.type), e.status));
    case RDMA_CM_EVENT_UNREACHABLE:
      return absl::UnavailableError(absl::StrFormat(
          "%s: unreachable (%s, status %d)", where, rdma_event_str(e.type),
          e.status));
    case RDMA_CM_EVENT_REJECTED: {
      std::string reason =
          DecodeReject(Bytes(e.private_data));
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
      return absl::UnavailableError(absl::StrFormat(
          "%s: connection error (%s, status %d)", where,
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
    co_return absl::Status(ev.status().code(),
                           absl::StrCat(where, ": ", step, ": ",
                                        ev.status().message()));
  }
  if (ev->type != want) co_return EventError(*ev, where, step);
  co_return std::move(*ev);
}

rdma_conn_param ConnParam(Context& ctx, const std::string& pd) {
  rdma_conn_param p{};
  p.private_data = pd.data();
  p.private_data_len = static_cast<uint8_t>(pd.size());
  uint32_t rd = ctx.device().caps().max_qp_rd_atom;
  p.responder_resources = static_cast<uint8_t>(std::min<uint32_t>(rd ? rd : 1, 16));
  p.initiator_depth = p.responder_resources;
  p.retry_count = 7;
  p.rnr_retry_count = 7;
  return p;
}

absl::StatusOr<std::unique_ptr<Connection>> NewVerbsConnection(
    Context& ctx, const std::shared_ptr<CmId>& id, const ConnectionOptions& o,
    bool active, transport::QpInit* init_out) {
  if (id->id()->verbs != transport::VerbsContext(*ctx.device().provider())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the address is on RDMA device ",
        id->id()->verbs ? ibv_get_device_name(id->id()->verbs->device) : "?",
        ", not on the context's device ", ctx.device().name()));
  }
  auto qos = Connection::QpOptionsFor(ctx, o);
  if (!qos.ok()) return qos.status();
  const transport::QpOptions& qo = *qos;
  *init_out = InitFor(ctx, qo);
  auto pqp = transport::CreateQpOnCmId(id->id(), ctx.pd().provider(),
                                       *init_out, id);
  if (!pqp.ok()) return pqp.status();
  auto qp = transport::QueuePair::Adopt(std::move(*pqp), ctx.cq(), qo, id);
  if (!qp.ok()) return qp.status();
  return Connection::CreateUnstarted(ctx, std::move(*qp), o, active);
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

Task<absl::StatusOr<std::unique_ptr<Connection>>> VerbsConnect(
    Context& ctx, std::unique_ptr<ConnectArgs> args) {
  const std::string& address = args->address;
  const uint16_t port = args->port;
  const ConnectOptions& o = args->options;
  std::string ep = Endpoint(address, port);
  std::string where = absl::StrCat("connect to ", ep);
  auto sa = ParseAddress(address, port);
  if (!sa.ok()) co_return Annotate(sa.status(), where);
  auto ch = ctx.cm_events();
  if (!ch.ok()) co_return Annotate(ch.status(), where);
  std::shared_ptr<CmId> id;
  std::unique_ptr<Connection> conn;
  transport::QpInit init;
  absl::StatusOr<CmEvent> ev;
  // iWARP: an EADDRNOTAVAIL from rdma_connect (the TCP source port rdma_cm
  // chose is still taken) is retried with a fresh id and QP after a
  // growing, jittered pause until the connect deadline. A refusal fails at
  // once, as REJECTED does on IB/RoCE. (Refusals of a live listener and
  // most EADDRNOTAVAILs came from calling rdma_connect on the reactor
  // thread; see OffReactorConnect.)
  const absl::Time connect_deadline = absl::Now() + o.connect_timeout;
  uint64_t jitter = reinterpret_cast<uintptr_t>(args.get()) >> 4;
  for (int attempt = 0;; ++attempt) {
    conn.reset();  // the QP before the id it was created on
    id.reset();
    auto created = CmId::Create(*ch);
    if (!created.ok()) co_return Annotate(created.status(), where);
    id = *std::move(created);
    id->set_destroy_in_background(true);
    int ms = static_cast<int>(absl::ToInt64Milliseconds(o.resolve_timeout));
    if (rdma_resolve_addr(id->id(), nullptr, reinterpret_cast<sockaddr*>(&*sa),
                          std::max(ms, 1)) != 0) {
      co_return absl::UnavailableError(absl::StrCat(
          where, ": address resolution failed: ", strerror(errno)));
    }
    ev = co_await Expect(*id, RDMA_CM_EVENT_ADDR_RESOLVED, o.resolve_timeout,
                         where, "address resolution");
    if (!ev.ok()) co_return ev.status();
    if (rdma_resolve_route(id->id(), std::max(ms, 1)) != 0) {
      co_return absl::UnavailableError(absl::StrCat(
          where, ": route resolution failed: ", strerror(errno)));
    }
    ev = co_await Expect(*id, RDMA_CM_EVENT_ROUTE_RESOLVED, o.resolve_timeout,
                         where, "route resolution");
    if (!ev.ok()) co_return ev.status();
    id->set_destroy_in_background(false);
    auto c = NewVerbsConnection(ctx, id, o.connection, true, &init);
    if (!c.ok()) co_return Annotate(c.status(), where);
    conn = *std::move(c);
    auto pd = PrivateData(*conn, o);
    if (!pd.ok()) co_return Annotate(pd.status(), where);
    rdma_conn_param param = ConnParam(ctx, *pd);
    int rc = 0, err = 0;
    if (ctx.device().caps().transport == transport::TransportKind::kIWarp) {
      // See OffReactorConnect. The id, the QP and the private data must
      // outlive the call: past the deadline (or when the Connect is
      // cancelled) the call is interrupted and joined, never left behind.
      const int sig = ConnectInterruptSignal();
      auto call = std::make_shared<OffReactorConnect>();
      JoinOnExit helper;
      helper.thread = std::thread(
          [call, r = Reactor::Current(), raw = id->id(), param]() mutable {
            call->rc = rdma_connect(raw, &param);
            call->err = errno;
            r->Post([call] {
              call->done = true;
              call->finished.Set();
            });
          });
      absl::Duration left = connect_deadline - absl::Now();
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
      rc = call->rc;
      err = call->err;
      if (rc != 0 && interrupted && err == EINTR) {
        co_return absl::Status(
            waited.code() == absl::StatusCode::kCancelled
                ? absl::StatusCode::kCancelled
                : absl::StatusCode::kDeadlineExceeded,
            absl::StrCat(where, ": rdma_connect did not finish within ",
                         absl::FormatDuration(o.connect_timeout),
                         " (the TCP connection was not answered); "
                         "interrupted"));
      }
    } else {
      rc = rdma_connect(id->id(), &param);
      err = errno;
    }
    if (rc == 0) break;
    COVERBS_CM_TRACE(where, ": rdma_connect attempt ", attempt, " on id ",
                     absl::Hex(reinterpret_cast<uintptr_t>(id->id())), ": ", strerror(err));
    if (err == EADDRNOTAVAIL) {
      int base = std::min(10 << std::min(attempt, 4), 160);
      jitter = jitter * 6364136223846793005ull + 1442695040888963407ull;
      absl::Duration pause =
          absl::Milliseconds(base + static_cast<int>((jitter >> 33) % base));
      if (absl::Now() + pause < connect_deadline) {
        absl::Status slept = co_await Reactor::Current()->Sleep(pause);
        if (!slept.ok()) co_return Annotate(slept, where);
        continue;
      }
    }
    co_return absl::UnavailableError(absl::StrCat(
        where, ": rdma_connect failed: ", strerror(err),
        attempt > 0 ? absl::StrCat(" (", attempt + 1, " attempts within ",
                                   absl::FormatDuration(o.connect_timeout),
                                   ")")
                    : ""));
  }
  ev = co_await Expect(*id, RDMA_CM_EVENT_ESTABLISHED, o.connect_timeout,
                       where, "connecting");
  if (!ev.ok()) co_return ev.status();
  auto peer_h = DecodeHandshake(Bytes(ev->private_data));
  if (!peer_h.ok()) {
    co_return Annotate(peer_h.status(),
                       absl::StrCat(where, ": the peer's handshake"));
  }
  absl::Status s = transport::FinishEstablishedQp(conn->qp().provider(), init);
  if (!s.ok()) co_return Annotate(s, where);
  id->SetEstablished(absl::StrCat(ctx.device().name(), " -> ", ep));
  PeerInfo peer;
  peer.address = address;
  peer.port = port;
  peer.handshake = *std::move(peer_h);
  s = conn->Start(std::move(peer), transport::rdma_cm::MakeVerbsLink(id));
  if (!s.ok()) co_return s;
  co_return std::move(conn);
}

}  // namespace

// ---------------------------------------------------------------------------

// Not a coroutine and taking no class by value, so callers never create
// by-value temporaries inside their co_await expressions (gcc 12 handles
// some of those wrongly); the arguments reach the coroutine frame in one
// heap object.
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Context& ctx, const std::string& address, uint16_t port,
    const ConnectOptions& options) {
  auto args = std::make_unique<ConnectArgs>();
  args->address = address;
  args->port = port;
  args->options = options;
  if (IsSoft(ctx)) return SoftConnect(ctx, std::move(args));
  return VerbsConnect(ctx, std::move(args));
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Context& ctx, const std::string& address, uint16_t port) {
  static const ConnectOptions kDefaults;
  return Connect(ctx, address, port, kDefaults);
}

struct ConnectRequest::State {
  Context* listener_ctx = nullptr;
  Listener::Stats* stats = nullptr;
  std::weak_ptr<bool> listener_alive;
  ListenerOptions options;
  PeerInfo peer;
  bool decided = false;
  Fd fd;                    // soft
  std::shared_ptr<CmId> id;  // verbs
  absl::Time deadline;
};

struct Listener::State {
  Context* ctx = nullptr;
  std::string address;
  uint16_t port = 0;
  ListenerOptions options;
  bool closed = false;
  Stats stats;
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
  std::stop_source stop;
  Fd fd;                    // soft
  std::shared_ptr<CmId> id;  // verbs
};

namespace {

void CountReject(ConnectRequest::State& st, std::string_view reason) {
  if (!st.listener_alive.expired() && st.stats != nullptr) {
    ++st.stats->rejected;
    st.stats->last_reject_reason = std::string(reason);
  }
}

absl::Status RejectState(ConnectRequest::State& st, std::string_view reason) {
  st.decided = true;
  CountReject(st, reason);
  std::string payload = EncodeReject(reason);
  if (st.id != nullptr) {
    if (rdma_reject(st.id->id(), payload.data(),
                    static_cast<uint8_t>(payload.size())) != 0) {
      return absl::UnavailableError(
          absl::StrCat("rdma_reject failed: ", strerror(errno)));
    }
    st.id.reset();
    return absl::OkStatus();
  }
  if (st.fd.get() >= 0) {
    // Small and the socket is fresh: a non-blocking send completes.
    std::string f = Frame(kFrameReject, payload);
    ssize_t n = send(st.fd.get(), f.data(), f.size(), MSG_NOSIGNAL);
    st.fd.reset();
    if (n != static_cast<ssize_t>(f.size())) {
      return absl::UnavailableError("sending the reject failed");
    }
  }
  return absl::OkStatus();
}

}  // namespace

ConnectRequest::ConnectRequest(std::unique_ptr<State> s)
    : state_(std::move(s)) {}

ConnectRequest::~ConnectRequest() {
  if (state_ != nullptr && !state_->decided) {
    RejectState(*state_, "not accepted").IgnoreError();
  }
}

const PeerInfo& ConnectRequest::peer() const { return state_->peer; }

absl::Status ConnectRequest::Reject(std::string_view reason) {
  if (state_->decided) {
    return absl::FailedPreconditionError("connect request already decided");
  }
  return RejectState(*state_, reason);
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectRequest::Accept(
    Context& ctx) {
  State& st = *state_;
  std::string where = absl::StrCat("accept from ", Endpoint(st.peer.address,
                                                            st.peer.port));
  if (st.decided) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(where, ": request already decided"));
  }
  st.decided = true;
  if (&ctx.device() != &st.listener_ctx->device()) {
    co_return absl::InvalidArgumentError(
        absl::StrCat(where, ": the target context uses another device"));
  }
  absl::Time deadline = absl::Now() + st.options.accept_timeout;
  if (st.fd.get() >= 0) {
    auto conn = NewSoftConnection(ctx, st.options.connection, false);
    if (!conn.ok()) {
      st.decided = false;
      RejectState(st, std::string(conn.status().message())).IgnoreError();
      co_return Annotate(conn.status(), where);
    }
    Handshake h = (*conn)->LocalHandshake();
    auto enc = EncodeHandshake(h);
    if (!enc.ok()) co_return Annotate(enc.status(), where);
    absl::Status s =
        co_await WriteAll(st.fd.get(), Frame(kFrameAccept, *enc), deadline);
    if (!s.ok()) co_return Annotate(s, absl::StrCat(where, ": answering"));
    s = transport::soft::ConnectQp((*conn)->qp().provider(), st.fd.release());
    if (!s.ok()) co_return Annotate(s, where);
    s = (*conn)->Start(st.peer, std::make_unique<SoftLink>(
                                    &(*conn)->qp(),
                                    absl::StrCat("soft <- ", st.peer.address,
                                                 ":", st.peer.port)));
    if (!s.ok()) co_return s;
    if (!st.listener_alive.expired()) ++st.stats->accepted;
    co_return std::move(*conn);
  }
  // verbs
  auto ch = ctx.cm_events();
  if (!ch.ok()) co_return Annotate(ch.status(), where);
  absl::Status s = st.id->Migrate(*ch);
  if (!s.ok()) co_return Annotate(s, where);
  transport::QpInit init;
  auto conn = NewVerbsConnection(ctx, st.id, st.options.connection, false,
                                 &init);
  if (!conn.ok()) {
    st.decided = false;
    RejectState(st, std::string(conn.status().message())).IgnoreError();
    co_return Annotate(conn.status(), where);
  }
  Handshake h = (*conn)->LocalHandshake();
  auto enc = EncodeHandshake(h);
  if (!enc.ok()) co_return Annotate(enc.status(), where);
  rdma_conn_param param = ConnParam(ctx, *enc);
  if (rdma_accept(st.id->id(), &param) != 0) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": rdma_accept failed: ", strerror(errno)));
  }
  auto ev = co_await Expect(*st.id, RDMA_CM_EVENT_ESTABLISHED,
                            deadline - absl::Now(), where, "accepting");
  if (!ev.ok()) co_return ev.status();
  s = transport::FinishEstablishedQp((*conn)->qp().provider(), init);
  if (!s.ok()) co_return Annotate(s, where);
  st.id->SetEstablished(absl::StrCat(ctx.device().name(), " <- ",
                                     st.peer.address, ":", st.peer.port));
  s = (*conn)->Start(st.peer, transport::rdma_cm::MakeVerbsLink(st.id));
  if (!s.ok()) co_return s;
  if (!st.listener_alive.expired()) ++st.stats->accepted;
  co_return std::move(*conn);
}

// ---------------------------------------------------------------------------

Listener::Listener(std::unique_ptr<State> s) : state_(std::move(s)) {}
Listener::~Listener() { Close(); }

uint16_t Listener::port() const { return state_->port; }
const std::string& Listener::address() const { return state_->address; }
const Listener::Stats& Listener::stats() const { return state_->stats; }

void Listener::Close() {
  if (state_->closed) return;
  state_->closed = true;
  state_->stop.request_stop();
  state_->fd.reset();
  state_->id.reset();
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Create(
    Context& ctx, std::string address, uint16_t port,
    ListenerOptions options) {
  auto st = std::make_unique<State>();
  st->ctx = &ctx;
  st->address = address;
  st->options = std::move(options);
  std::string where = absl::StrCat("listen on ", Endpoint(address, port));
  auto sa = ParseAddress(address, port);
  if (!sa.ok()) return Annotate(sa.status(), where);
  if (IsSoft(ctx)) {
    Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": socket: ", strerror(errno)));
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&*sa), sizeof(*sa)) !=
        0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": bind: ", strerror(errno)));
    }
    if (listen(fd.get(), st->options.backlog) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": listen: ", strerror(errno)));
    }
    sockaddr_in bound{};
    socklen_t l = sizeof(bound);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &l);
    st->port = ntohs(bound.sin_port);
    st->fd = std::move(fd);
  } else {
    auto ch = ctx.cm_events();
    if (!ch.ok()) return Annotate(ch.status(), where);
    auto id = CmId::Create(*ch);
    if (!id.ok()) return Annotate(id.status(), where);
    if (rdma_bind_addr((*id)->id(), reinterpret_cast<sockaddr*>(&*sa)) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": rdma_bind_addr: ", strerror(errno)));
    }
    if (rdma_listen((*id)->id(), st->options.backlog) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": rdma_listen: ", strerror(errno)));
    }
    st->port = ntohs(rdma_get_src_port((*id)->id()));
    st->id = *std::move(id);
  }
  return std::unique_ptr<Listener>(new Listener(std::move(st)));
}

Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Listener::Next() {
  State& st = *state_;
  std::string where = absl::StrCat("listener ", Endpoint(st.address, st.port));
  for (;;) {
    if (st.closed) {
      co_return absl::CancelledError(absl::StrCat(where, ": closed"));
    }
    auto req = std::make_unique<ConnectRequest::State>();
    req->listener_ctx = st.ctx;
    req->stats = &st.stats;
    req->listener_alive = st.alive;
    req->options = st.options;
    std::string private_data;
    if (st.fd.get() >= 0) {
      auto wait = [](int fd) -> Task<absl::Status> {
        auto r = co_await Reactor::Current()->WaitFd(fd, POLLIN);
        co_return r.status();
      };
      int c = accept4(st.fd.get(), nullptr, nullptr,
                      SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
            errno == ECONNABORTED) {
          // Bounded waits so that Close() is noticed promptly.
          absl::Status s =
              co_await WithTimeout(wait(st.fd.get()), absl::Milliseconds(100));
          if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) {
            co_return Annotate(s, where);
          }
          continue;
        }
        co_return absl::UnavailableError(
            absl::StrCat(where, ": accept: ", strerror(errno)));
      }
      req->fd = Fd(c);
      transport::soft::ConfigureSocket(c);
      req->peer.address = PeerOf(c, &req->peer.port);
      // A peer that connects and never sends its request is dropped after
      // accept_timeout; others keep being served meanwhile only after this
      // one -- requests are small and come at once from coverbs peers.
      auto f = co_await ReadFrame(c, absl::Now() + st.options.accept_timeout);
      if (!f.ok() || f->kind != kFrameRequest) {
        ++st.stats.requests;
        ++st.stats.rejected;
        st.stats.last_reject_reason =
            f.ok() ? "unexpected setup frame" : std::string(f.status().message());
        continue;
      }
      private_data = std::move(f->body);
    } else {
      std::shared_ptr<CmId> id = st.id;  // Close() may drop st.id meanwhile
      auto ev = co_await id->Next(absl::Milliseconds(100));
      if (!ev.ok() && ev.status().code() == absl::StatusCode::kDeadlineExceeded) {
        continue;
      }
      if (!ev.ok()) co_return Annotate(ev.status(), where);
      if (ev->type != RDMA_CM_EVENT_CONNECT_REQUEST || ev->request == nullptr) {
        if (ev->type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
          co_return absl::AbortedError(
              absl::StrCat(where, ": the RDMA device was removed"));
        }
        continue;
      }
      req->id = std::move(ev->request);
      req->peer.address = ev->peer_addr;
      req->peer.port = ev->peer_port;
      private_data = std::move(ev->private_data);
    }
    ++st.stats.requests;
    auto h = DecodeHandshake(Bytes(private_data));
    if (!h.ok()) {
      RejectState(*req, std::string(h.status().message())).IgnoreError();
      continue;
    }
    req->peer.handshake = *std::move(h);
    co_return std::unique_ptr<ConnectRequest>(
        new ConnectRequest(std::move(req)));
  }
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> Listener::Accept() {
  for (;;) {
    auto req = co_await Next();
    if (!req.ok()) co_return req.status();
    if (state_->options.admit) {
      absl::Status s = state_->options.admit((*req)->peer());
      if (!s.ok()) {
        (*req)->Reject(std::string(s.message())).IgnoreError();
        continue;
      }
    }
    auto conn = co_await (*req)->Accept(*state_->ctx);
    // One failed setup (the peer gave up, say) does not stop the listener.
    if (!conn.ok()) continue;
    co_return conn;
  }
}

}  // namespace coverbs::cm
