// Type-2 memory windows (DeviceCaps::memory_windows): a window bound over a
// region without remote access gives the peer access for one transfer,
// and the peer's SEND_WITH_INV ends it -- what cm's landing grants rely on
// (cm/landing.cc). Run against every provider like the conformance suite:
// where the device has windows (rxe), the contract is checked on the wire;
// where it has none (soft, siw), that the API refuses them clearly.
#include <algorithm>
#include <cstring>
#include <string>

#include "tests/transport/conformance_fixture.h"

namespace coverbs::transport {
namespace {

using conformance::Await;
using conformance::ConformanceTest;
using conformance::Mem;
using conformance::Providers;

class MemoryWindowTest : public ConformanceTest {
 protected:
  // b binds `window` over `range` of `target` (all of it by default;
  // registered on b with MW_BIND only) and announces it to a in a SEND
  // behind the bind, as cm's credit messages do; returns the rkey a
  // received.
  absl::StatusOr<uint32_t> BindAndAnnounce(MemoryWindow& window, Mem& target,
                                           size_t range = 0) {
    Mem note_b = Reg(pd_b_.get(), 8), note_a = Reg(pd_a_.get(), 8);
    absl::StatusOr<WorkCompletion> recv;
    SpawnRecv(a_.get(), note_a.Local(), &recv);
    SendBatch batch;
    std::span<std::byte> bytes(target.bytes);
    if (range != 0) bytes = bytes.first(range);
    uint32_t rkey =
        batch.AddBind(window, target.mr, bytes, IBV_ACCESS_REMOTE_WRITE);
    std::memcpy(note_b.bytes.data(), &rkey, sizeof(rkey));
    batch.AddSend(note_b.Local(0, sizeof(rkey)));
    auto posted = Run(Await(b_->PostBatch(batch)));
    if (!posted.ok()) return posted.status();
    WaitFor(&recv);
    if (!recv.ok()) return recv.status();
    uint32_t announced;
    std::memcpy(&announced, note_a.bytes.data(), sizeof(announced));
    return announced;
  }

  // a tells b it is done: a SEND_WITH_INV naming `rkey`; b's receive
  // completion is returned.
  absl::StatusOr<WorkCompletion> SendWithInvalidate(uint32_t rkey) {
    Mem in = Reg(pd_b_.get(), 16), out = Reg(pd_a_.get(), 16);
    absl::StatusOr<WorkCompletion> recv;
    SpawnRecv(b_.get(), in.Local(), &recv);
    SendBatch batch;
    batch.AddSendWithInvalidate(out.Local(), rkey);
    auto sent = Run(Await(a_->PostBatch(batch)));
    if (!sent.ok()) return sent.status();
    WaitFor(&recv);
    return recv;
  }

