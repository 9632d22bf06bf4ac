#include "transport/soft/soft_provider.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/soft/engine.h"
#include "transport/soft/mr_table.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/queues.h"
#include "transport/soft/soft_mw.h"

namespace coverbs::transport {
namespace soft {
namespace {

constexpr uint32_t kMaxQpWr = 16384;
constexpr uint32_t kMaxCqe = 65536;
constexpr uint32_t kMaxInline = 256;
constexpr uint32_t kMaxSrqWr = 16384;
constexpr uint64_t kMaxMrSize = 1ULL << 40;
constexpr uint32_t kMaxQpRdAtom = 128;
constexpr int kSocketBuffer = 4 * 1024 * 1024;
constexpr auto kConnectTimeout = std::chrono::seconds(5);

DeviceCaps SoftCaps() {
  DeviceCaps c;
  c.provider = "soft";
  c.device_name = "soft0";
  c.transport = TransportKind::kSoft;
  c.port = 1;
  c.gid_index = -1;
  c.max_qp_wr = kMaxQpWr;
  c.max_sge = kMaxSge;
  c.max_cqe = kMaxCqe;
  c.max_inline_data = kMaxInline;
  c.max_srq_wr = kMaxSrqWr;
  c.max_mr_size = kMaxMrSize;
  c.max_qp_rd_atom = kMaxQpRdAtom;
  c.atomics = true;
  c.write_with_imm = true;
  c.send_with_imm = true;
  c.active_side_sends_first = false;
  c.memory_windows = true;  // soft_mw.h
  c.send_with_invalidate = true;
  return c;
}

struct Context {
  DeviceCaps caps = SoftCaps();
  std::shared_ptr<AsyncQueue> async;  // null if its eventfd failed
};

std::atomic<uint64_t> g_next_pd{1};

uint32_t NextQpNum() {
  static std::atomic<uint32_t> counter{std::random_device{}()};
  for (;;) {
    uint32_t n = counter.fetch_add(1) & 0xFFFFFF;
    if (n >= 2) return n;  // 0 and 1 are the IB special QPs
  }
}

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) close(fd_);
  }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) close(fd_);
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

class SoftMr : public ProviderMr {
 public:
  explicit SoftMr(std::shared_ptr<MrEntry> e) : e_(std::move(e)) {}
  ~SoftMr() override { MrTable::Get().Deregister(e_); }
  void* addr() const override { return e_->addr; }
  size_t length() const override { return e_->length; }
  uint32_t lkey() const override { return e_->lkey; }
  uint32_t rkey() const override { return e_->rkey; }
  int access() const override { return e_->access; }

 private:
  std::shared_ptr<MrEntry> e_;
};

class SoftSrq : public ProviderSrq {
 public:
  explicit SoftSrq(std::shared_ptr<RecvQueue> q) : q_(std::move(q)) {}
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return q_->Post(wr, bad, 0);
  }
  const std::shared_ptr<RecvQueue>& queue() const { return q_; }

 private:
  std::shared_ptr<RecvQueue> q_;
};

class SoftPd : public ProviderPd {
 public:
  SoftPd(std::shared_ptr<Context> ctx, uint64_t id)
      : ctx_(std::move(ctx)), id_(id) {}

  absl::StatusOr<std::unique_ptr<ProviderMr>> RegisterMemory(
      void* addr, size_t length, int access) override {
    if (length > kMaxMrSize) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: register memory: %u bytes exceed max_mr_size", length));
    }
    absl::StatusOr<std::shared_ptr<MrEntry>> e =
        MrTable::Get().Register(id_, addr, length, access);
    if (!e.ok()) return e.status();
    return std::make_unique<SoftMr>(*std::move(e));
  }

  absl::StatusOr<std::unique_ptr<ProviderSrq>> CreateSrq(
      uint32_t max_wr, uint32_t max_sge) override {
    if (max_wr == 0 || max_wr > kMaxSrqWr || max_sge > kMaxSge) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: create SRQ: max_wr %u (1..%u), max_sge %u (0..%u)", max_wr,
          kMaxSrqWr, max_sge, kMaxSge));
    }
    return std::make_unique<SoftSrq>(
        std::make_shared<RecvQueue>(max_wr, max_sge, id_));
  }

  absl::StatusOr<std::unique_ptr<ProviderMw>> AllocMw() override {
    return NewSoftMw(id_);
  }

  uint64_t id() const { return id_; }
  const std::shared_ptr<Context>& ctx() const { return ctx_; }

 private:
  std::shared_ptr<Context> ctx_;
  uint64_t id_;
};

