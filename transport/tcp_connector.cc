#include "transport/tcp_connector.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/timeout.h"
#include "transport/connector_util.h"
#include "transport/soft/soft_provider.h"

namespace coverbs::transport {
namespace {

using connector_util::Annotate;
using connector_util::Bytes;
using connector_util::Endpoint;
using connector_util::ListenAddress;
using connector_util::Resolve;
using connector_util::SocketAddress;

constexpr uint32_t kFrameMagic = 0x53425643;  // "CVBS"
constexpr uint8_t kFrameRequest = 1, kFrameAccept = 2, kFrameReject = 3;
constexpr size_t kFrameHeader = 8;
constexpr size_t kMaxFrame = 512;

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

// The peer's numeric address and port (an IPv4 peer of an IPv6 listener
// as "::ffff:a.b.c.d").
std::string PeerOf(int fd, uint16_t* port) {
  SocketAddress sa;
  socklen_t l = sizeof(sa.storage);
  *port = 0;
  if (getpeername(fd, sa.get(), &l) != 0) return "?";
  *port = ntohs(sa.family() == AF_INET6
                    ? reinterpret_cast<sockaddr_in6*>(&sa.storage)->sin6_port
                    : reinterpret_cast<sockaddr_in*>(&sa.storage)->sin_port);
  return sa.Numeric();
}

class SoftLink final : public ConnectionLink {
 public:
  SoftLink(QueuePair* qp, std::string describe)
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
  QueuePair* qp_;
  std::string describe_;
};

// Creates the (unconnected) QP and hands it to `setup`; yields the private
// data to send and the QP to connect.
absl::StatusOr<std::string> SetUpQp(QpSetup& setup, QueuePair** qp_out) {
  auto pqp =
      soft::CreateQp(setup.pd().provider(), connector_util::InitFor(setup));
  if (!pqp.ok()) return pqp.status();
  auto qp = QueuePair::Adopt(std::move(*pqp), setup.cq(), setup.qp_options(),
                             nullptr, &setup.recv_cq());
  if (!qp.ok()) return qp.status();
  *qp_out = qp->get();
  return setup.Adopt(*std::move(qp));
}

// The TCP connection of a connect, up to the moment frames can flow.
Task<absl::StatusOr<Fd>> TcpConnect(const SocketAddress& sa,
                                    const std::string& where,
                                    absl::Time deadline) {
  Fd fd(socket(sa.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": socket: ", strerror(errno)));
  }
  soft::ConfigureSocket(fd.get());
  if (connect(fd.get(), sa.get(), sa.length) != 0 && errno != EINPROGRESS) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": unreachable: ", strerror(errno)));
  }
  absl::Status s = co_await WaitIo(fd.get(), POLLOUT, deadline);
  if (!s.ok()) co_return Annotate(s, absl::StrCat(where, ": TCP connect"));
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    co_return absl::UnavailableError(
        absl::StrCat(where, ": unreachable: ", strerror(err),
                     err == ECONNREFUSED ? " (no listener on that port)" : ""));
  }
  co_return std::move(fd);
}

class TcpRequest final : public IncomingRequest {
 public:
  explicit TcpRequest(Fd fd) : fd_(std::move(fd)) {
    uint16_t port = 0;
    std::string address = PeerOf(fd_.get(), &port);
    set_peer(std::move(address), port);
  }

  Task<absl::StatusOr<std::string>> ReadPrivateData(
      absl::Time deadline) override {
    auto f = co_await ReadFrame(fd_.get(), deadline);
    if (!f.ok()) co_return f.status();
    if (f->kind != kFrameRequest) {
      co_return absl::InvalidArgumentError("unexpected setup frame");
    }
    co_return std::move(f->body);
  }

  absl::Status Reject(std::string_view reason) override {
    set_rejected(reason);
    if (fd_.get() < 0) return absl::OkStatus();
    // Small and the socket is fresh: a non-blocking send completes.
    std::string f = Frame(kFrameReject, EncodeReject(reason));
    ssize_t n = send(fd_.get(), f.data(), f.size(), MSG_NOSIGNAL);
    fd_.reset();
    if (n != static_cast<ssize_t>(f.size())) {
      return absl::UnavailableError("sending the reject failed");
    }
    return absl::OkStatus();
  }

  Task<absl::StatusOr<Established>> Accept(Connector&, QpSetup& setup,
                                           absl::Time deadline) override {
    std::string ep = Endpoint(peer_address(), peer_port());
    std::string where = absl::StrCat("accept from ", ep);
    QueuePair* qp = nullptr;
    auto pd = SetUpQp(setup, &qp);
    if (!pd.ok()) {
      Reject(std::string(pd.status().message())).IgnoreError();
      co_return Annotate(pd.status(), where);
    }
    absl::Status s =
        co_await WriteAll(fd_.get(), Frame(kFrameAccept, *pd), deadline);
    if (!s.ok()) co_return Annotate(s, absl::StrCat(where, ": answering"));
    s = soft::ConnectQp(qp->provider(), fd_.release());
    if (!s.ok()) co_return Annotate(s, where);
    Established e;
    e.link = std::make_unique<SoftLink>(qp, absl::StrCat("soft <- ", ep));
    co_return std::move(e);
  }

 private:
  Fd fd_;
};

class TcpEndpoint final : public PassiveEndpoint {
 public:
  TcpEndpoint(Fd fd, std::string address, uint16_t port)
      : fd_(std::move(fd)),
        spare_(open("/dev/null", O_RDONLY | O_CLOEXEC)),
        address_(std::move(address)),
        port_(port) {}

  uint16_t port() const override { return port_; }
  void Close() override {
    fd_.reset();
    spare_.reset();
  }