  std::string NoWindows() const {
    return caps().device_name +
           " has no type-2 memory windows (checked by "
           "WithoutWindowsTheyAreRefused)";
  }
};

TEST_P(MemoryWindowTest, WindowServesOneTransferAndSendWithInvalidateEndsIt) {
  if (!caps().memory_windows) GTEST_SKIP() << NoWindows();
  Mem src = Reg(pd_a_.get(), 4096);
  Mem target =
      Reg(pd_b_.get(), 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  src.Fill(9);
  auto window = pd_b_->AllocateWindow();
  ASSERT_TRUE(window.ok()) << window.status();
  auto rkey = BindAndAnnounce(*window, target);
  ASSERT_TRUE(rkey.ok()) << rkey.status();
  EXPECT_EQ(*rkey, window->rkey());
  EXPECT_NE(*rkey, target.mr.rkey());
  RemoteRegion grant{reinterpret_cast<uint64_t>(target.bytes.data()), 4096,
                     *rkey};
  auto w = Run(Await(a_->Write(src.Local(), grant)));
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(target.Matches(9, 0, 4096));

  auto inv = SendWithInvalidate(*rkey);
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_TRUE(inv->invalidated_rkey.has_value())
      << "the receive does not report the invalidation";
  EXPECT_EQ(*inv->invalidated_rkey, *rkey);

  // The same rkey, after its transfer: refused, memory untouched.
  std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0});
  auto late = Run(Await(a_->Write(src.Local(), grant)));
  ExpectRemoteError(late, IBV_WC_REM_ACCESS_ERR);
  for (std::byte b : target.bytes) ASSERT_EQ(b, std::byte{0});
}

TEST_P(MemoryWindowTest, WindowDoesNotReachBeyondItsRange) {
  if (!caps().memory_windows) GTEST_SKIP() << NoWindows();
  Mem src = Reg(pd_a_.get(), 8192);
  Mem target =
      Reg(pd_b_.get(), 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  auto window = pd_b_->AllocateWindow();
  ASSERT_TRUE(window.ok()) << window.status();
  // Bind over the first half only.
  auto rkey = BindAndAnnounce(*window, target, 4096);
  ASSERT_TRUE(rkey.ok()) << rkey.status();
  RemoteRegion beyond{reinterpret_cast<uint64_t>(target.bytes.data()) + 2048,
                      4096, *rkey};
  auto w = Run(Await(a_->Write(src.Local(0, 4096), beyond)));
  if (!model().window_range_enforced) {
    // A device defect (ErrorModel::window_range_enforced): the WRITE lands
    // in the region beyond the window. cm binds each landing window over a
    // whole region of its own, where the two ranges are the same.
    EXPECT_TRUE(w.ok()) << caps().device_name
                        << " enforces window ranges now: update the model";
    return;
  }
  ExpectRemoteError(w, IBV_WC_REM_ACCESS_ERR);
  for (size_t i = 4096; i < 8192; ++i) {
    ASSERT_EQ(target.bytes[i], std::byte{0}) << i;
  }
}

TEST_P(MemoryWindowTest, RebindGivesANewRkeyAndTheOldOneFails) {
  if (!caps().memory_windows) GTEST_SKIP() << NoWindows();
  Mem src = Reg(pd_a_.get(), 256);
  Mem target =
      Reg(pd_b_.get(), 256, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  src.Fill(4);
  auto window = pd_b_->AllocateWindow();
  ASSERT_TRUE(window.ok()) << window.status();
  auto first = BindAndAnnounce(*window, target);
  ASSERT_TRUE(first.ok()) << first.status();
  auto inv = SendWithInvalidate(*first);
  ASSERT_TRUE(inv.ok()) << inv.status();
  auto second = BindAndAnnounce(*window, target);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(*second, *first);
  const uint64_t addr = reinterpret_cast<uint64_t>(target.bytes.data());
  auto w = Run(Await(a_->Write(src.Local(), RemoteRegion{addr, 256, *second})));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(target.Matches(4, 0, 256));
  std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0});
  auto stale =
      Run(Await(a_->Write(src.Local(), RemoteRegion{addr, 256, *first})));
  ExpectRemoteError(stale, IBV_WC_REM_ACCESS_ERR);
  for (std::byte b : target.bytes) ASSERT_EQ(b, std::byte{0});
}

TEST_P(MemoryWindowTest, WithoutWindowsTheyAreRefused) {
  if (caps().memory_windows) {
    GTEST_SKIP() << caps().device_name
                 << " has memory windows (checked by the tests above)";
  }
  auto window = pd_b_->AllocateWindow();
  EXPECT_EQ(window.status().code(), absl::StatusCode::kUnimplemented)
      << window.status();
  EXPECT_NE(window.status().message().find("memory windows"), std::string::npos)
      << window.status();
  if (!caps().send_with_invalidate) {
    Mem out = Reg(pd_a_.get(), 16);
    SendBatch batch;
    batch.AddSendWithInvalidate(out.Local(), 0x1234);
    auto sent = Run(Await(a_->PostBatch(batch)));
    EXPECT_EQ(sent.status().code(), absl::StatusCode::kUnimplemented)
        << sent.status();
    EXPECT_FALSE(a_->in_error());  // refused before posting
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, MemoryWindowTest,
                         ::testing::ValuesIn(Providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace coverbs::transport
