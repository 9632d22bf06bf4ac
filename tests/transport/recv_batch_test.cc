// QueuePair::PostRecvs: receives into handlers posted as one chain (the
// messaging layer refills its receive ring this way). Runs on every provider
// with the conformance fixture (same binary, same VM targets).
#include <cstring>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "tests/transport/conformance_fixture.h"

namespace coverbs::transport {
namespace {

using conformance::ConformanceTest;
using conformance::Await;
using conformance::Mem;

using RecvBatchTest = ConformanceTest;

struct Slot : RecvHandler {
  std::vector<std::pair<int, ibv_wc>>* got = nullptr;
  int index = 0;
  void OnRecv(const ibv_wc& wc) override { got->emplace_back(index, wc); }
};

// A chain of receives completes in the order posted, each to its own
// handler, each message in its own buffer, and gives its slots back.
TEST_P(RecvBatchTest, EachReceiveCompletesToItsHandlerInOrder) {
  constexpr int kN = 8;
  constexpr uint32_t kLen = 48;
  Mem rx = Reg(pd_b_.get(), kN * 64), tx = Reg(pd_a_.get(), kN * 64);
  for (int i = 0; i < kN; ++i) {
    std::memset(tx.bytes.data() + i * 64, 'a' + i, 64);
  }
  std::vector<std::pair<int, ibv_wc>> got;
  std::vector<Slot> slots(kN);
  std::vector<RecvHandler*> hs;
  std::vector<LocalBuffer> bufs;
  for (int i = 0; i < kN; ++i) {
    slots[i].got = &got;
    slots[i].index = i;
    hs.push_back(&slots[i]);
    bufs.push_back(rx.Local(i * 64, 64));
  }
  const uint32_t free_before = b_->recv_slots_free();
  ASSERT_TRUE(b_->PostRecvs(hs, bufs).ok());
  EXPECT_EQ(b_->recv_slots_free(), free_before - kN);
  for (int i = 0; i < kN; ++i) {
    auto s = Run(Await(a_->Send(tx.Local(i * 64, kLen))));
    ASSERT_TRUE(s.ok()) << s.status();
  }
  auto wait =
      [](Reactor* r,
         const std::vector<std::pair<int, ibv_wc>>* got) -> Task<absl::Status> {
    while (got->size() < kN) {
      absl::Status st = co_await r->Sleep(absl::Microseconds(100));
      if (!st.ok()) co_return st;
    }
    co_return absl::OkStatus();
  };
  ASSERT_TRUE(Run(wait(reactor_.get(), &got)).ok()) << got.size() << " came";
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(got[i].first, i);
    EXPECT_EQ(got[i].second.status, IBV_WC_SUCCESS);
    EXPECT_EQ(got[i].second.byte_len, kLen);
    EXPECT_EQ(static_cast<char>(rx.bytes[i * 64]), 'a' + i) << i;
    EXPECT_EQ(static_cast<char>(rx.bytes[i * 64 + kLen - 1]), 'a' + i) << i;
  }
  EXPECT_EQ(b_->recv_slots_free(), free_before);
}

// A batch the receive queue cannot hold whole, one too long, or one on a QP
// in error is refused as a whole: nothing posted, the slots unchanged.
TEST_P(RecvBatchTest, RefusedBatchesPostNothing) {
  Mem rx = Reg(pd_b_.get(), 64);
  std::vector<std::pair<int, ibv_wc>> got;
  std::vector<Slot> slots(QueuePair::kMaxRecvBatch + 1);
  std::vector<RecvHandler*> hs;
  std::vector<LocalBuffer> bufs;
  for (size_t i = 0; i < slots.size(); ++i) {
    slots[i].got = &got;
    slots[i].index = static_cast<int>(i);
    hs.push_back(&slots[i]);
    bufs.push_back(rx.Local(0, 64));
  }
  const uint32_t free_before = b_->recv_slots_free();
  absl::Status too_long = b_->PostRecvs(hs, bufs);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument) << too_long;
  EXPECT_EQ(b_->recv_slots_free(), free_before);
  // Fill the queue to one free slot with single receives...
  std::vector<Slot> fill(free_before);
  // b_'s teardown completes what was posted (flush): before the handlers
  // go, however the test ends.
  absl::Cleanup close_b = [this] { b_.reset(); };
  for (uint32_t i = 0; b_->recv_slots_free() > 1; ++i) {
    fill[i].got = &got;
    LocalBuffer l = rx.Local(0, 64);
    ASSERT_TRUE(
        b_->PostRecv(&fill[i], std::span<const LocalBuffer>(&l, 1)).ok());
  }
  // ...then a batch of two does not fit.
  std::span<RecvHandler* const> two(hs.data(), 2);
  absl::Status full = b_->PostRecvs(two, std::span(bufs).first(2));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(b_->recv_slots_free(), 1u);
  ASSERT_TRUE(b_->SetError("test").ok());
  absl::Status in_error =
      b_->PostRecvs(std::span(hs).first(1), std::span(bufs).first(1));
  EXPECT_EQ(in_error.code(), absl::StatusCode::kFailedPrecondition) << in_error;
  std::move(close_b).Invoke();
  for (const auto& [index, wc] : got) EXPECT_NE(wc.status, IBV_WC_SUCCESS);
}

INSTANTIATE_TEST_SUITE_P(Providers, RecvBatchTest,
                         ::testing::ValuesIn(conformance::Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::transport
