#include "transport/loop/loop_provider.h"

#include <atomic>
#include <random>
#include <utility>

#include "absl/strings/str_format.h"
#include "transport/loop/mr_table.h"
#include "transport/loop/qp.h"
#include "transport/loop/queues.h"

namespace coverbs::transport {
namespace loop {
namespace {

constexpr uint32_t kMaxQpWr = 16384;
constexpr uint32_t kMaxCqe = 65536;
constexpr uint32_t kMaxInline = 256;
constexpr uint32_t kMaxSrqWr = 16384;
constexpr uint64_t kMaxMrSize = 1ULL << 40;
constexpr uint32_t kMaxQpRdAtom = 128;

DeviceCaps LoopCaps() {
  DeviceCaps c;
  c.provider = "loop";
  c.device_name = "loop";
  c.transport = TransportKind::kLoop;
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
  c.enforces_remote_read = true;
  c.memory_windows = false;
  c.send_with_invalidate = false;
  return c;
}

std::atomic<uint64_t> g_next_pd{1};

uint32_t NextQpNum() {
  static std::atomic<uint32_t> counter{std::random_device{}()};
  for (;;) {
    uint32_t n = counter.fetch_add(1) & 0xFFFFFF;
    if (n >= 2) return n;  // 0 and 1 are the IB special QPs
  }
}

struct Context {
  DeviceCaps caps = LoopCaps();
  std::shared_ptr<AsyncQueue> async;
};

class LoopMr : public ProviderMr {
 public:
  explicit LoopMr(Region r) : r_(r) {}
  ~LoopMr() override { MrTable::Get().Deregister(r_.lkey, r_.rkey); }
  void* addr() const override { return r_.addr; }
  size_t length() const override { return r_.length; }
  uint32_t lkey() const override { return r_.lkey; }
  uint32_t rkey() const override { return r_.rkey; }
  int access() const override { return r_.access; }

 private:
  const Region r_;
};

class LoopSrq : public ProviderSrq {
 public:
  explicit LoopSrq(std::shared_ptr<SrqCore> core) : core_(std::move(core)) {}
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return core_->Post(wr, bad);
  }
  const std::shared_ptr<SrqCore>& core() const { return core_; }

 private:
  std::shared_ptr<SrqCore> core_;
};

class LoopPd : public ProviderPd {
 public:
  LoopPd(std::shared_ptr<Context> ctx, uint64_t id)
      : ctx_(std::move(ctx)), id_(id) {}

  absl::StatusOr<std::unique_ptr<ProviderMr>> RegisterMemory(
      void* addr, size_t length, int access) override {
    if (length > kMaxMrSize) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loop: register memory: %u bytes exceed max_mr_size", length));
    }
    absl::StatusOr<Region> r =
        MrTable::Get().Register(id_, addr, length, access);
    if (!r.ok()) return r.status();
    return std::make_unique<LoopMr>(*r);
  }

  absl::StatusOr<std::unique_ptr<ProviderSrq>> CreateSrq(
      uint32_t max_wr, uint32_t max_sge) override {
    if (max_wr == 0 || max_wr > kMaxSrqWr || max_sge > kMaxSge) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loop: create SRQ: max_wr %u (1..%u), max_sge %u (0..%u)", max_wr,
          kMaxSrqWr, max_sge, kMaxSge));
    }
    return std::make_unique<LoopSrq>(
        std::make_shared<SrqCore>(max_wr, max_sge, id_));
  }

  uint64_t id() const { return id_; }
  const std::shared_ptr<Context>& ctx() const { return ctx_; }

 private:
  std::shared_ptr<Context> ctx_;
  uint64_t id_;
};

class LoopCq : public ProviderCq {
 public:
  explicit LoopCq(std::shared_ptr<CqCore> core) : core_(std::move(core)) {}
  int fd() const override { return core_->fd(); }
  int capacity() const override { return core_->capacity(); }
  int Poll(int n, ibv_wc* wc) override { return core_->Poll(n, wc); }
  absl::Status RequestNotify() override {
    core_->RequestNotify();
    return absl::OkStatus();
  }
  int GetEvents() override { return core_->GetEvents(); }
  void AckEvents(unsigned n) override { core_->AckEvents(n); }
  const std::shared_ptr<CqCore>& core() const { return core_; }

 private:
  std::shared_ptr<CqCore> core_;
};

class LoopQp : public ProviderQp {
 public:
  explicit LoopQp(std::shared_ptr<QpCore> core) : core_(std::move(core)) {}
  ~LoopQp() override { core_->Destroy(); }
  uint32_t qp_num() const override { return core_->qp_num(); }
  uint32_t max_send_wr() const override {
    return core_->config().init.max_send_wr;
  }
  uint32_t max_recv_wr() const override {
    return core_->config().init.max_recv_wr;
  }
  uint32_t max_inline_data() const override {
    return core_->config().init.max_inline_data;
  }
  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad) override {
    return core_->PostSend(wr, bad);
  }
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return core_->PostRecv(wr, bad);
  }
  absl::Status SetError() override {
    core_->SetError();
    return absl::OkStatus();
  }
  ibv_qp_state state() const override { return core_->state(); }
  QpCore* core() const { return core_.get(); }

 private:
  std::shared_ptr<QpCore> core_;
};

class LoopProvider : public Provider {
 public:
  explicit LoopProvider(std::shared_ptr<Context> ctx) : ctx_(std::move(ctx)) {}

