// Transport micro-benchmarks (build with -c opt):
//  - BM_SoftSendCompletion: one `co_await qp.Send` + its completion on the
//    soft provider (a loopback TCP pair; the peer keeps receives posted),
//    i.e. the framework's per-operation path plus the soft RNIC.
//  - BM_CqDispatch: the completion-channel reactor's cost per CQE, fed by a
//    synthetic CQ that returns N ready completions (no device involved).
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "core/reactor.h"
#include "transport/completion_queue.h"
#include "transport/device.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {
namespace {

// Keeps `depth` receives posted on `qp` forever (re-posting on completion).
class RecvRing {
 public:
  struct Slot : RecvHandler {
    RecvRing* ring;
    LocalBuffer buf;
    void OnRecv(const ibv_wc& wc) override {
      if (wc.status == IBV_WC_SUCCESS) {
        ++ring->received;
        ring->qp->PostRecv(this, std::span<const LocalBuffer>(&buf, 1))
            .IgnoreError();
      }
    }
  };
  RecvRing(QueuePair* qp, const MemoryRegion& mr, int depth, size_t size)
      : qp(qp), slots(depth) {
    for (int i = 0; i < depth; ++i) {
      slots[i].ring = this;
      slots[i].buf = mr.Local(i * size, size);
      qp->PostRecv(&slots[i], std::span<const LocalBuffer>(&slots[i].buf, 1))
          .IgnoreError();
    }
  }
  QueuePair* qp;
  std::vector<Slot> slots;
  uint64_t received = 0;
};

Task<int64_t> SendLoop(QueuePair* qp, LocalBuffer buf, int64_t n) {
  int64_t ok = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto r = co_await qp->Send(buf);
    if (!r.ok()) break;
    ++ok;
  }
  co_return ok;
}

void BM_SoftSendCompletion(benchmark::State& state) {
  const size_t size = state.range(0);
  auto reactor = *Reactor::Create();
  ProviderOptions o;
  o.kind = ProviderKind::kSoft;
  auto device = *Device::Open(o);
  auto pd = *device->AllocPd();
  auto cq = *CompletionQueue::Create(*device, *reactor);
  auto pair = QueuePair::CreatePair(*pd, *cq, *pd, *cq);
  if (!pair.ok()) {
    state.SkipWithError(pair.status().ToString().c_str());
    return;
  }
  auto& [a, b] = *pair;
  constexpr int kDepth = 128;
  std::vector<std::byte> rx(kDepth * size), tx(size);
  auto rx_mr = *pd->Register(rx.data(), rx.size(), IBV_ACCESS_LOCAL_WRITE);
  auto tx_mr = *pd->Register(tx.data(), tx.size(), IBV_ACCESS_LOCAL_WRITE);
  RecvRing ring(b.get(), rx_mr, kDepth, size);
  constexpr int64_t kBatch = 1000;
  for (auto _ : state) {
    int64_t sent = reactor->BlockOn(SendLoop(a.get(), tx_mr.Local(), kBatch));
    if (sent != kBatch) {
      state.SkipWithError("send failed");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.SetBytesProcessed(state.iterations() * kBatch * size);
  b.reset();
  a.reset();
}
BENCHMARK(BM_SoftSendCompletion)->Arg(64)->Arg(4096)->UseRealTime();

// --- A synthetic provider whose CQ always has completions ready.

class CountingWr : public WorkRequest {
 public:
  void OnCompletion(const ibv_wc& wc) override { n += wc.byte_len; }
  uint64_t n = 0;
};

class FakeCq : public ProviderCq {
 public:
  int fd() const override { return -1; }
  int capacity() const override { return 1 << 20; }
  int Poll(int n, ibv_wc* wc) override {
    int k = std::min<int64_t>(n, pending);
    for (int i = 0; i < k; ++i) {
      std::memset(&wc[i], 0, sizeof(ibv_wc));
      wc[i].wr_id = reinterpret_cast<uint64_t>(static_cast<WorkRequest*>(target)) | 1;
      wc[i].byte_len = 1;
    }
    pending -= k;
    return k;
  }
  absl::Status RequestNotify() override { return absl::OkStatus(); }
  int GetEvents() override { return 0; }
  void AckEvents(unsigned) override {}
  int64_t pending = 0;
  CountingWr* target = nullptr;
};

class FakeProvider : public Provider {
 public:
  const DeviceCaps& caps() const override { return caps_; }
  absl::StatusOr<std::unique_ptr<ProviderPd>> AllocPd() override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<ProviderCq>> CreateCq(int) override {
    auto cq = std::make_unique<FakeCq>();
    last = cq.get();
    return cq;
  }
  int async_fd() const override { return -1; }
  absl::StatusOr<AsyncEvent> GetAsyncEvent() override {
    return absl::NotFoundError("none");
  }
  absl::StatusOr<QpPair> CreateConnectedPair(ProviderPd*, const QpInit&,
                                             ProviderPd*, const QpInit&) override {
    return absl::UnimplementedError("fake");
  }
  DeviceCaps caps_{.provider = "fake", .device_name = "fake0", .max_cqe = 1 << 20};
  FakeCq* last = nullptr;
};

void BM_CqDispatch(benchmark::State& state) {
  auto reactor = *Reactor::Create();
  auto provider = std::make_unique<FakeProvider>();
  FakeProvider* fp = provider.get();
  Device device(std::move(provider));
  auto cq = *CompletionQueue::Create(device, *reactor);
  CountingWr wr;
  fp->last->target = &wr;
  constexpr int64_t kN = 4096;
  for (auto _ : state) {
    fp->last->pending = kN;
    while (cq->Poll() > 0) {
    }
  }
  benchmark::DoNotOptimize(wr.n);
  state.SetItemsProcessed(state.iterations() * kN);
}
BENCHMARK(BM_CqDispatch);

}  // namespace
}  // namespace coverbs::transport

BENCHMARK_MAIN();
