// Data-path conformance of the soft provider: every verb, with data checks.
#include "transport/soft/soft_provider.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"

namespace coverbs::transport::soft::testing {
namespace {

using SoftProviderTest = SoftFixture;

TEST_F(SoftProviderTest, Caps) {
  const DeviceCaps& c = provider_->caps();
  EXPECT_EQ(c.provider, "soft");
  EXPECT_EQ(c.device_name, "soft0");
  EXPECT_EQ(c.transport, TransportKind::kSoft);
  EXPECT_TRUE(c.atomics);
  EXPECT_TRUE(c.write_with_imm);
  EXPECT_TRUE(c.send_with_imm);
  EXPECT_FALSE(c.active_side_sends_first);
  EXPECT_EQ(c.max_inline_data, 256u);
  EXPECT_EQ(c.max_sge, 16u);
  EXPECT_EQ(c.max_qp_wr, 16384u);
  EXPECT_EQ(c.max_cqe, 65536u);
  EXPECT_GE(provider_->async_fd(), 0);
}

TEST_F(SoftProviderTest, ConnectedPairIsRts) {
  Connect();
  EXPECT_NE(a()->qp_num(), b()->qp_num());
  EXPECT_GE(a()->qp_num(), 2u);
  EXPECT_LT(a()->qp_num(), 1u << 24);
  EXPECT_EQ(a()->max_send_wr(), 256u);
  EXPECT_EQ(a()->max_recv_wr(), 1024u);
  EXPECT_EQ(a()->max_inline_data(), 256u);
}

TEST_F(SoftProviderTest, SendRecvMultipleSges) {
  Connect();
  std::vector<char> src(8192), dst(16384, 0);
  Fill(src, 1);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  // Receive: 2000 + 10 + 3000 + 2000 bytes, scattered with gaps.
  ibv_sge r[4] = {Sge(&dst[0], 2000, dmr->lkey()),
                  Sge(&dst[3000], 10, dmr->lkey()),
                  Sge(&dst[4000], 3000, dmr->lkey()),
                  Sge(&dst[9000], 2000, dmr->lkey())};
  ASSERT_TRUE(PostRecv1(b(), 77, r, 4).ok());
  // Send: 100 + 0 + 1000 + 5000 bytes from separate places.
  ibv_sge s[4] = {Sge(&src[0], 100, smr->lkey()), Sge(&src[200], 0, 0),
                  Sge(&src[500], 1000, smr->lkey()),
                  Sge(&src[3000], 5000, smr->lkey())};
  ASSERT_TRUE(PostSend1(a(), 11, IBV_WR_SEND, s, 4, IBV_SEND_SIGNALED).ok());

  ibv_wc sw = PollOne(cq_a_.get());
  EXPECT_EQ(sw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(sw.opcode, IBV_WC_SEND);
  EXPECT_EQ(sw.wr_id, 11u);
  EXPECT_EQ(sw.qp_num, a()->qp_num());
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rw.opcode, IBV_WC_RECV);
  EXPECT_EQ(rw.wr_id, 77u);
  EXPECT_EQ(rw.byte_len, 6100u);
  EXPECT_EQ(rw.qp_num, b()->qp_num());
  EXPECT_EQ(rw.src_qp, a()->qp_num());
  EXPECT_EQ(rw.wc_flags & IBV_WC_WITH_IMM, 0);

  std::vector<char> want;
  want.insert(want.end(), &src[0], &src[100]);
  want.insert(want.end(), &src[500], &src[1500]);
  want.insert(want.end(), &src[3000], &src[8000]);
  std::vector<char> got;
  got.insert(got.end(), &dst[0], &dst[2000]);
  got.insert(got.end(), &dst[3000], &dst[3010]);
  got.insert(got.end(), &dst[4000], &dst[7000]);
  got.insert(got.end(), &dst[9000], &dst[11000]);
  got.resize(6100);
  EXPECT_EQ(got, want);
  // Nothing written outside the receive SGEs or past the message.
  EXPECT_EQ(dst[2500], 0);
  EXPECT_EQ(dst[3500], 0);
  EXPECT_EQ(dst[9000 + 2000 - 1 - (11000 - 9000 - (6100 - 5010))], src[7999]);
  EXPECT_EQ(dst[10090], 0);
}

TEST_F(SoftProviderTest, InlineSendCopiesAtPost) {
  Connect();
  std::vector<char> dst(512, 0);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  ibv_sge r = Sge(dst.data(), 512, dmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
  char msg[200];
  for (int i = 0; i < 200; ++i) msg[i] = static_cast<char>(i);
  // Unregistered buffer, bogus lkey: inline data is not checked.
  ibv_sge s[2] = {Sge(msg, 50, 0xdead), Sge(msg + 50, 150, 0)};
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_SEND, s, 2,
                        IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                  .ok());
  std::memset(msg, 0x55, sizeof(msg));  // reusable right after the post
  EXPECT_EQ(PollOne(cq_a_.get()).status, IBV_WC_SUCCESS);
  ibv_wc rw = PollOne(cq_b_.get());
  ASSERT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rw.byte_len, 200u);
  for (int i = 0; i < 200; ++i) ASSERT_EQ(dst[i], static_cast<char>(i));