  Task<absl::StatusOr<std::unique_ptr<IncomingRequest>>> Next(
      absl::Duration wait) override {
    std::string where = absl::StrCat("listener ", Endpoint(address_, port_));
    auto readable = [](int fd) -> Task<absl::Status> {
      auto r = co_await Reactor::Current()->WaitFd(fd, POLLIN);
      co_return r.status();
    };
    for (;;) {
      if (fd_.get() < 0) {
        co_return absl::CancelledError(absl::StrCat(where, ": closed"));
      }
      int c =
          accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c >= 0) {
        soft::ConfigureSocket(c);
        co_return std::unique_ptr<IncomingRequest>(new TcpRequest(Fd(c)));
      }
      const int err = errno;
      if (err == EMFILE || err == ENFILE) {
        // Out of descriptors: the waiting connection would keep the
        // listening socket readable and its peer waiting for nothing. Give
        // up the spare descriptor to take it and close it at once (its
        // peer sees the connection closed), then keep the spare again.
        bool shed = false;
        if (spare_.get() >= 0) {
          spare_.reset();
          int c = accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
          if (c >= 0) {
            close(c);
            shed = true;
          }
          spare_ = Fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
        }
        co_return absl::ResourceExhaustedError(absl::StrCat(
            where, ": accept: ", strerror(err),
            shed ? " (a waiting connection was closed)" : ""));
      }
      if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR &&
          err != ECONNABORTED) {
        co_return absl::UnavailableError(
            absl::StrCat(where, ": accept: ", strerror(err)));
      }
      absl::Status s = co_await WithTimeout(readable(fd_.get()), wait);
      if (s.code() == absl::StatusCode::kDeadlineExceeded) co_return s;
      if (!s.ok()) co_return Annotate(s, where);
    }
  }

 private:
  Fd fd_;
  // Reserved for shedding a connection when the process is out of fds.
  Fd spare_;
  std::string address_;
  uint16_t port_;
};

class TcpConnector final : public Connector {
 public:
  Task<absl::StatusOr<Established>> Connect(const ConnectParams& params,
                                            QpSetup& setup) override {
    std::string ep = Endpoint(params.address, params.port);
    std::string where = absl::StrCat("connect to ", ep);
    auto addresses =
        co_await Resolve(params.address, params.port, params.resolve_timeout);
    if (!addresses.ok()) co_return Annotate(addresses.status(), where);
    absl::Time deadline = absl::Now() + params.connect_timeout;
    // Every address in turn, until one answers: "localhost" may name ::1
    // first while the server listens on 127.0.0.1 only.
    absl::StatusOr<Fd> fd = absl::UnknownError("no address");
    for (size_t i = 0; i < addresses->size(); ++i) {
      const SocketAddress& a = (*addresses)[i];
      const std::string at =
          addresses->size() == 1 && a.Numeric() == params.address
              ? where
              : absl::StrCat(where, " (", Endpoint(a.Numeric(), params.port),
                             ")");
      fd = co_await TcpConnect(a, at, deadline);
      if (fd.ok() || fd.status().code() != absl::StatusCode::kUnavailable) {
        break;
      }
    }
    if (!fd.ok()) co_return fd.status();
    QueuePair* qp = nullptr;
    auto pd = SetUpQp(setup, &qp);
    if (!pd.ok()) co_return Annotate(pd.status(), where);
    absl::Status s =
        co_await WriteAll(fd->get(), Frame(kFrameRequest, *pd), deadline);
    if (!s.ok()) {
      co_return Annotate(s, absl::StrCat(where, ": sending the request"));
    }
    auto reply = co_await ReadFrame(fd->get(), deadline);
    if (!reply.ok()) {
      co_return Annotate(reply.status(),
                         absl::StrCat(where, ": waiting for the answer"));
    }
    if (reply->kind == kFrameReject) {
      std::string reason = DecodeReject(Bytes(reply->body));
      co_return absl::PermissionDeniedError(
          absl::StrCat(where, ": rejected by the peer: ",
                       reason.empty() ? "(no reason given)" : reason));
    }
    if (reply->kind != kFrameAccept) {
      co_return absl::InvalidArgumentError(
          absl::StrCat(where, ": unexpected setup frame kind ", reply->kind));
    }
    s = soft::ConnectQp(qp->provider(), fd->release());
    if (!s.ok()) co_return Annotate(s, where);
    Established e;
    e.link = std::make_unique<SoftLink>(qp, absl::StrCat("soft -> ", ep));
    e.private_data = std::move(reply->body);
    co_return std::move(e);
  }

  absl::StatusOr<std::shared_ptr<PassiveEndpoint>> Listen(
      const std::string& address, uint16_t port, int backlog) override {
    std::string where = absl::StrCat("listen on ", Endpoint(address, port));
    auto sa = ListenAddress(address, port);
    if (!sa.ok()) return Annotate(sa.status(), where);
    Fd fd(socket(sa->family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": socket: ", strerror(errno)));
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd.get(), sa->get(), sa->length) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": bind: ", strerror(errno)));
    }
    if (listen(fd.get(), backlog) != 0) {
      return absl::UnavailableError(
          absl::StrCat(where, ": listen: ", strerror(errno)));
    }
    SocketAddress bound;
    socklen_t l = sizeof(bound.storage);
    getsockname(fd.get(), bound.get(), &l);
    // sin_port and sin6_port sit at the same offset.
    const uint16_t bound_port =
        ntohs(reinterpret_cast<sockaddr_in*>(&bound.storage)->sin_port);
    return std::make_shared<TcpEndpoint>(std::move(fd), address, bound_port);
  }
};

}  // namespace

std::unique_ptr<Connector> CreateTcpConnector() {
  return std::make_unique<TcpConnector>();
}

}  // namespace coverbs::transport