class SoftCq : public ProviderCq {
 public:
  explicit SoftCq(std::shared_ptr<CqCore> core) : core_(std::move(core)) {}
  // Nobody watches fd() any more: the progress thread takes back the
  // receive of QPs still using the CQ.
  ~SoftCq() override { core_->Undrive(); }
  int fd() const override { return core_->fd(); }
  int capacity() const override { return core_->capacity(); }
  int Poll(int n, ibv_wc* wc) override {
    int got = core_->Poll(n, wc);
    // Found empty outside a loop iteration (a reactor about to sleep): the
    // ACKs its last iteration held back go out now.
    if (got == 0) FlushHeldAcks();
    return got;
  }
  absl::Status RequestNotify() override {
    core_->RequestNotify();
    return absl::OkStatus();
  }
  int GetEvents() override { return core_->GetEvents(); }
  void AckEvents(unsigned n) override { core_->AckEvents(n); }
  // A reactor's loop iteration: see BeginPostBatch (qp_core.h).
  // The reactor watches fd() from now on and calls GetEvents when it is
  // readable: its QPs' data may wake it directly (CqCore).
  void BeginBatch() override {
    core_->NoteDriven();
    BeginPostBatch();
  }
  void EndBatch() override { EndPostBatch(); }
  const std::shared_ptr<CqCore>& core() const { return core_; }

 private:
  std::shared_ptr<CqCore> core_;
};

class SoftQp : public ProviderQp {
 public:
  SoftQp(std::shared_ptr<Engine> engine, std::shared_ptr<QpCore> core)
      : engine_(std::move(engine)), core_(std::move(core)) {}
  ~SoftQp() override {
    Engine* e = engine_.get();
    QpCore* c = core_.get();
    // After this the progress thread no longer touches the QP, its socket
    // or any buffer posted to it.
    engine_->RunSync([e, c] {
      c->Destroy();
      e->RemoveConn(c);
    });
  }
  uint32_t qp_num() const override { return core_->qp_num(); }
  uint32_t max_send_wr() const override { return core_->max_send_wr(); }
  uint32_t max_recv_wr() const override { return core_->max_recv_wr(); }
  uint32_t max_inline_data() const override {
    return core_->max_inline_data();
  }
  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad) override {
    return core_->PostSend(wr, bad);
  }
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return core_->PostRecv(wr, bad);
  }
  absl::Status SetError() override {
    core_->RequestError();
    return absl::OkStatus();
  }
  ibv_qp_state state() const override { return core_->state(); }

  absl::Status Connect(int fd) {
    UniqueFd owned(fd);
    if (connect_called_.exchange(true)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "soft: connect qp %u: already connected", qp_num()));
    }
    int type = 0;
    socklen_t len = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
        type != SOCK_STREAM) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: connect qp %u: fd %d is not a stream socket", qp_num(), fd));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrFormat(
          "soft: connect qp %u: O_NONBLOCK: %s", qp_num(), strerror(errno)));
    }
    ConfigureSocket(fd);
    QpCore* c = core_.get();
    int f = owned.release();
    engine_->Post([c, f] { c->Connect(f); });
    if (!c->SetConnected()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "soft: connect qp %u: the QP is in the error state", qp_num()));
    }
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<QpCore> core_;
  std::atomic<bool> connect_called_{false};
};

absl::Status WaitFd(int fd, short events, std::chrono::steady_clock::time_point
                    deadline, const char* what) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrFormat("soft: connected pair: timed out in %s", what));
    }
    pollfd p{fd, events, 0};
    int rc = poll(&p, 1, static_cast<int>(left.count()));
    if (rc > 0) return absl::OkStatus();
    if (rc < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrFormat(
          "soft: connected pair: poll in %s: %s", what, strerror(errno)));
    }
  }
}

