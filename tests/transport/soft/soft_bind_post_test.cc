// Window binds posted on a soft QP take effect at post. An unsignaled bind
// that succeeded has nothing left to do there -- no completion to report,
// nothing to send -- and ends at post; what the verbs contract still
// promises must hold regardless: a signaled bind completes in order, and a
// list posted in part leaves every WR it posted to be flushed.
#include <infiniband/verbs.h>

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"

namespace coverbs::transport::soft::testing {
namespace {

class SoftBindPostTest : public SoftFixture {
 protected:
  void SetUp() override {
    SoftFixture::SetUp();
    Connect();
    target_mr_ = Reg(pd_b_.get(), target_.data(), target_.size(),
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
    src_mr_ = Reg(pd_a_.get(), src_.data(), src_.size());
    auto mw = pd_b_->AllocMw();
    ASSERT_TRUE(mw.ok()) << mw.status();
    mw_ = *std::move(mw);
  }

  // b's bind WR over all of target_, for a's WRITEs.
  ibv_send_wr BindWr(uint64_t wr_id, unsigned flags, uint32_t* rkey) {
    ibv_send_wr wr{};
    *rkey = mw_->PrepareBind(wr, *target_mr_,
                             reinterpret_cast<uint64_t>(target_.data()),
                             target_.size(), IBV_ACCESS_REMOTE_WRITE);
    wr.wr_id = wr_id;
    wr.send_flags = flags;
    return wr;
  }

  // a WRITEs src_ (filled with `v`) through `rkey`; its completion status.
  ibv_wc_status WriteThrough(uint32_t rkey, char v) {
    std::memset(src_.data(), v, src_.size());
    ibv_sge s =
        Sge(src_.data(), static_cast<uint32_t>(src_.size()), src_mr_->lkey());
    absl::Status p =
        PostSend1(a(), 50, IBV_WR_RDMA_WRITE, &s, 1, IBV_SEND_SIGNALED,
                  reinterpret_cast<uint64_t>(target_.data()), rkey);
    EXPECT_TRUE(p.ok()) << p;
    return PollOne(cq_a_.get()).status;
  }

  std::vector<char> target_ = std::vector<char>(4096, 0);
  std::vector<char> src_ = std::vector<char>(4096, 0);
  std::unique_ptr<ProviderMr> target_mr_, src_mr_;
  std::unique_ptr<ProviderMw> mw_;
};

TEST_F(SoftBindPostTest, UnsignaledBindWorksAndReportsNothing) {
  uint32_t rkey = 0;
  ibv_send_wr bind = BindWr(7, 0, &rkey);
  ibv_send_wr* bad = nullptr;
  ASSERT_TRUE(b()->PostSend(&bind, &bad).ok());
  ASSERT_EQ(WriteThrough(rkey, 'x'), IBV_WC_SUCCESS);
  EXPECT_EQ(target_[0], 'x');
  EXPECT_EQ(target_[4095], 'x');
  // b's queue goes on in order: a signaled SEND after the bind is the only
  // completion b sees.
  char in[8] = {};
  auto in_mr = Reg(pd_a_.get(), in, sizeof(in));
  ibv_sge r = Sge(in, sizeof(in), in_mr->lkey());
  ASSERT_TRUE(PostRecv1(a(), 1, &r, 1).ok());
  uint64_t v = 42;
  ibv_sge s = Sge(&v, sizeof(v), 0);
  ASSERT_TRUE(
      PostSend1(b(), 8, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE | IBV_SEND_SIGNALED)
          .ok());
  ibv_wc wc = PollOne(cq_b_.get());
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 8u);
  EXPECT_EQ(PollOne(cq_a_.get()).wr_id, 1u);
  ExpectEmpty(cq_b_.get());
}

TEST_F(SoftBindPostTest, SignaledBindCompletesAsABind) {
  uint32_t rkey = 0;
  ibv_send_wr bind = BindWr(9, IBV_SEND_SIGNALED, &rkey);
  ibv_send_wr* bad = nullptr;
  ASSERT_TRUE(b()->PostSend(&bind, &bad).ok());
  ibv_wc wc = PollOne(cq_b_.get());
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 9u);
  EXPECT_EQ(wc.opcode, IBV_WC_BIND_MW);
  EXPECT_EQ(WriteThrough(rkey, 'y'), IBV_WC_SUCCESS);
  EXPECT_EQ(target_[100], 'y');
}

// The list [bind, SEND with too many SGEs] is posted up to the SEND, which
// is refused. The bind stays a WR in the queue like any other: when the QP
// goes to error before it was executed (here: inside a post batch, which
// holds the queue back), it is flushed -- coverbs' transport waits for the
// flushes of a list posted in part.
TEST_F(SoftBindPostTest, ListPostedInPartFlushesItsBind) {
  uint32_t rkey = 0;
  ibv_send_wr wrs[2];
  wrs[0] = BindWr(11, 0, &rkey);
  std::vector<ibv_sge> sges(17, Sge(src_.data(), 1, 0));
  wrs[1] = ibv_send_wr{};
  wrs[1].wr_id = 12;
  wrs[1].opcode = IBV_WR_SEND;
  wrs[1].sg_list = sges.data();
  wrs[1].num_sge = static_cast<int>(sges.size());  // max_send_sge is 16
  wrs[1].send_flags = IBV_SEND_SIGNALED;
  wrs[0].next = &wrs[1];
  ibv_send_wr* bad = nullptr;
  cq_b_->BeginBatch();
  absl::Status s = b()->PostSend(wrs, &bad);
  ASSERT_TRUE(b()->SetError().ok());
  cq_b_->EndBatch();
  ASSERT_FALSE(s.ok());
  ASSERT_EQ(bad, &wrs[1]) << s;
  ibv_wc wc = PollOne(cq_b_.get());
  EXPECT_EQ(wc.wr_id, 11u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
}

}  // namespace
}  // namespace coverbs::transport::soft::testing
