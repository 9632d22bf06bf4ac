// Error semantics of the soft provider: remote and local protection errors,
// RNR, length errors, flushes, peer loss, and post-time argument errors.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"
#include "transport/soft/soft_provider.h"

namespace coverbs::transport::soft::testing {
namespace {

class SoftErrorsTest : public SoftFixture {
 protected:
  // Both QPs end in IBV_QPS_ERR.
  void ExpectBothInError() {
    EXPECT_TRUE(WaitState(a(), IBV_QPS_ERR)) << "requester state "
                                             << a()->state();
    EXPECT_TRUE(WaitState(b(), IBV_QPS_ERR)) << "responder state "
                                             << b()->state();
  }
  // Runs one one-sided op from a() and returns its completion status.
  ibv_wc_status OneSided(ibv_wr_opcode op, void* local, uint32_t len,
                         uint32_t lkey, uint64_t remote, uint32_t rkey) {
    ibv_sge s = Sge(local, len, lkey);
    absl::Status st;
    if (op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
      st = PostAtomic(a(), 1, op, &s, remote, rkey, 0, 1);
    } else {
      st = PostSend1(a(), 1, op, &s, 1, IBV_SEND_SIGNALED, remote, rkey);
    }
    EXPECT_TRUE(st.ok()) << st;
    ibv_wc w = PollOne(cq_a_.get());
    EXPECT_EQ(w.wr_id, 1u);
    return w.status;
  }
};

TEST_F(SoftErrorsTest, WriteWithBadRkey) {
  Connect();
  std::vector<char> src(64), dst(64);
  auto smr = Reg(pd_a_.get(), src.data(), 64);
  auto dmr = Reg(pd_b_.get(), dst.data(), 64);
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, src.data(), 64, smr->lkey(),
                     reinterpret_cast<uintptr_t>(dst.data()),
                     dmr->rkey() ^ 0x1234),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, ReadOutOfBounds) {
  Connect();
  std::vector<char> local(128), remote(100);
  auto lmr = Reg(pd_a_.get(), local.data(), 128);
  auto rmr = Reg(pd_b_.get(), remote.data(), 100);
  EXPECT_EQ(OneSided(IBV_WR_RDMA_READ, local.data(), 64, lmr->lkey(),
                     reinterpret_cast<uintptr_t>(remote.data()) + 50,
                     rmr->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, WriteBelowRegion) {
  Connect();
  std::vector<char> local(64), remote(100);
  auto lmr = Reg(pd_a_.get(), local.data(), 64);
  auto rmr = Reg(pd_b_.get(), remote.data() + 10, 90);
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, local.data(), 8, lmr->lkey(),
                     reinterpret_cast<uintptr_t>(remote.data()),
                     rmr->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

struct AccessCase {
  const char* name;
  ibv_wr_opcode op;
  int remote_access;  // lacks the flag `op` needs
};

class SoftMissingAccessTest
    : public SoftErrorsTest,
      public ::testing::WithParamInterface<AccessCase> {};

TEST_P(SoftMissingAccessTest, RemoteAccessError) {
  Connect();
  alignas(8) uint64_t local = 0;
  alignas(8) uint64_t remote[4] = {};
  auto lmr = Reg(pd_a_.get(), &local, 8);
  auto rmr = Reg(pd_b_.get(), remote, sizeof(remote), GetParam().remote_access);
  ASSERT_NE(rmr, nullptr);
  EXPECT_EQ(OneSided(GetParam().op, &local, 8, lmr->lkey(),
                     reinterpret_cast<uintptr_t>(remote), rmr->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

INSTANTIATE_TEST_SUITE_P(
    Flags, SoftMissingAccessTest,
    ::testing::Values(
        AccessCase{"WriteNeedsRemoteWrite", IBV_WR_RDMA_WRITE,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                       IBV_ACCESS_REMOTE_ATOMIC},
        AccessCase{"ReadNeedsRemoteRead", IBV_WR_RDMA_READ,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                       IBV_ACCESS_REMOTE_ATOMIC},
        AccessCase{"CasNeedsRemoteAtomic", IBV_WR_ATOMIC_CMP_AND_SWP,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                       IBV_ACCESS_REMOTE_READ},
        AccessCase{"FaaNeedsRemoteAtomic", IBV_WR_ATOMIC_FETCH_AND_ADD,
                   IBV_ACCESS_LOCAL_WRITE}),
    [](const ::testing::TestParamInfo<AccessCase>& i) {
      return std::string(i.param.name);
    });

TEST_F(SoftErrorsTest, RemoteRegionInAnotherPd) {
  Connect();
  auto pd_c = *provider_->AllocPd();
  std::vector<char> local(64), remote(64);
  auto lmr = Reg(pd_a_.get(), local.data(), 64);
  auto rmr = Reg(pd_c.get(), remote.data(), 64);  // not b's PD
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, local.data(), 64, lmr->lkey(),
                     reinterpret_cast<uintptr_t>(remote.data()), rmr->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, MisalignedAtomic) {
  Connect();
  alignas(8) uint64_t local = 0;
  alignas(8) char remote[32] = {};
  auto lmr = Reg(pd_a_.get(), &local, 8);
  auto rmr = Reg(pd_b_.get(), remote, sizeof(remote));
  EXPECT_EQ(OneSided(IBV_WR_ATOMIC_FETCH_AND_ADD, &local, 8, lmr->lkey(),
                     reinterpret_cast<uintptr_t>(remote) + 4, rmr->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, DeregisteredRegion) {
  Connect();
  std::vector<char> local(64, 'x'), remote(64, 0);
  auto lmr = Reg(pd_a_.get(), local.data(), 64);
  auto rmr = Reg(pd_b_.get(), remote.data(), 64);
  uint32_t rkey = rmr->rkey();
  auto raddr = reinterpret_cast<uintptr_t>(remote.data());
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, local.data(), 64, lmr->lkey(), raddr,
                     rkey),
            IBV_WC_SUCCESS);
  EXPECT_EQ(remote[63], 'x');
  rmr.reset();  // deregistration takes effect at once
  std::memset(remote.data(), 0, 64);
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, local.data(), 64, lmr->lkey(), raddr,
                     rkey),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(remote[0], 0);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, RnrRetriesExhausted) {
  QpInit ia = Init(cq_a_.get());
  ia.rnr_retry = 2;
  QpInit ib = Init(cq_b_.get());
  ib.min_rnr_timer = 14;  // 1.28 ms in IB: the soft provider waits 128 us
  Connect(ia, ib);
  auto start = Clock::now();
  uint32_t v = 1;
  ibv_sge s = Sge(&v, 4, 0);
  ASSERT_TRUE(PostSend1(a(), 3, IBV_WR_SEND, &s, 1,
                        IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                  .ok());
  ASSERT_TRUE(PostSend1(a(), 4, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE).ok());
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 2);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].wr_id, 3u);
  EXPECT_EQ(w[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(w[1].wr_id, 4u);  // unsignaled, but flushed: it completes
  EXPECT_EQ(w[1].status, IBV_WC_WR_FLUSH_ERR);
  // Two retries, each after the responder's RNR delay.
  EXPECT_GE(Clock::now() - start, 2 * RnrTimerDelay(14));
  ExpectBothInError();
  ExpectEmpty(cq_b_.get());
}

TEST_F(SoftErrorsTest, SendLargerThanReceive) {
  Connect();
  std::vector<char> src(200, 's'), dst(100);
  auto smr = Reg(pd_a_.get(), src.data(), 200);
  auto dmr = Reg(pd_b_.get(), dst.data(), 100);
  ibv_sge r = Sge(dst.data(), 100, dmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 8, &r, 1).ok());
  ASSERT_TRUE(PostRecv1(b(), 9, &r, 1).ok());
  ibv_sge s = Sge(src.data(), 200, smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 7, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
  ibv_wc sw = PollOne(cq_a_.get());
  EXPECT_EQ(sw.wr_id, 7u);
  EXPECT_EQ(sw.status, IBV_WC_REM_INV_REQ_ERR);
  std::vector<ibv_wc> rw = PollN(cq_b_.get(), 2);
  ASSERT_EQ(rw.size(), 2u);
  EXPECT_EQ(rw[0].wr_id, 8u);
  EXPECT_EQ(rw[0].status, IBV_WC_LOC_LEN_ERR);
  EXPECT_EQ(rw[1].wr_id, 9u);
  EXPECT_EQ(rw[1].status, IBV_WC_WR_FLUSH_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, SendWithBadLkey) {
  Connect();
  std::vector<char> src(64), dst(64);
  auto smr = Reg(pd_a_.get(), src.data(), 64);
  auto dmr = Reg(pd_b_.get(), dst.data(), 64);
  ibv_sge r = Sge(dst.data(), 64, dmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
  ibv_sge s = Sge(src.data(), 64, smr->lkey() ^ 0x5a5a5a);
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
  ibv_wc w = PollOne(cq_a_.get());
  EXPECT_EQ(w.wr_id, 2u);
  EXPECT_EQ(w.status, IBV_WC_LOC_PROT_ERR);
  ExpectBothInError();
  // The responder's receive was never used: flushed.
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.wr_id, 1u);
  EXPECT_EQ(rw.status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(SoftErrorsTest, LocalProtectionCases) {
  struct Case {
    const char* what;
    ibv_wr_opcode op;
    int local_access;
    bool other_pd;
    int64_t off;  // SGE start relative to the region
  };
  const Case cases[] = {
      {"READ into a region without LOCAL_WRITE", IBV_WR_RDMA_READ,
       IBV_ACCESS_REMOTE_READ, false, 0},
      {"atomic result into a region without LOCAL_WRITE",
       IBV_WR_ATOMIC_FETCH_AND_ADD, 0, false, 0},
      {"SEND from another PD's region", IBV_WR_SEND, IBV_ACCESS_LOCAL_WRITE,
       true, 0},
      {"WRITE from beyond the region", IBV_WR_RDMA_WRITE,
       IBV_ACCESS_LOCAL_WRITE, false, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Connect();
    auto pd_c = *provider_->AllocPd();
    alignas(8) char local[16] = {};
    alignas(8) uint64_t remote[2] = {};
    auto lmr = Reg(c.other_pd ? pd_c.get() : pd_a_.get(), local, 8,
                   c.local_access);
    auto rmr = Reg(pd_b_.get(), remote, sizeof(remote));
    ibv_sge r = Sge(remote, 16, rmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
    EXPECT_EQ(OneSided(c.op, local + c.off, 8, lmr->lkey(),
                       reinterpret_cast<uintptr_t>(remote), rmr->rkey()),
              IBV_WC_LOC_PROT_ERR);
    ExpectBothInError();
    PollN(cq_b_.get(), 1);
    pair_ = QpPair();
  }
}

TEST_F(SoftErrorsTest, ReceiveWithBadLkey) {
  Connect();
  std::vector<char> src(64), dst(64);
  auto smr = Reg(pd_a_.get(), src.data(), 64);
  auto dmr = Reg(pd_b_.get(), dst.data(), 64);
  ibv_sge r = Sge(dst.data(), 64, dmr->lkey() + 1);
  ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());  // accepted, fails on use
  ibv_sge s = Sge(src.data(), 64, smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.wr_id, 1u);
  EXPECT_EQ(rw.status, IBV_WC_LOC_PROT_ERR);
  ibv_wc sw = PollOne(cq_a_.get());
  EXPECT_EQ(sw.wr_id, 2u);
  EXPECT_EQ(sw.status, IBV_WC_REM_OP_ERR);
  ExpectBothInError();
}

TEST_F(SoftErrorsTest, ErrorCompletionsKeepPostingOrder) {
  Connect();
  std::vector<char> src(64), dst(64);
  auto smr = Reg(pd_a_.get(), src.data(), 64);
  auto dmr = Reg(pd_b_.get(), dst.data(), 64);
  auto raddr = reinterpret_cast<uintptr_t>(dst.data());
  ibv_sge s = Sge(src.data(), 64, smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 1, IBV_WR_RDMA_WRITE, &s, 1, IBV_SEND_SIGNALED,
                        raddr, dmr->rkey())
                  .ok());
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_RDMA_WRITE, &s, 1, 0, raddr,
                        dmr->rkey())
                  .ok());
  ASSERT_TRUE(PostSend1(a(), 3, IBV_WR_RDMA_WRITE, &s, 1, IBV_SEND_SIGNALED,
                        raddr, dmr->rkey() + 7)
                  .ok());
  ASSERT_TRUE(PostSend1(a(), 4, IBV_WR_SEND, &s, 1, 0).ok());
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 3);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].wr_id, 1u);
  EXPECT_EQ(w[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(w[1].wr_id, 3u);  // wr 2 succeeded unsignaled: no completion
  EXPECT_EQ(w[1].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(w[2].wr_id, 4u);
  EXPECT_EQ(w[2].status, IBV_WC_WR_FLUSH_ERR);
  ExpectEmpty(cq_a_.get());
}

TEST_F(SoftErrorsTest, SetErrorFlushesEverything) {
  QpInit ia = Init(cq_a_.get());
  ia.max_recv_wr = 1000;
  Connect(ia, Init(cq_b_.get()));
  std::vector<char> buf(1000 * 16);
  auto mr = Reg(pd_a_.get(), buf.data(), buf.size());
  for (int i = 0; i < 1000; ++i) {
    ibv_sge r = Sge(&buf[i * 16], 16, mr->lkey());
    ASSERT_TRUE(PostRecv1(a(), i, &r, 1).ok());
  }
  // Sends the peer cannot take (no receives there; rnr_retry 7 = forever).
  uint32_t v = 0;
  ibv_sge s = Sge(&v, 4, 0);
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(PostSend1(a(), 5000 + i, IBV_WR_SEND, &s, 1,
                          IBV_SEND_INLINE | (i % 3 == 0 ? IBV_SEND_SIGNALED
                                                        : 0))
                    .ok());
  }
  ExpectEmpty(cq_a_.get(), std::chrono::milliseconds(20));
  ASSERT_TRUE(a()->SetError().ok());
  EXPECT_EQ(a()->state(), IBV_QPS_ERR);
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 1010);
  ASSERT_EQ(w.size(), 1010u);
  int next_recv = 0, next_send = 5000;
  for (const ibv_wc& c : w) {
    ASSERT_EQ(c.status, IBV_WC_WR_FLUSH_ERR);
    ASSERT_EQ(c.qp_num, a()->qp_num());
    if (c.opcode == IBV_WC_RECV) {
      ASSERT_EQ(c.wr_id, static_cast<uint64_t>(next_recv++));
    } else {
      // Unsignaled WRs get a flush completion too.
      ASSERT_EQ(c.wr_id, static_cast<uint64_t>(next_send++));
    }
  }
  EXPECT_EQ(next_recv, 1000);
  EXPECT_EQ(next_send, 5010);
  // Later posts are flushed as well.
  ibv_sge r = Sge(buf.data(), 16, mr->lkey());
  ASSERT_TRUE(PostRecv1(a(), 77, &r, 1).ok());
  ASSERT_TRUE(PostSend1(a(), 78, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE).ok());
  std::vector<ibv_wc> later = PollN(cq_a_.get(), 2);
  ASSERT_EQ(later.size(), 2u);
  for (const ibv_wc& c : later) EXPECT_EQ(c.status, IBV_WC_WR_FLUSH_ERR);
  // The peer learns of it.
  EXPECT_TRUE(WaitState(b(), IBV_QPS_ERR));
  ExpectEmpty(cq_a_.get());
}

TEST_F(SoftErrorsTest, PeerDestroyedFlushesLocalQp) {
  Connect();
  std::vector<char> buf(100 * 8);
  auto mr = Reg(pd_a_.get(), buf.data(), buf.size());
  for (int i = 0; i < 100; ++i) {
    ibv_sge r = Sge(&buf[i * 8], 8, mr->lkey());
    ASSERT_TRUE(PostRecv1(a(), i, &r, 1).ok());
  }
  uint32_t v = 0;
  ibv_sge s = Sge(&v, 4, 0);
  ASSERT_TRUE(PostSend1(a(), 500, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE).ok());
  ExpectEmpty(cq_a_.get(), std::chrono::milliseconds(10));
  pair_.b.reset();
  EXPECT_TRUE(WaitState(a(), IBV_QPS_ERR));
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 101);
  ASSERT_EQ(w.size(), 101u);
  int next = 0;
  for (const ibv_wc& c : w) {
    EXPECT_EQ(c.status, IBV_WC_WR_FLUSH_ERR);
    if (c.opcode == IBV_WC_RECV) {
      EXPECT_EQ(c.wr_id, static_cast<uint64_t>(next++));
    } else {
      EXPECT_EQ(c.wr_id, 500u);
    }
  }
}

TEST_F(SoftErrorsTest, BrokenConnectionIsFatal) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  auto qp = CreateQpOnSocket(pd_a_.get(), Init(cq_a_.get()), sv[0]);
  ASSERT_TRUE(qp.ok()) << qp.status();
  char junk[64];
  std::memset(junk, 0x7f, sizeof(junk));
  ASSERT_EQ(write(sv[1], junk, sizeof(junk)), 64);  // not a hello
  EXPECT_TRUE(WaitState(qp->get(), IBV_QPS_ERR));
  pollfd p{provider_->async_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1);
  auto ev = provider_->GetAsyncEvent();
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_EQ(ev->type, IBV_EVENT_QP_FATAL);
  EXPECT_EQ(ev->qp_num, (*qp)->qp_num());
  EXPECT_NE(ev->description.find("protocol error"), std::string::npos)
      << ev->description;
  close(sv[1]);
}

// A WRITE with a bad rkey: the responder refused it, so its QP reports an
// access violation (IBV_EVENT_QP_ACCESS_ERR, as a verbs responder); the
// requester, which got IBV_WC_REM_ACCESS_ERR, raises IBV_EVENT_QP_FATAL.
TEST_F(SoftErrorsTest, FaultRaisesAccessErrOnTheResponderAndQpFatalOnTheRequester) {
  Connect();
  EXPECT_TRUE(absl::IsNotFound(provider_->GetAsyncEvent().status()));
  std::vector<char> src(8), dst(8);
  auto smr = Reg(pd_a_.get(), src.data(), 8);
  EXPECT_EQ(OneSided(IBV_WR_RDMA_WRITE, src.data(), 8, smr->lkey(),
                     reinterpret_cast<uintptr_t>(dst.data()), 0x1),
            IBV_WC_REM_ACCESS_ERR);
  ExpectBothInError();
  std::map<uint32_t, ibv_event_type> got;
  for (int i = 0; i < 2; ++i) {
    pollfd p{provider_->async_fd(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 5000), 1);
    auto ev = provider_->GetAsyncEvent();
    ASSERT_TRUE(ev.ok()) << ev.status();
    got[ev->qp_num] = ev->type;
  }
  std::map<uint32_t, ibv_event_type> want = {
      {a()->qp_num(), IBV_EVENT_QP_FATAL},
      {b()->qp_num(), IBV_EVENT_QP_ACCESS_ERR}};
  EXPECT_EQ(got, want);
  pollfd p{provider_->async_fd(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0);
}

TEST_F(SoftErrorsTest, SetErrorIsNotAFault) {
  Connect();
  ASSERT_TRUE(a()->SetError().ok());
  EXPECT_TRUE(WaitState(b(), IBV_QPS_ERR));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(absl::IsNotFound(provider_->GetAsyncEvent().status()));
}

TEST_F(SoftErrorsTest, PostTimeErrors) {
  QpInit ia = Init(cq_a_.get());
  ia.max_send_wr = 4;
  ia.max_send_sge = 2;
  ia.max_recv_sge = 2;
  Connect(ia, Init(cq_b_.get()));
  uint64_t v = 0;
  ibv_sge sg[3] = {Sge(&v, 8, 0), Sge(&v, 8, 0), Sge(&v, 8, 0)};
  ibv_send_wr* bad = nullptr;

  ibv_send_wr too_many{};
  too_many.opcode = IBV_WR_SEND;
  too_many.sg_list = sg;
  too_many.num_sge = 3;
  EXPECT_TRUE(absl::IsInvalidArgument(a()->PostSend(&too_many, &bad)));
  EXPECT_EQ(bad, &too_many);

  ibv_send_wr short_atomic{};
  ibv_sge four = Sge(&v, 4, 0);
  short_atomic.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  short_atomic.sg_list = &four;
  short_atomic.num_sge = 1;
  bad = nullptr;
  EXPECT_TRUE(absl::IsInvalidArgument(a()->PostSend(&short_atomic, &bad)));
  EXPECT_EQ(bad, &short_atomic);

  // An opcode soft does not offer on RC (LOCAL_INV and BIND_MW it does:
  // memory windows).
  ibv_send_wr odd_op{};
  odd_op.opcode = IBV_WR_TSO;
  bad = nullptr;
  EXPECT_TRUE(absl::IsInvalidArgument(a()->PostSend(&odd_op, &bad)));
  EXPECT_EQ(bad, &odd_op);

  ibv_recv_wr rwr{};
  rwr.sg_list = sg;
  rwr.num_sge = 3;
  ibv_recv_wr* rbad = nullptr;
  EXPECT_TRUE(absl::IsInvalidArgument(a()->PostRecv(&rwr, &rbad)));
  EXPECT_EQ(rbad, &rwr);

  // Queue full: b has no receives, so SENDs stay outstanding (RNR).
  ibv_send_wr list[6];
  for (int i = 0; i < 6; ++i) {
    list[i] = ibv_send_wr{};
    list[i].wr_id = i;
    list[i].opcode = IBV_WR_SEND;
    list[i].sg_list = sg;
    list[i].num_sge = 1;
    list[i].send_flags = IBV_SEND_INLINE;
    list[i].next = i < 5 ? &list[i + 1] : nullptr;
  }
  bad = nullptr;
  absl::Status st = a()->PostSend(list, &bad);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(bad, &list[4]);
  // Exactly the first four were posted.
  ASSERT_TRUE(a()->SetError().ok());
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 4);
  ASSERT_EQ(w.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(w[i].wr_id, static_cast<uint64_t>(i));
    EXPECT_EQ(w[i].status, IBV_WC_WR_FLUSH_ERR);
  }
  ExpectEmpty(cq_a_.get());
}

TEST_F(SoftErrorsTest, DestroyWithWorkInFlight) {
  for (int round = 0; round < 3; ++round) {
    Connect();
    constexpr size_t kSize = 1 << 20;
    std::vector<char> src(kSize), dst(4 * kSize);
    auto smr = Reg(pd_a_.get(), src.data(), src.size());
    auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
    for (int i = 0; i < 4; ++i) {
      ibv_sge r = Sge(&dst[i * kSize], kSize, dmr->lkey());
      ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
    }
    for (int i = 0; i < 16; ++i) {
      ibv_sge s = Sge(src.data(), kSize, smr->lkey());
      ASSERT_TRUE(PostSend1(a(), i, i % 2 ? IBV_WR_SEND : IBV_WR_RDMA_WRITE,
                            &s, 1, IBV_SEND_SIGNALED,
                            reinterpret_cast<uintptr_t>(dst.data()),
                            dmr->rkey())
                      .ok());
    }
    // No drain: the QPs go while data is on the wire.
    if (round == 0) pair_.a.reset();
    if (round == 1) pair_.b.reset();
    pair_ = QpPair();
    // Whatever completions were made are well-formed.
    ibv_wc wc[64];
    while (cq_a_->Poll(64, wc) > 0) {
    }
    while (cq_b_->Poll(64, wc) > 0) {
    }
  }
}

}  // namespace
}  // namespace coverbs::transport::soft::testing
