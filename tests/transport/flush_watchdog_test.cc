// A device that never flushes the work requests of a QP in the error state
// (siw after a peer TERMINATE does this) must not leave a coroutine waiting
// forever: QueuePair abandons the QP after QpOptions::flush_timeout. The
// device is the soft provider with a QP whose SetError is swallowed, so the
// posted receive stays on a live QP that will never complete it.
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/reactor.h"
#include "core/task.h"
#include "core/timeout.h"
#include "gtest/gtest.h"
#include "transport/completion_queue.h"
#include "transport/device.h"
#include "transport/memory.h"
#include "transport/provider.h"
#include "transport/queue_pair.h"

namespace coverbs::transport {
namespace {

// Forwards everything to a real QP except SetError, which it drops.
class LosesFlushes final : public ProviderQp {
 public:
  explicit LosesFlushes(std::unique_ptr<ProviderQp> qp) : qp_(std::move(qp)) {}
  uint32_t qp_num() const override { return qp_->qp_num(); }
  uint32_t max_send_wr() const override { return qp_->max_send_wr(); }
  uint32_t max_recv_wr() const override { return qp_->max_recv_wr(); }
  uint32_t max_inline_data() const override { return qp_->max_inline_data(); }
  absl::Status PostSend(ibv_send_wr* wr, ibv_send_wr** bad) override {
    return qp_->PostSend(wr, bad);
  }
  absl::Status PostRecv(ibv_recv_wr* wr, ibv_recv_wr** bad) override {
    return qp_->PostRecv(wr, bad);
  }
  absl::Status SetError() override { return absl::OkStatus(); }
  ibv_qp_state state() const override { return qp_->state(); }

 private:
  std::unique_ptr<ProviderQp> qp_;
};

class FlushWatchdogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto r = Reactor::Create();
    ASSERT_TRUE(r.ok()) << r.status();
    reactor_ = *std::move(r);
    ProviderOptions o;
    o.kind = ProviderKind::kSoft;
    auto d = Device::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = *std::move(d);
    auto pd = device_->AllocPd();
    ASSERT_TRUE(pd.ok()) << pd.status();
    pd_ = *std::move(pd);
    auto cq = CompletionQueue::Create(*device_, *reactor_);
    ASSERT_TRUE(cq.ok()) << cq.status();
    cq_ = *std::move(cq);
    QpInit init;
    init.send_cq = cq_->provider();
    init.recv_cq = cq_->provider();
    init.max_send_wr = init.max_recv_wr = 8;
    auto pair = device_->provider()->CreateConnectedPair(
        pd_->provider(), init, pd_->provider(), init);
    ASSERT_TRUE(pair.ok()) << pair.status();
    keepalive_ = pair->keepalive;
    QpOptions qo;
    qo.max_send_wr = qo.max_recv_wr = 8;
    qo.flush_timeout = absl::Milliseconds(300);
    auto a = QueuePair::Adopt(
        std::make_unique<LosesFlushes>(std::move(pair->a)), *cq_, qo,
        keepalive_);
    ASSERT_TRUE(a.ok()) << a.status();
    qp_ = *std::move(a);
    auto b = QueuePair::Adopt(std::move(pair->b), *cq_, qo, keepalive_);
    ASSERT_TRUE(b.ok()) << b.status();
    peer_ = *std::move(b);
    buf_.resize(64);
    auto mr = pd_->Register(buf_.data(), buf_.size(),
                            IBV_ACCESS_LOCAL_WRITE);
    ASSERT_TRUE(mr.ok()) << mr.status();
    mr_ = *std::move(mr);
  }
  void TearDown() override {
    qp_.reset();
    peer_.reset();
    cq_.reset();
  }

 public:  // for the coroutine lambdas
  // Receives on `qp` until `limit`; nothing is ever sent to it, so the
  // deadline cancels the receive, which moves the QP to the error state.
  Task<absl::Status> RecvWithin(QueuePair* qp, absl::Duration limit) {
    auto recv = [](QueuePair* qp,
                   const MemoryRegion* mr) -> Task<absl::Status> {
      LocalBuffer b = mr->Local();
      auto wc = co_await qp->Recv(b);
      co_return wc.status();
    };
    co_return co_await WithTimeout(recv(qp, &mr_), limit);
  }

  std::unique_ptr<Reactor> reactor_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<ProtectionDomain> pd_;
  std::unique_ptr<CompletionQueue> cq_;
  std::shared_ptr<void> keepalive_;
  std::unique_ptr<QueuePair> qp_, peer_;
  std::vector<std::byte> buf_;
  MemoryRegion mr_;
};

TEST_F(FlushWatchdogTest, CancelledReceiveEndsAlthoughTheFlushNeverComes) {
  absl::Time start = absl::Now();
  // This device loses the flush of the cancelled receive.
  absl::Status s =
      reactor_->BlockOn(RecvWithin(qp_.get(), absl::Milliseconds(50)));
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(qp_->outstanding(), 0u);
  EXPECT_EQ(qp_->provider(), nullptr) << "the QP should have been abandoned";
  // The watchdog, not anything else, ended it: not before flush_timeout.
  EXPECT_GE(took, absl::Milliseconds(300)) << took;
  // Later operations fail at once instead of waiting.
  absl::Status later = reactor_->BlockOn(
      [](FlushWatchdogTest* t) -> Task<absl::Status> {
        LocalBuffer b = t->mr_.Local();
        auto wc = co_await t->qp_->Recv(b);
        co_return wc.status();
      }(this));
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
}

TEST_F(FlushWatchdogTest, DeviceThatFlushesKeepsItsQp) {
  // The peer's QP flushes normally: SetError with a posted receive
  // completes it at once and the watchdog never fires.
  absl::Status s =
      reactor_->BlockOn(RecvWithin(peer_.get(), absl::Milliseconds(50)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(peer_->outstanding(), 0u);
  EXPECT_NE(peer_->provider(), nullptr) << "a device that flushes keeps its QP";
}

}  // namespace
}  // namespace coverbs::transport