  const DeviceCaps& caps() const override { return ctx_->caps; }

  absl::StatusOr<std::unique_ptr<ProviderPd>> AllocPd() override {
    return std::make_unique<LoopPd>(ctx_, g_next_pd.fetch_add(1));
  }

  absl::StatusOr<std::unique_ptr<ProviderCq>> CreateCq(int cqe) override {
    if (cqe <= 0 || static_cast<uint32_t>(cqe) > kMaxCqe) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "loop: create CQ with %d entries (1..%u)", cqe, kMaxCqe));
    }
    absl::StatusOr<std::shared_ptr<CqCore>> core =
        CqCore::Create(cqe, ctx_->async);
    if (!core.ok()) return core.status();
    return std::make_unique<LoopCq>(*std::move(core));
  }

  int async_fd() const override { return ctx_->async->fd(); }

  absl::StatusOr<AsyncEvent> GetAsyncEvent() override {
    return ctx_->async->Pop();
  }

  absl::StatusOr<QpPair> CreateConnectedPair(ProviderPd* pd_a,
                                             const QpInit& init_a,
                                             ProviderPd* pd_b,
                                             const QpInit& init_b) override {
    absl::StatusOr<std::unique_ptr<ProviderQp>> a = CreateQp(pd_a, init_a);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::unique_ptr<ProviderQp>> b =
        CreateQp(pd_b, init_b, a->get());
    if (!b.ok()) return b.status();
    absl::Status s = ConnectQps(a->get(), b->get());
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

absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQp(ProviderPd* pd,
                                                     const QpInit& init,
                                                     ProviderQp* peer) {
  auto* lpd = dynamic_cast<LoopPd*>(pd);
  if (lpd == nullptr) {
    return absl::InvalidArgumentError("loop: create QP: not a loop PD");
  }
  auto* scq = dynamic_cast<LoopCq*>(init.send_cq);
  auto* rcq = dynamic_cast<LoopCq*>(init.recv_cq);
  if (scq == nullptr || rcq == nullptr) {
    return absl::InvalidArgumentError(
        "loop: create QP: send_cq and recv_cq must be loop CQs");
  }
  LoopSrq* srq = nullptr;
  if (init.srq != nullptr) {
    srq = dynamic_cast<LoopSrq*>(init.srq);
    if (srq == nullptr) {
      return absl::InvalidArgumentError("loop: create QP: not a loop SRQ");
    }
  }
  LoopQp* lpeer = nullptr;
  if (peer != nullptr) {
    lpeer = dynamic_cast<LoopQp*>(peer);
    if (lpeer == nullptr) {
      return absl::InvalidArgumentError("loop: create QP: peer not a loop QP");
    }
  }
  if (init.max_send_wr == 0 || init.max_send_wr > kMaxQpWr ||
      (srq == nullptr && init.max_recv_wr > kMaxQpWr) ||
      init.max_send_sge > kMaxSge ||
      (srq == nullptr && init.max_recv_sge > kMaxSge) ||
      init.max_inline_data > kMaxInline || init.rnr_retry > 7 ||
      init.min_rnr_timer > 31) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "loop: create QP: max_send_wr %u (1..%u), max_recv_wr %u (0..%u), "
        "max_send_sge %u / max_recv_sge %u (0..%u), max_inline_data %u "
        "(0..%u), rnr_retry %u (0..7), min_rnr_timer %u (0..31)",
        init.max_send_wr, kMaxQpWr, init.max_recv_wr, kMaxQpWr,
        init.max_send_sge, init.max_recv_sge, kMaxSge, init.max_inline_data,
        kMaxInline, init.rnr_retry, init.min_rnr_timer));
  }
  QpConfig cfg;
  cfg.qp_num = NextQpNum();
  cfg.pd_id = lpd->id();
  cfg.init = init;
  cfg.init.send_cq = nullptr;
  cfg.init.recv_cq = nullptr;
  cfg.init.srq = nullptr;
  cfg.send_cq = scq->core();
  cfg.recv_cq = rcq->core();
  if (srq != nullptr) cfg.srq = srq->core();
  cfg.async = lpd->ctx()->async;
  std::shared_ptr<Wire> wire =
      lpeer != nullptr ? lpeer->core()->wire() : std::make_shared<Wire>();
  auto core = std::make_shared<QpCore>(std::move(cfg), std::move(wire));
  if (srq != nullptr) srq->core()->Attach(core);
  return std::make_unique<LoopQp>(std::move(core));
}

absl::Status ConnectQps(ProviderQp* active, ProviderQp* passive) {
  auto* a = dynamic_cast<LoopQp*>(active);
  auto* b = dynamic_cast<LoopQp*>(passive);
  if (a == nullptr || b == nullptr) {
    return absl::InvalidArgumentError("loop: connect: not loop QPs");
  }
  return QpCore::Connect(a->core(), b->core());
}

}  // namespace loop

absl::StatusOr<std::unique_ptr<Provider>> CreateLoopProvider() {
  auto ctx = std::make_shared<loop::Context>();
  absl::StatusOr<std::shared_ptr<loop::AsyncQueue>> q =
      loop::AsyncQueue::Create("loop");
  if (!q.ok()) return q.status();
  ctx->async = *std::move(q);
  return std::make_unique<loop::LoopProvider>(std::move(ctx));
}

}  // namespace coverbs::transport