  // Larger than max_inline_data: rejected at post with *bad set.
  std::vector<char> big(300);
  ibv_sge bs = Sge(big.data(), 300, 0);
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &bs;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  absl::Status st = a()->PostSend(&wr, &bad);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_EQ(bad, &wr);
}

TEST_F(SoftProviderTest, SendWithImm) {
  Connect();
  std::vector<char> src(64, 'x'), dst(64);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  ibv_sge r = Sge(dst.data(), 64, dmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 5, &r, 1).ok());
  ibv_sge s = Sge(src.data(), 64, smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 6, IBV_WR_SEND_WITH_IMM, &s, 1,
                        IBV_SEND_SIGNALED, 0, 0, htonl(0x12345678))
                  .ok());
  ibv_wc rw = PollOne(cq_b_.get());
  ASSERT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rw.opcode, IBV_WC_RECV);
  EXPECT_TRUE(rw.wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(rw.imm_data, htonl(0x12345678));
  EXPECT_EQ(rw.byte_len, 64u);
  ibv_wc sw = PollOne(cq_a_.get());
  EXPECT_EQ(sw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(sw.opcode, IBV_WC_SEND);
}

TEST_F(SoftProviderTest, RdmaWrite) {
  Connect();
  std::vector<char> src(64 * 1024), dst(128 * 1024, 0);
  Fill(src, 3);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  ibv_sge s = Sge(src.data(), src.size(), smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 9, IBV_WR_RDMA_WRITE, &s, 1, IBV_SEND_SIGNALED,
                        reinterpret_cast<uintptr_t>(&dst[1000]), dmr->rkey())
                  .ok());
  ibv_wc sw = PollOne(cq_a_.get());
  ASSERT_EQ(sw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(sw.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(sw.wr_id, 9u);
  // The completion means the data is placed.
  EXPECT_EQ(std::memcmp(&dst[1000], src.data(), src.size()), 0);
  EXPECT_EQ(dst[999], 0);
  EXPECT_EQ(dst[1000 + src.size()], 0);
  ExpectEmpty(cq_b_.get());  // no receive consumed, no completion
}

TEST_F(SoftProviderTest, RdmaWriteWithImmConsumesRecv) {
  Connect();
  std::vector<char> src(1000), dst(4096, 0);
  Fill(src, 4);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  ASSERT_TRUE(PostRecv1(b(), 42, nullptr, 0).ok());
  ibv_sge s = Sge(src.data(), src.size(), smr->lkey());
  ASSERT_TRUE(PostSend1(a(), 43, IBV_WR_RDMA_WRITE_WITH_IMM, &s, 1,
                        IBV_SEND_SIGNALED,
                        reinterpret_cast<uintptr_t>(&dst[100]), dmr->rkey(),
                        htonl(0xabcdef01))
                  .ok());
  ibv_wc rw = PollOne(cq_b_.get());
  ASSERT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rw.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(rw.wr_id, 42u);
  EXPECT_EQ(rw.byte_len, 1000u);
  EXPECT_TRUE(rw.wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(rw.imm_data, htonl(0xabcdef01));
  EXPECT_EQ(rw.src_qp, a()->qp_num());
  EXPECT_EQ(std::memcmp(&dst[100], src.data(), src.size()), 0);
  ibv_wc sw = PollOne(cq_a_.get());
  EXPECT_EQ(sw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(sw.opcode, IBV_WC_RDMA_WRITE);
}

TEST_F(SoftProviderTest, RdmaRead) {
  Connect();
  std::vector<char> remote(100000), local(100000, 0);
  Fill(remote, 5);
  auto rmr = Reg(pd_b_.get(), remote.data(), remote.size(),
                 IBV_ACCESS_REMOTE_READ);
  auto lmr = Reg(pd_a_.get(), local.data(), local.size(),
                 IBV_ACCESS_LOCAL_WRITE);
  ibv_sge s[2] = {Sge(&local[0], 30000, lmr->lkey()),
                  Sge(&local[50000], 40000, lmr->lkey())};
  ASSERT_TRUE(PostSend1(a(), 7, IBV_WR_RDMA_READ, s, 2, IBV_SEND_SIGNALED,
                        reinterpret_cast<uintptr_t>(&remote[5000]),
                        rmr->rkey())
                  .ok());
  ibv_wc w = PollOne(cq_a_.get());
  ASSERT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(w.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(w.byte_len, 70000u);
  EXPECT_EQ(std::memcmp(&local[0], &remote[5000], 30000), 0);
  EXPECT_EQ(std::memcmp(&local[50000], &remote[35000], 40000), 0);
  EXPECT_EQ(local[30000], 0);
  ExpectEmpty(cq_b_.get());
}

TEST_F(SoftProviderTest, Atomics) {
  Connect();
  alignas(8) uint64_t target[2] = {100, 7};
  alignas(8) uint64_t result = 0;
  auto tmr = Reg(pd_b_.get(), target, sizeof(target),
                 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
  auto rmr = Reg(pd_a_.get(), &result, 8, IBV_ACCESS_LOCAL_WRITE);
  ibv_sge s = Sge(&result, 8, rmr->lkey());
  auto addr = reinterpret_cast<uintptr_t>(&target[0]);

  // Compare matches: swapped, original returned.
  ASSERT_TRUE(PostAtomic(a(), 1, IBV_WR_ATOMIC_CMP_AND_SWP, &s, addr,
                         tmr->rkey(), 100, 555)
                  .ok());
  ibv_wc w = PollOne(cq_a_.get());
  ASSERT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(w.opcode, IBV_WC_COMP_SWAP);
  EXPECT_EQ(w.byte_len, 8u);
  EXPECT_EQ(result, 100u);
  EXPECT_EQ(target[0], 555u);

  // Compare fails: unchanged, current value returned.
  ASSERT_TRUE(PostAtomic(a(), 2, IBV_WR_ATOMIC_CMP_AND_SWP, &s, addr,
                         tmr->rkey(), 100, 999)
                  .ok());
  w = PollOne(cq_a_.get());
  ASSERT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(result, 555u);
  EXPECT_EQ(target[0], 555u);

  // Fetch-and-add on the second word.
  ASSERT_TRUE(PostAtomic(a(), 3, IBV_WR_ATOMIC_FETCH_AND_ADD, &s,
                         reinterpret_cast<uintptr_t>(&target[1]),
                         tmr->rkey(), 35, 0)
                  .ok());
  w = PollOne(cq_a_.get());
  ASSERT_EQ(w.status, IBV_WC_SUCCESS);
  EXPECT_EQ(w.opcode, IBV_WC_FETCH_ADD);
  EXPECT_EQ(result, 7u);
  EXPECT_EQ(target[1], 42u);

  // Many adds in flight are each atomic.
  constexpr int kAdds = 200;
  std::vector<uint64_t> results(kAdds);
  auto resmr = Reg(pd_a_.get(), results.data(), results.size() * 8,
                   IBV_ACCESS_LOCAL_WRITE);
  for (int i = 0; i < kAdds; ++i) {
    ibv_sge rs = Sge(&results[i], 8, resmr->lkey());
    ASSERT_TRUE(PostAtomic(a(), 100 + i, IBV_WR_ATOMIC_FETCH_AND_ADD, &rs,
                           reinterpret_cast<uintptr_t>(&target[1]),
                           tmr->rkey(), 1, 0)
                    .ok());
  }
  std::vector<ibv_wc> ws = PollN(cq_a_.get(), kAdds);
  ASSERT_EQ(ws.size(), static_cast<size_t>(kAdds));
  for (int i = 0; i < kAdds; ++i) {
    EXPECT_EQ(ws[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(ws[i].wr_id, 100u + i);
    EXPECT_EQ(results[i], 42u + i);
  }
  EXPECT_EQ(target[1], 42u + kAdds);
}

TEST_F(SoftProviderTest, SelectiveSignaling) {
  QpInit ia = Init(cq_a_.get());
  QpInit ib = Init(cq_b_.get());
  ib.max_recv_wr = 10000;
  Connect(ia, ib);
  constexpr int kMsgs = 10000;
  constexpr int kEvery = 64;
  std::vector<uint32_t> src(kMsgs), dst(kMsgs, 0);
  for (int i = 0; i < kMsgs; ++i) src[i] = i;
  auto smr = Reg(pd_a_.get(), src.data(), src.size() * 4);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size() * 4);
  for (int i = 0; i < kMsgs; ++i) {
    ibv_sge r = Sge(&dst[i], 4, dmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  // Send-queue accounting as a verbs user must do it: a slot is free again
  // only once a later signaled WR completed.
  int posted = 0, signaled = 0, send_cqes = 0;
  std::vector<int> chunk_ends;
  while (posted < kMsgs) {
    while (posted - (send_cqes ? chunk_ends[send_cqes - 1] : 0) + kEvery >
               static_cast<int>(a()->max_send_wr()) &&
           send_cqes < signaled) {
      ibv_wc w = PollOne(cq_a_.get());
      ASSERT_EQ(w.status, IBV_WC_SUCCESS);
      ASSERT_EQ(w.wr_id, static_cast<uint64_t>(chunk_ends[send_cqes] - 1));
      ++send_cqes;
    }
    int n = std::min(kEvery, kMsgs - posted);
    std::vector<ibv_send_wr> wrs(n);
    std::vector<ibv_sge> sges(n);
    for (int k = 0; k < n; ++k) {
      sges[k] = Sge(&src[posted + k], 4, smr->lkey());
      wrs[k] = ibv_send_wr{};
      wrs[k].wr_id = posted + k;
      wrs[k].opcode = IBV_WR_SEND;
      wrs[k].sg_list = &sges[k];
      wrs[k].num_sge = 1;
      wrs[k].send_flags = k == n - 1 ? IBV_SEND_SIGNALED : 0;
      wrs[k].next = k + 1 < n ? &wrs[k + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    ASSERT_TRUE(a()->PostSend(wrs.data(), &bad).ok());
    posted += n;
    chunk_ends.push_back(posted);
    ++signaled;
  }
  while (send_cqes < signaled) {
    ibv_wc w = PollOne(cq_a_.get());
    ASSERT_EQ(w.status, IBV_WC_SUCCESS);
    ASSERT_EQ(w.wr_id, static_cast<uint64_t>(chunk_ends[send_cqes] - 1));
    ++send_cqes;
  }
  EXPECT_EQ(signaled, (kMsgs + kEvery - 1) / kEvery);
  ExpectEmpty(cq_a_.get());  // unsignaled sends made no completion
  std::vector<ibv_wc> rws = PollN(cq_b_.get(), kMsgs);
  ASSERT_EQ(rws.size(), static_cast<size_t>(kMsgs));
  for (int i = 0; i < kMsgs; ++i) {
    ASSERT_EQ(rws[i].status, IBV_WC_SUCCESS);
    ASSERT_EQ(rws[i].wr_id, static_cast<uint64_t>(i));  // RC order
    ASSERT_EQ(dst[i], static_cast<uint32_t>(i));
  }
}

TEST_F(SoftProviderTest, SqSigAllSignalsEverything) {
  QpInit ia = Init(cq_a_.get());
  ia.sq_sig_all = true;
  Connect(ia, Init(cq_b_.get()));
  std::vector<char> dst(100 * 8);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  for (int i = 0; i < 100; ++i) {
    ibv_sge s = Sge(&i, 4, 0);
    ASSERT_TRUE(
        PostSend1(a(), i, IBV_WR_RDMA_WRITE, &s, 1, IBV_SEND_INLINE,
                  reinterpret_cast<uintptr_t>(&dst[i * 8]), dmr->rkey())
            .ok());
  }
  std::vector<ibv_wc> ws = PollN(cq_a_.get(), 100);
  ASSERT_EQ(ws.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(ws[i].wr_id, static_cast<uint64_t>(i));
}

TEST_F(SoftProviderTest, WriteThenSendIsOrdered) {
  Connect();
  alignas(8) uint64_t flag_src = 0;
  alignas(8) uint64_t target = 0;
  char note[8], got[8];
  auto smr = Reg(pd_a_.get(), &flag_src, 8);
  auto tmr = Reg(pd_b_.get(), &target, 8);
  auto nmr = Reg(pd_a_.get(), note, sizeof(note));
  auto gmr = Reg(pd_b_.get(), got, sizeof(got));
  for (uint64_t i = 1; i <= 300; ++i) {
    ibv_sge r = Sge(got, 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
    flag_src = i;
    ibv_sge ws = Sge(&flag_src, 8, smr->lkey());
    ASSERT_TRUE(PostSend1(a(), 1000 + i, IBV_WR_RDMA_WRITE, &ws, 1, 0,
                          reinterpret_cast<uintptr_t>(&target), tmr->rkey())
                    .ok());
    ibv_sge ss = Sge(note, 8, nmr->lkey());
    ASSERT_TRUE(PostSend1(a(), i, IBV_WR_SEND, &ss, 1, IBV_SEND_SIGNALED).ok());
    ibv_wc rw = PollOne(cq_b_.get());
    ASSERT_EQ(rw.status, IBV_WC_SUCCESS);
    // The SEND landed after the WRITE it follows.
    ASSERT_EQ(target, i);
    ibv_wc sw = PollOne(cq_a_.get());
    ASSERT_EQ(sw.status, IBV_WC_SUCCESS);
    ASSERT_EQ(sw.wr_id, i);
  }
}

TEST_F(SoftProviderTest, LargeTransfers) {
  Connect();
  constexpr size_t kSend = 8 << 20, kRdma = 16 << 20;
  std::vector<char> s1(kSend), d1(kSend, 0), s2(kRdma), d2(kRdma, 0),
      d3(kRdma, 0);
  Fill(s1, 11);
  Fill(s2, 12);
  auto m1 = Reg(pd_a_.get(), s1.data(), s1.size());
  auto m2 = Reg(pd_b_.get(), d1.data(), d1.size());
  auto m3 = Reg(pd_a_.get(), s2.data(), s2.size());
  auto m4 = Reg(pd_b_.get(), d2.data(), d2.size());
  auto m5 = Reg(pd_a_.get(), d3.data(), d3.size());
  ibv_sge r = Sge(d1.data(), kSend, m2->lkey());
  ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
  ibv_sge s = Sge(s1.data(), kSend, m1->lkey());
  ASSERT_TRUE(PostSend1(a(), 1, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
  ibv_sge w = Sge(s2.data(), kRdma, m3->lkey());
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_RDMA_WRITE, &w, 1, IBV_SEND_SIGNALED,
                        reinterpret_cast<uintptr_t>(d2.data()), m4->rkey())
                  .ok());
  ibv_sge rd = Sge(d3.data(), kRdma, m5->lkey());
  ASSERT_TRUE(PostSend1(a(), 3, IBV_WR_RDMA_READ, &rd, 1, IBV_SEND_SIGNALED,
                        reinterpret_cast<uintptr_t>(d2.data()), m4->rkey())
                  .ok());
  std::vector<ibv_wc> ws = PollN(cq_a_.get(), 3);
  ASSERT_EQ(ws.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ws[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(ws[i].wr_id, static_cast<uint64_t>(i + 1));
  }
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.byte_len, kSend);
  EXPECT_TRUE(s1 == d1);
  EXPECT_TRUE(s2 == d2);
  EXPECT_TRUE(s2 == d3);  // the READ saw the WRITE before it
}

TEST_F(SoftProviderTest, BidirectionalTraffic) {
  Connect();
  constexpr int kMsgs = 2000;
  std::vector<uint32_t> sa(kMsgs), sb(kMsgs), ra(kMsgs), rb(kMsgs);
  for (int i = 0; i < kMsgs; ++i) {
    sa[i] = i;
    sb[i] = 1000000 + i;
  }
  auto msa = Reg(pd_a_.get(), sa.data(), kMsgs * 4);
  auto mra = Reg(pd_a_.get(), ra.data(), kMsgs * 4);
  auto msb = Reg(pd_b_.get(), sb.data(), kMsgs * 4);
  auto mrb = Reg(pd_b_.get(), rb.data(), kMsgs * 4);
  int recv_a = 0, recv_b = 0, sent_a = 0, sent_b = 0, done_a = 0, done_b = 0;
  for (int i = 0; i < 1000; ++i) {
    ibv_sge x = Sge(&ra[i], 4, mra->lkey());
    ASSERT_TRUE(PostRecv1(a(), i, &x, 1).ok());
    ibv_sge y = Sge(&rb[i], 4, mrb->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &y, 1).ok());
  }
  int posted_ra = 1000, posted_rb = 1000;
  auto deadline = Clock::now() + kWait;
  while ((recv_a < kMsgs || recv_b < kMsgs || done_a < kMsgs ||
          done_b < kMsgs) &&
         Clock::now() < deadline) {
    while (sent_a < kMsgs && sent_a - done_a < 200) {
      ibv_sge s = Sge(&sa[sent_a], 4, msa->lkey());
      ASSERT_TRUE(
          PostSend1(a(), sent_a, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
      ++sent_a;
    }
    while (sent_b < kMsgs && sent_b - done_b < 200) {
      ibv_sge s = Sge(&sb[sent_b], 4, msb->lkey());
      ASSERT_TRUE(
          PostSend1(b(), sent_b, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
      ++sent_b;
    }
    ibv_wc wc[32];
    for (auto [cq, qp, recv, done, posted, rbuf, mr] :
         {std::tuple{cq_a_.get(), a(), &recv_a, &done_a, &posted_ra, &ra,
                     mra.get()},
          std::tuple{cq_b_.get(), b(), &recv_b, &done_b, &posted_rb, &rb,
                     mrb.get()}}) {
      int n = cq->Poll(32, wc);
      ASSERT_GE(n, 0);
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(wc[k].status, IBV_WC_SUCCESS);
        if (wc[k].opcode == IBV_WC_RECV) {
          ASSERT_EQ(wc[k].wr_id, static_cast<uint64_t>(*recv));
          ++*recv;
          if (*posted < kMsgs) {
            ibv_sge x = Sge(&(*rbuf)[*posted], 4, mr->lkey());
            ASSERT_TRUE(PostRecv1(qp, *posted, &x, 1).ok());
            ++*posted;
          }
        } else {
          ASSERT_EQ(wc[k].wr_id, static_cast<uint64_t>(*done));
          ++*done;
        }
      }
    }
  }
  ASSERT_EQ(recv_a, kMsgs);
  ASSERT_EQ(recv_b, kMsgs);
  for (int i = 0; i < kMsgs; ++i) {
    ASSERT_EQ(ra[i], static_cast<uint32_t>(1000000 + i));
    ASSERT_EQ(rb[i], static_cast<uint32_t>(i));
  }
}

TEST_F(SoftProviderTest, SharedReceiveQueue) {
  auto srq = pd_b_->CreateSrq(64, 2);
  ASSERT_TRUE(srq.ok()) << srq.status();
  QpInit ib = Init(cq_b_.get());
  ib.srq = srq->get();
  auto p1 = provider_->CreateConnectedPair(pd_a_.get(), Init(cq_a_.get()),
                                           pd_b_.get(), ib);
  auto p2 = provider_->CreateConnectedPair(pd_a_.get(), Init(cq_a_.get()),
                                           pd_b_.get(), ib);
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(p1->b->max_recv_wr(), 0u);
  // A QP on an SRQ does not take receives itself.
  EXPECT_TRUE(absl::IsInvalidArgument(PostRecv1(p1->b.get(), 0, nullptr, 0)));
  std::vector<uint32_t> dst(10, 0);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size() * 4);
  for (int i = 0; i < 10; ++i) {
    ibv_sge r = Sge(&dst[i], 4, dmr->lkey());
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &r;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_TRUE((*srq)->PostRecv(&wr, &bad).ok());
  }
  for (uint32_t i = 0; i < 5; ++i) {
    uint32_t v1 = 100 + i, v2 = 200 + i;
    ibv_sge s1 = Sge(&v1, 4, 0), s2 = Sge(&v2, 4, 0);
    ASSERT_TRUE(PostSend1(p1->a.get(), i, IBV_WR_SEND, &s1, 1,
                          IBV_SEND_INLINE)
                    .ok());
    ASSERT_TRUE(PostSend1(p2->a.get(), i, IBV_WR_SEND, &s2, 1,
                          IBV_SEND_INLINE)
                    .ok());
  }
  std::vector<ibv_wc> ws = PollN(cq_b_.get(), 10);
  ASSERT_EQ(ws.size(), 10u);
  int from1 = 0, from2 = 0;
  for (const ibv_wc& w : ws) {
    ASSERT_EQ(w.status, IBV_WC_SUCCESS);
    uint32_t v = dst[w.wr_id];
    if (w.qp_num == p1->b->qp_num()) {
      EXPECT_EQ(w.src_qp, p1->a->qp_num());
      EXPECT_EQ(v, 100u + from1++);
    } else {
      EXPECT_EQ(w.qp_num, p2->b->qp_num());
      EXPECT_EQ(v, 200u + from2++);
    }
  }
  EXPECT_EQ(from1, 5);
  EXPECT_EQ(from2, 5);
}

TEST_F(SoftProviderTest, RnrRetryThenSuccess) {
  Connect();  // rnr_retry 7: retries forever
  uint32_t v = 0xfeedf00d, got = 0;
  auto gmr = Reg(pd_b_.get(), &got, 4);
  ibv_sge s = Sge(&v, 4, 0);
  ASSERT_TRUE(PostSend1(a(), 1, IBV_WR_SEND, &s, 1,
                        IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                  .ok());
  // A WRITE queued behind the SEND waits for it (RC order).
  alignas(8) uint64_t target = 0, nine = 9;
  auto tmr = Reg(pd_b_.get(), &target, 8);
  ibv_sge ws = Sge(&nine, 8, 0);
  ASSERT_TRUE(PostSend1(a(), 2, IBV_WR_RDMA_WRITE, &ws, 1,
                        IBV_SEND_SIGNALED | IBV_SEND_INLINE,
                        reinterpret_cast<uintptr_t>(&target), tmr->rkey())
                  .ok());
  ExpectEmpty(cq_a_.get(), std::chrono::milliseconds(30));
  EXPECT_EQ(a()->state(), IBV_QPS_RTS);
  ibv_sge r = Sge(&got, 4, gmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 5, &r, 1).ok());
  std::vector<ibv_wc> w = PollN(cq_a_.get(), 2);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(w[0].wr_id, 1u);
  EXPECT_EQ(w[1].status, IBV_WC_SUCCESS);
  EXPECT_EQ(w[1].wr_id, 2u);
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(got, v);
  EXPECT_EQ(target, 9u);
}

TEST_F(SoftProviderTest, QpOnSocketPairWithEarlyReceives) {
  auto qa = CreateQp(pd_a_.get(), Init(cq_a_.get()));
  auto qb = CreateQp(pd_b_.get(), Init(cq_b_.get()));
  ASSERT_TRUE(qa.ok() && qb.ok());
  EXPECT_EQ((*qa)->state(), IBV_QPS_INIT);
  uint32_t v = 31337, got = 0;
  ibv_sge s = Sge(&v, 4, 0);
  // Not connected: sends are refused, receives are taken.
  EXPECT_TRUE(absl::IsInvalidArgument(
      PostSend1(qa->get(), 1, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE)));
  auto gmr = Reg(pd_b_.get(), &got, 4);
  ibv_sge r = Sge(&got, 4, gmr->lkey());
  ASSERT_TRUE(PostRecv1(qb->get(), 9, &r, 1).ok());
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ASSERT_TRUE(ConnectQp(qa->get(), sv[0]).ok());
  ASSERT_TRUE(ConnectQp(qb->get(), sv[1]).ok());
  EXPECT_EQ((*qa)->state(), IBV_QPS_RTS);
  EXPECT_TRUE(absl::IsFailedPrecondition(ConnectQp(qa->get(), -1)));
  ASSERT_TRUE(PostSend1(qa->get(), 1, IBV_WR_SEND, &s, 1,
                        IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                  .ok());
  EXPECT_EQ(PollOne(cq_a_.get()).status, IBV_WC_SUCCESS);
  ibv_wc rw = PollOne(cq_b_.get());
  EXPECT_EQ(rw.status, IBV_WC_SUCCESS);
  EXPECT_EQ(rw.wr_id, 9u);
  EXPECT_EQ(rw.src_qp, (*qa)->qp_num());
  EXPECT_EQ(got, 31337u);
}

// Several application threads posting and polling their own QPs while the
// one progress thread serves them all.
TEST_F(SoftProviderTest, ThreadsPostConcurrently) {
  constexpr int kThreads = 3, kMsgs = 3000;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto cqa = *provider_->CreateCq(4096);
      auto cqb = *provider_->CreateCq(4096);
      QpInit ia = Init(cqa.get()), ib = Init(cqb.get());
      ib.max_recv_wr = kMsgs;
      auto pair =
          provider_->CreateConnectedPair(pd_a_.get(), ia, pd_b_.get(), ib);
      if (!pair.ok()) {
        ++failures;
        return;
      }
      std::vector<uint64_t> dst(kMsgs, 0);
      auto dmr = *pd_b_->RegisterMemory(dst.data(), kMsgs * 8, kAllAccess);
      for (int i = 0; i < kMsgs; ++i) {
        ibv_sge r = Sge(&dst[i], 8, dmr->lkey());
        if (!PostRecv1(pair->b.get(), i, &r, 1).ok()) ++failures;
      }
      int done = 0;
      for (int i = 0; i < kMsgs; ++i) {
        uint64_t v = (static_cast<uint64_t>(t) << 32) | i;
        ibv_sge s = Sge(&v, 8, 0);
        if (i - done >= 200) {
          done += static_cast<int>(PollN(cqa.get(), 1).size());
        }
        if (!PostSend1(pair->a.get(), i, IBV_WR_SEND, &s, 1,
                       IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                 .ok()) {
          ++failures;
        }
      }
      done += static_cast<int>(PollN(cqa.get(), kMsgs - done).size());
      if (done != kMsgs) ++failures;
      std::vector<ibv_wc> rs = PollN(cqb.get(), kMsgs);
      if (rs.size() != static_cast<size_t>(kMsgs)) ++failures;
      for (int i = 0; i < kMsgs; ++i) {
        if (dst[i] != ((static_cast<uint64_t>(t) << 32) | i)) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}


// Many connections on one progress thread, all completing on two shared CQs.
TEST_F(SoftProviderTest, ManyQpsShareCqs) {
  constexpr int kPairs = 32, kMsgs = 200, kLen = 1024;
  std::vector<QpPair> pairs;
  for (int p = 0; p < kPairs; ++p) {
    auto pair = provider_->CreateConnectedPair(
        pd_a_.get(), Init(cq_a_.get()), pd_b_.get(), Init(cq_b_.get()));
    ASSERT_TRUE(pair.ok()) << pair.status();
    pairs.push_back(*std::move(pair));
  }
  std::vector<char> src(kPairs * kMsgs * kLen), dst(src.size(), 0);
  Fill(src, 77);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  auto off = [&](int p, int m) { return (p * kMsgs + m) * kLen; };
  for (int p = 0; p < kPairs; ++p) {
    for (int m = 0; m < kMsgs; ++m) {
      ibv_sge r = Sge(&dst[off(p, m)], kLen, dmr->lkey());
      ASSERT_TRUE(PostRecv1(pairs[p].b.get(), off(p, m), &r, 1).ok());
    }
  }
  // Interleave posts across QPs; each QP's window is its SQ depth.
  for (int m = 0; m < kMsgs; m += 100) {
    for (int p = 0; p < kPairs; ++p) {
      for (int k = m; k < m + 100; ++k) {
        ibv_sge s = Sge(&src[off(p, k)], kLen, smr->lkey());
        ASSERT_TRUE(PostSend1(pairs[p].a.get(), off(p, k), IBV_WR_SEND, &s,
                              1, IBV_SEND_SIGNALED)
                        .ok());
      }
    }
    std::vector<ibv_wc> ws = PollN(cq_a_.get(), kPairs * 100);
    ASSERT_EQ(ws.size(), static_cast<size_t>(kPairs * 100));
    for (const ibv_wc& w : ws) ASSERT_EQ(w.status, IBV_WC_SUCCESS);
  }
  std::vector<ibv_wc> rs = PollN(cq_b_.get(), kPairs * kMsgs);
  ASSERT_EQ(rs.size(), static_cast<size_t>(kPairs * kMsgs));
  std::vector<int> next(kPairs, 0);
  for (const ibv_wc& w : rs) {
    ASSERT_EQ(w.status, IBV_WC_SUCCESS);
    int p = static_cast<int>(w.wr_id / (kMsgs * kLen));
    ASSERT_EQ(w.qp_num, pairs[p].b->qp_num());
    ASSERT_EQ(w.wr_id, static_cast<uint64_t>(off(p, next[p]++)));  // per QP
  }
  EXPECT_TRUE(src == dst);
}

}  // namespace
}  // namespace coverbs::transport::soft::testing
