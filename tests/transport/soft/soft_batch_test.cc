// Post batches (ProviderCq::BeginBatch / EndBatch; a reactor's loop
// iteration): SENDs posted inside one are held back and transmitted at its
// end by the posting thread (or early, after QpCore::kFirstEarlyTx posts),
// in order with what the progress thread is transmitting for the same QP,
// with the progress thread taking over what a full socket does not take.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"
#include "transport/soft/engine.h"
#include "transport/soft/qp_core.h"
#include "transport/soft/soft_provider.h"
#include "transport/soft/wire.h"

namespace coverbs::transport::soft::testing {
namespace {

using SoftBatchTest = SoftFixture;

TEST_F(SoftBatchTest, BatchHoldsPostsUntilItEnds) {
  Connect();
  uint64_t got[4] = {};
  auto gmr = Reg(pd_b_.get(), got, sizeof(got));
  // One round trip first, then a pause: the progress thread picks up
  // whatever the send ring holds whenever it serves the QP (the HELLOs
  // right after connect, the ACK of that round trip: it serves the QP once
  // more after the completion is visible), so only a quiet QP shows that
  // the batch alone held its posts back.
  {
    ibv_sge r = Sge(&got[0], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), 99, &r, 1).ok());
    uint64_t v = 1;
    ibv_sge s = Sge(&v, 8, 0);
    ASSERT_TRUE(PostSend1(a(), 99, IBV_WR_SEND, &s, 1,
                          IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                    .ok());
    ASSERT_EQ(PollOne(cq_b_.get()).status, IBV_WC_SUCCESS);
    ASSERT_EQ(PollOne(cq_a_.get()).status, IBV_WC_SUCCESS);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (int i = 0; i < 4; ++i) {
    ibv_sge r = Sge(&got[i], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  // Held until the batch has posted kFirstEarlyTx to the QP, which go out
  // at once; the next ones until twice as many more, or the batch's end.
  static_assert(QpCore::kFirstEarlyTx == 3);
  auto post = [&](uint64_t i) {
    uint64_t v = 100 + i;
    ibv_sge s = Sge(&v, 8, 0);
    ASSERT_TRUE(PostSend1(a(), i, IBV_WR_SEND, &s, 1,
                          IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                    .ok());
  };
  // The peer's side is polled from another thread, as its own reactor
  // would: polling it here, inside this thread's batch, would list its QP
  // in the batch too, and a batch listing several QPs transmits nothing
  // early.
  auto on_peer = [](auto fn) { std::thread(fn).join(); };
  std::vector<ibv_wc> rw;
  cq_a_->BeginBatch();
  post(0);
  post(1);
  // Nothing was handed to anyone yet: the peer receives nothing.
  on_peer([&] { ExpectEmpty(cq_b_.get()); });
  post(2);
  on_peer([&] { rw = PollN(cq_b_.get(), 3); });
  ASSERT_EQ(rw.size(), 3u);
  // Their ACKs come back to the progress thread (this QP's receive CQ has
  // no reactor), which serves the QP and sends whatever its ring holds by
  // then: a post made while an ACK is on the way goes out with it, as the
  // peer's late ACK did under load. So wait for the send completions those
  // ACKs make, then for the progress thread to finish the loop iteration
  // that made them (a task posted to it runs after it): from then on
  // nothing but the batch's end transmits.
  std::vector<ibv_wc> sw;
  on_peer([&] { sw = PollN(cq_a_.get(), 3); });
  ASSERT_EQ(sw.size(), 3u);
  absl::StatusOr<std::shared_ptr<Engine>> engine = Engine::Get();
  ASSERT_TRUE(engine.ok()) << engine.status();
  (*engine)->RunSync([] {});
  post(3);
  on_peer([&] { ExpectEmpty(cq_b_.get()); });
  cq_a_->EndBatch();
  std::vector<ibv_wc> last = PollN(cq_b_.get(), 1);
  ASSERT_EQ(last.size(), 1u);
  rw.push_back(last[0]);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rw[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(rw[i].wr_id, i);
    EXPECT_EQ(got[i], 100 + i);
  }
  std::vector<ibv_wc> last_sw = PollN(cq_a_.get(), 1);
  ASSERT_EQ(last_sw.size(), 1u);
  sw.push_back(last_sw[0]);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(sw[i].wr_id, i);
}

// A batch flushed while the progress thread is still sending a large WRITE
// of the same QP: the SENDs go after it (RC order), whether the flush sends
// them itself or leaves them to the progress thread.
TEST_F(SoftBatchTest, BatchAfterALargeWriteKeepsOrder) {
  Connect();
  constexpr size_t kBig = 8 << 20;
  constexpr int kSends = 32;
  std::vector<char> src(kBig), dst(kBig, 0);
  Fill(src, 7);
  auto smr = Reg(pd_a_.get(), src.data(), kBig);
  auto dmr = Reg(pd_b_.get(), dst.data(), kBig);
  uint64_t got[kSends] = {};
  auto gmr = Reg(pd_b_.get(), got, sizeof(got));
  for (int i = 0; i < kSends; ++i) {
    ibv_sge r = Sge(&got[i], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  for (int round = 0; round < 3; ++round) {
    std::memset(dst.data(), 0, kBig);
    ibv_sge ws = Sge(src.data(), kBig, smr->lkey());
    ASSERT_TRUE(PostSend1(a(), 1000, IBV_WR_RDMA_WRITE, &ws, 1,
                          IBV_SEND_SIGNALED,
                          reinterpret_cast<uintptr_t>(dst.data()),
                          dmr->rkey())
                    .ok());
    cq_a_->BeginBatch();
    for (uint64_t i = 0; i < kSends; ++i) {
      uint64_t v = round * 1000 + i;
      ibv_sge s = Sge(&v, 8, 0);
      ASSERT_TRUE(PostSend1(a(), i, IBV_WR_SEND, &s, 1,
                            IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                      .ok());
    }
    cq_a_->EndBatch();
    ibv_wc first = PollOne(cq_b_.get());
    ASSERT_EQ(first.status, IBV_WC_SUCCESS);
    // The first SEND landed after the whole WRITE before it.
    ASSERT_EQ(std::memcmp(src.data(), dst.data(), kBig), 0);
    std::vector<ibv_wc> rw = PollN(cq_b_.get(), kSends - 1);
    ASSERT_EQ(rw.size(), static_cast<size_t>(kSends - 1));
    rw.insert(rw.begin(), first);
    for (int i = 0; i < kSends; ++i) {
      ASSERT_EQ(rw[i].status, IBV_WC_SUCCESS);
      EXPECT_EQ(got[rw[i].wr_id], round * 1000 + rw[i].wr_id);
      EXPECT_EQ(rw[i].wr_id, static_cast<uint64_t>(i));
    }
    std::vector<ibv_wc> sw = PollN(cq_a_.get(), kSends + 1);
    ASSERT_EQ(sw.size(), static_cast<size_t>(kSends + 1));
    EXPECT_EQ(sw[0].wr_id, 1000u);
    for (int i = 0; i < kSends; ++i) {
      EXPECT_EQ(sw[i + 1].status, IBV_WC_SUCCESS);
      EXPECT_EQ(sw[i + 1].wr_id, static_cast<uint64_t>(i));
    }
    for (int i = 0; i < kSends; ++i) {
      ibv_sge r = Sge(&got[i], 8, gmr->lkey());
      ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
    }
  }
}

bool ReadExact(int fd, char* p, size_t n) {
  auto deadline = Clock::now() + kWait;
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, 100) < 0) return false;
    if (Clock::now() > deadline) return false;
    ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The batch's sendmsg takes only part of its frames (a small socket buffer
// and a peer that is not reading yet): the progress thread sends the rest,
// after POLLOUT, and the peer sees every frame once, in order.
TEST_F(SoftBatchTest, FullSocketLeavesTheRestToTheProgressThread) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  auto qp = CreateQpOnSocket(pd_a_.get(), Init(cq_a_.get()), sv[0]);
  ASSERT_TRUE(qp.ok()) << qp.status();
  int small = 16 * 1024;
  ASSERT_EQ(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)),
            0);
  // The HELLO: read it first, so the QP has sent it before the batch.
  char hdr[wire::kHeaderSize];
  ASSERT_TRUE(ReadExact(sv[1], hdr, sizeof(hdr)));
  EXPECT_EQ(wire::Decode(hdr).opcode, wire::kHello);

  constexpr int kSends = 24;
  constexpr size_t kLen = 32 * 1024;
  std::vector<char> src(kSends * kLen);
  Fill(src, 3);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  cq_a_->BeginBatch();
  for (int i = 0; i < kSends; ++i) {
    ibv_sge s = Sge(src.data() + i * kLen, kLen, smr->lkey());
    ASSERT_TRUE(
        PostSend1(qp->get(), i, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
  }
  cq_a_->EndBatch();
  // Let the socket fill up before the peer reads.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::vector<char> payload(kLen);
  for (int i = 0; i < kSends; ++i) {
    ASSERT_TRUE(ReadExact(sv[1], hdr, sizeof(hdr))) << "frame " << i;
    wire::Header h = wire::Decode(hdr);
    ASSERT_EQ(h.opcode, wire::kSend);
    ASSERT_EQ(h.seq, static_cast<uint64_t>(i));
    ASSERT_EQ(h.payload_len, kLen);
    ASSERT_TRUE(ReadExact(sv[1], payload.data(), kLen));
    ASSERT_EQ(std::memcmp(payload.data(), src.data() + i * kLen, kLen), 0)
        << "payload of frame " << i;
  }
  // Answer as a responder would: HELLO, then one ACK for everything.
  char out[2 * wire::kHeaderSize];
  wire::Header hello;
  hello.opcode = wire::kHello;
  hello.addr = wire::kHelloMagic;
  hello.dma_len = wire::kVersion;
  hello.qpn = 77;
  wire::Encode(hello, out);
  wire::Header ack;
  ack.opcode = wire::kAck;
  ack.seq = kSends - 1;
  wire::Encode(ack, out + wire::kHeaderSize);
  ASSERT_EQ(write(sv[1], out, sizeof(out)), static_cast<ssize_t>(sizeof(out)));
  std::vector<ibv_wc> sw = PollN(cq_a_.get(), kSends);
  ASSERT_EQ(sw.size(), static_cast<size_t>(kSends));
  for (int i = 0; i < kSends; ++i) {
    EXPECT_EQ(sw[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(sw[i].wr_id, static_cast<uint64_t>(i));
    EXPECT_EQ(sw[i].src_qp, 77u);
  }
  qp->reset();
  close(sv[1]);
}

// Several threads flushing batches into one QP while its progress thread
// receives and completes: each thread's SENDs arrive in its order.
TEST_F(SoftBatchTest, ThreadsFlushBatchesIntoOneQp) {
  constexpr int kThreads = 3, kBatches = 60, kPerBatch = 5;
  constexpr int kTotal = kThreads * kBatches * kPerBatch;
  QpInit ia = Init(cq_a_.get());
  ia.max_send_wr = kTotal;
  QpInit ib = Init(cq_b_.get());
  ib.max_recv_wr = kTotal;
  Connect(ia, ib);
  std::vector<uint64_t> got(kTotal);
  auto gmr = Reg(pd_b_.get(), got.data(), got.size() * 8);
  for (int i = 0; i < kTotal; ++i) {
    ibv_sge r = Sge(&got[i], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      uint64_t n = 0;
      for (int k = 0; k < kBatches; ++k) {
        cq_a_->BeginBatch();
        for (int j = 0; j < kPerBatch; ++j) {
          uint64_t v = (static_cast<uint64_t>(t) << 32) | n++;
          ibv_sge s = Sge(&v, 8, 0);
          if (!PostSend1(a(), v, IBV_WR_SEND, &s, 1,
                         IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                   .ok()) {
            failures.fetch_add(1);
          }
        }
        cq_a_->EndBatch();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<ibv_wc> rw = PollN(cq_b_.get(), kTotal);
  ASSERT_EQ(rw.size(), static_cast<size_t>(kTotal));
  std::vector<uint64_t> next(kThreads, 0);
  for (const ibv_wc& wc : rw) {
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
    uint64_t v = got[wc.wr_id];
    int t = static_cast<int>(v >> 32);
    ASSERT_LT(t, kThreads);
    EXPECT_EQ(v & 0xffffffffu, next[t]) << "thread " << t;
    next[t] = (v & 0xffffffffu) + 1;
  }
  std::vector<ibv_wc> sw = PollN(cq_a_.get(), kTotal);
  EXPECT_EQ(sw.size(), static_cast<size_t>(kTotal));
}

}  // namespace
}  // namespace coverbs::transport::soft::testing