// Two ends of a TCP connection on 127.0.0.1 (ephemeral port).
absl::Status LoopbackTcpPair(UniqueFd* a, UniqueFd* b) {
  auto deadline = std::chrono::steady_clock::now() + kConnectTimeout;
  auto fail = [](const char* what) {
    return absl::InternalError(absl::StrFormat(
        "soft: connected pair: %s: %s", what, strerror(errno)));
  };
  UniqueFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return fail("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr),
           sizeof(addr)) != 0) {
    return fail("bind 127.0.0.1:0");
  }
  if (listen(listener.get(), 1) != 0) return fail("listen");
  socklen_t alen = sizeof(addr);
  if (getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr),
                  &alen) != 0) {
    return fail("getsockname");
  }
  UniqueFd client(
      socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (client.get() < 0) return fail("socket");
  // Buffer sizes must be set before the connection exists to size the
  // window scale.
  ConfigureSocket(client.get());
  ConfigureSocket(listener.get());
  if (connect(client.get(), reinterpret_cast<sockaddr*>(&addr),
              sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    return fail("connect");
  }
  absl::Status s = WaitFd(listener.get(), POLLIN, deadline, "accept");
  if (!s.ok()) return s;
  UniqueFd server(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (server.get() < 0) return fail("accept");
  s = WaitFd(client.get(), POLLOUT, deadline, "connect");
  if (!s.ok()) return s;
  int err = 0;
  socklen_t elen = sizeof(err);
  getsockopt(client.get(), SOL_SOCKET, SO_ERROR, &err, &elen);
  if (err != 0) {
    errno = err;
    return fail("connect");
  }
  *a = std::move(client);
  *b = std::move(server);
  return absl::OkStatus();
}

class SoftProvider : public Provider {
 public:
  SoftProvider() : ctx_(std::make_shared<Context>()) {
    absl::StatusOr<std::shared_ptr<AsyncQueue>> q = AsyncQueue::Create("soft");
    if (q.ok()) ctx_->async = *std::move(q);
    // The progress thread's descriptors, made now rather than by the first
    // QP (Engine::HoldReserve).
    Engine::HoldReserve();
  }
  ~SoftProvider() override { Engine::DropReserve(); }

  const DeviceCaps& caps() const override { return ctx_->caps; }

  absl::StatusOr<std::unique_ptr<ProviderPd>> AllocPd() override {
    return std::make_unique<SoftPd>(ctx_, g_next_pd.fetch_add(1));
  }

  absl::StatusOr<std::unique_ptr<ProviderCq>> CreateCq(int cqe) override {
    if (cqe <= 0 || static_cast<uint32_t>(cqe) > kMaxCqe) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "soft: create CQ with %d entries (1..%u)", cqe, kMaxCqe));
    }
    absl::StatusOr<std::shared_ptr<CqCore>> core =
        CqCore::Create(cqe, ctx_->async);
    if (!core.ok()) return core.status();
    return std::make_unique<SoftCq>(*std::move(core));
  }

  int async_fd() const override {
    return ctx_->async ? ctx_->async->fd() : -1;
  }

  absl::StatusOr<AsyncEvent> GetAsyncEvent() override {
    if (!ctx_->async) return absl::NotFoundError("no async event pending");
    return ctx_->async->Pop();
  }

  absl::StatusOr<QpPair> CreateConnectedPair(ProviderPd* pd_a,
                                             const QpInit& init_a,
                                             ProviderPd* pd_b,
                                             const QpInit& init_b) override {
    absl::StatusOr<std::unique_ptr<ProviderQp>> a = CreateQp(pd_a, init_a);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::unique_ptr<ProviderQp>> b = CreateQp(pd_b, init_b);
    if (!b.ok()) return b.status();
    UniqueFd fa, fb;
    absl::Status s = LoopbackTcpPair(&fa, &fb);
    if (!s.ok()) return s;
    s = ConnectQp(a->get(), fa.release());
    if (!s.ok()) return s;
    s = ConnectQp(b->get(), fb.release());
    if (!s.ok()) return s;
    QpPair pair;
    pair.a = *std::move(a);
    pair.b = *std::move(b);
    return pair;
  }

 private:
  std::shared_ptr<Context> ctx_;
};

}  // namespace

void ConfigureSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int size = kSocketBuffer;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
}

std::chrono::microseconds RnrTimerDelay(uint8_t code) { return RnrDelay(code); }

int64_t UnackedCqEvents(const ProviderCq* cq) {
  auto* s = dynamic_cast<const SoftCq*>(cq);
  if (s == nullptr) return -1;
  return static_cast<int64_t>(s->core()->unacked_events());
}

absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQp(ProviderPd* pd,
                                                     const QpInit& init) {
  auto* spd = dynamic_cast<SoftPd*>(pd);
  if (spd == nullptr) {
    return absl::InvalidArgumentError("soft: create QP: not a soft PD");
  }
  auto* scq = dynamic_cast<SoftCq*>(init.send_cq);
  auto* rcq = dynamic_cast<SoftCq*>(init.recv_cq);
  if (scq == nullptr || rcq == nullptr) {
    return absl::InvalidArgumentError(
        "soft: create QP: send_cq and recv_cq must be soft CQs");
  }
  SoftSrq* srq = nullptr;
  if (init.srq != nullptr) {
    srq = dynamic_cast<SoftSrq*>(init.srq);
    if (srq == nullptr) {
      return absl::InvalidArgumentError("soft: create QP: not a soft SRQ");
    }
  }
  if (init.max_send_wr == 0 || init.max_send_wr > kMaxQpWr ||
      (srq == nullptr && init.max_recv_wr > kMaxQpWr) ||
      init.max_send_sge > kMaxSge ||
      (srq == nullptr && init.max_recv_sge > kMaxSge) ||
      init.max_inline_data > kMaxInline || init.rnr_retry > 7 ||
      init.min_rnr_timer > 31) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "soft: create QP: max_send_wr %u (1..%u), max_recv_wr %u (0..%u), "
        "max_send_sge %u / max_recv_sge %u (0..%u), max_inline_data %u "
        "(0..%u), rnr_retry %u (0..7), min_rnr_timer %u (0..31)",
        init.max_send_wr, kMaxQpWr, init.max_recv_wr, kMaxQpWr,
        init.max_send_sge, init.max_recv_sge, kMaxSge, init.max_inline_data,
        kMaxInline, init.rnr_retry, init.min_rnr_timer));
  }
  absl::StatusOr<std::shared_ptr<Engine>> engine = Engine::Get();
  if (!engine.ok()) return engine.status();
  QpConfig cfg;
  cfg.qp_num = NextQpNum();
  cfg.pd_id = spd->id();
  cfg.init = init;
  cfg.init.send_cq = nullptr;
  cfg.init.recv_cq = nullptr;
  cfg.init.srq = nullptr;
  cfg.send_cq = scq->core();
  cfg.recv_cq = rcq->core();
  if (srq != nullptr) cfg.srq = srq->queue();
  cfg.async = spd->ctx()->async;
  Engine* e = engine->get();
  auto core = std::make_shared<QpCore>(e, e->NewId(), std::move(cfg));
  e->Post([e, core] { e->AddConn(core); });
  return std::make_unique<SoftQp>(*std::move(engine), std::move(core));
}

absl::Status ConnectQp(ProviderQp* qp, int connected_fd) {
  auto* sqp = dynamic_cast<SoftQp*>(qp);
  if (sqp == nullptr) {
    if (connected_fd >= 0) close(connected_fd);
    return absl::InvalidArgumentError("soft: connect: not a soft QP");
  }
  return sqp->Connect(connected_fd);
}

absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQpOnSocket(
    ProviderPd* pd, const QpInit& init, int connected_fd) {
  absl::StatusOr<std::unique_ptr<ProviderQp>> qp = CreateQp(pd, init);
  if (!qp.ok()) {
    if (connected_fd >= 0) close(connected_fd);
    return qp.status();
  }
  absl::Status s = ConnectQp(qp->get(), connected_fd);
  if (!s.ok()) return s;
  return qp;
}

}  // namespace soft

std::unique_ptr<Provider> CreateSoftProvider() {
  return std::make_unique<soft::SoftProvider>();
}

}  // namespace coverbs::transport
