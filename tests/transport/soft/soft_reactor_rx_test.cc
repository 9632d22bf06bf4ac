// Receive on the reactor (transport/soft/README.md, "Receive on the
// reactor"): a QP whose receive CQ is driven (BeginBatch called) is received
// by whoever calls that CQ's GetEvents; these tests check that it never
// depends on that caller for liveness: a driven CQ nobody reads, an ACK a
// batch held back and nobody sent, a driven CQ destroyed under its QP.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"
#include "transport/soft/wire.h"

namespace coverbs::transport::soft::testing {
namespace {

using SoftReactorRxTest = SoftFixture;

void Drive(ProviderCq* cq) {
  cq->BeginBatch();
  cq->EndBatch();
}

bool ReadableWithin(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, ms) == 1;
}

TEST_F(SoftReactorRxTest, GetEventsReceivesWithoutAnEvent) {
  Drive(cq_b_.get());
  Connect();
  uint64_t got = 0;
  auto gmr = Reg(pd_b_.get(), &got, sizeof(got));
  ibv_sge r = Sge(&got, 8, gmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 7, &r, 1).ok());
  uint64_t v = 42;
  ibv_sge s = Sge(&v, 8, 0);
  ASSERT_TRUE(
      PostSend1(a(), 1, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE | IBV_SEND_SIGNALED)
          .ok());
  // Not armed, yet the fd wakes for the data; GetEvents receives it and
  // reports no channel event. (On a loaded host the progress thread's
  // periodic check may receive it first: then the fd stays quiet.)
  if (ReadableWithin(cq_b_->fd(), 5000)) EXPECT_EQ(cq_b_->GetEvents(), 0);
  ibv_wc wc = PollOne(cq_b_.get());
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(got, 42u);
  EXPECT_EQ(PollOne(cq_a_.get()).status, IBV_WC_SUCCESS);
}

// The CQ is driven but its "reactor" never calls GetEvents: the progress
// thread's periodic check receives, so the sender's WRs complete.
TEST_F(SoftReactorRxTest, StuckReactorLeavesItToTheProgressThread) {
  Drive(cq_b_.get());
  Connect();
  constexpr int kN = 8;
  uint64_t got[kN] = {};
  auto gmr = Reg(pd_b_.get(), got, sizeof(got));
  for (int i = 0; i < kN; ++i) {
    ibv_sge r = Sge(&got[i], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  for (uint64_t i = 0; i < kN; ++i) {
    uint64_t v = 100 + i;
    ibv_sge s = Sge(&v, 8, 0);
    ASSERT_TRUE(PostSend1(a(), i, IBV_WR_SEND, &s, 1,
                          IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                    .ok());
  }
  std::vector<ibv_wc> sw = PollN(cq_a_.get(), kN, std::chrono::seconds(5));
  ASSERT_EQ(sw.size(), static_cast<size_t>(kN));
  // Only Poll on b: its completions are there already.
  ibv_wc wc[kN];
  ASSERT_EQ(cq_b_->Poll(kN, wc), kN);
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(wc[i].wr_id, static_cast<uint64_t>(i));
    EXPECT_EQ(got[i], 100u + i);
  }
}

// A batch that received a SEND ends owing only its ACK and holds it back
// for the next batch, which never comes (and this thread does not poll
// again): the sender still gets its completion, from another thread.
TEST_F(SoftReactorRxTest, HeldAckIsSentWithoutAnotherBatch) {
  Drive(cq_b_.get());
  Connect();
  uint64_t got = 0;
  auto gmr = Reg(pd_b_.get(), &got, sizeof(got));
  ibv_sge r = Sge(&got, 8, gmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 7, &r, 1).ok());
  uint64_t v = 42;
  ibv_sge s = Sge(&v, 8, 0);
  cq_b_->BeginBatch();
  ASSERT_TRUE(
      PostSend1(a(), 1, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE | IBV_SEND_SIGNALED)
          .ok());
  // (Or the progress thread's check received it first, and sent the ACK.)
  if (ReadableWithin(cq_b_->fd(), 5000)) cq_b_->GetEvents();
  cq_b_->EndBatch();
  ibv_wc sent{};
  std::thread t([&] { sent = PollOne(cq_a_.get(), std::chrono::seconds(5)); });
  t.join();
  EXPECT_EQ(sent.status, IBV_WC_SUCCESS);
  EXPECT_EQ(sent.wr_id, 1u);
  EXPECT_EQ(PollOne(cq_b_.get()).wr_id, 7u);
}

// The driven CQ goes away while its QP lives on: the progress thread takes
// the QP's receive back, and the QP goes on ACKing its peer.
TEST_F(SoftReactorRxTest, DestroyedCqGivesItsQpsBack) {
  std::unique_ptr<ProviderCq> cq_c = *provider_->CreateCq(64);
  Drive(cq_c.get());
  QpInit bi = Init(cq_b_.get());
  bi.recv_cq = cq_c.get();
  Connect(Init(cq_a_.get()), bi);
  uint64_t got[2] = {};
  auto gmr = Reg(pd_b_.get(), got, sizeof(got));
  for (int i = 0; i < 2; ++i) {
    ibv_sge r = Sge(&got[i], 8, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  for (uint64_t i = 0; i < 2; ++i) {
    uint64_t v = 100 + i;
    ibv_sge s = Sge(&v, 8, 0);
    ASSERT_TRUE(PostSend1(a(), i, IBV_WR_SEND, &s, 1,
                          IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                    .ok());
    if (i == 0) {
      // Received through the driven CQ (PollOne calls its GetEvents; the
      // connect has reached the progress thread by then); then it goes.
      EXPECT_EQ(PollOne(cq_c.get()).wr_id, 0u);
      cq_c.reset();
    }
    ASSERT_EQ(PollOne(cq_a_.get(), std::chrono::seconds(5)).status,
              IBV_WC_SUCCESS);
    EXPECT_EQ(got[i], 100u + i);
  }
}

// Bulk payloads move the QP's receive to the progress thread and a run of
// small frames brings it back (StartBulkRx / EndBulkRx), several times,
// with every byte in place and every completion in order.
TEST_F(SoftReactorRxTest, BulkAndSmallMessagesAlternate) {
  Drive(cq_b_.get());
  Connect();
  constexpr size_t kBig = 1 << 20;
  constexpr int kSmall = 40;
  constexpr int kRounds = 3;
  std::vector<char> src(kBig), dst(kBig);
  auto smr = Reg(pd_a_.get(), src.data(), src.size());
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size());
  uint64_t small[kSmall] = {};
  auto gmr = Reg(pd_b_.get(), small, sizeof(small));
  uint64_t id = 0;
  for (int round = 0; round < kRounds; ++round) {
    Fill(src, round + 1);
    ibv_sge r = Sge(dst.data(), kBig, dmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), id, &r, 1).ok());
    for (int i = 0; i < kSmall; ++i) {
      ibv_sge rs = Sge(&small[i], 8, gmr->lkey());
      ASSERT_TRUE(PostRecv1(b(), id + 1 + i, &rs, 1).ok());
    }
    ibv_sge s = Sge(src.data(), kBig, smr->lkey());
    ASSERT_TRUE(PostSend1(a(), id, IBV_WR_SEND, &s, 1, IBV_SEND_SIGNALED).ok());
    for (int i = 0; i < kSmall; ++i) {
      uint64_t v = round * 1000 + i;
      ibv_sge ss = Sge(&v, 8, 0);
      ASSERT_TRUE(PostSend1(a(), id + 1 + i, IBV_WR_SEND, &ss, 1,
                            IBV_SEND_INLINE | IBV_SEND_SIGNALED)
                      .ok());
    }
    std::vector<ibv_wc> rw = PollN(cq_b_.get(), kSmall + 1);
    ASSERT_EQ(rw.size(), static_cast<size_t>(kSmall + 1));
    for (int i = 0; i <= kSmall; ++i) {
      EXPECT_EQ(rw[i].status, IBV_WC_SUCCESS);
      EXPECT_EQ(rw[i].wr_id, id + i);
    }
    EXPECT_EQ(rw[0].byte_len, kBig);
    EXPECT_TRUE(src == dst) << "round " << round;
    for (int i = 0; i < kSmall; ++i) {
      EXPECT_EQ(small[i], static_cast<uint64_t>(round * 1000 + i));
    }
    std::vector<ibv_wc> sw = PollN(cq_a_.get(), kSmall + 1);
    ASSERT_EQ(sw.size(), static_cast<size_t>(kSmall + 1));
    id += kSmall + 1;
  }
}

// A connected loopback TCP pair: {ours, the raw peer's}.
bool TcpPair(int fds[2]) {
  int ln = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bool ok = ln >= 0 && bind(ln, reinterpret_cast<sockaddr*>(&a), len) == 0 &&
            listen(ln, 1) == 0 &&
            getsockname(ln, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  fds[1] = ok ? socket(AF_INET, SOCK_STREAM, 0) : -1;
  ok = ok && fds[1] >= 0 &&
       connect(fds[1], reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  fds[0] = ok ? accept(ln, nullptr, nullptr) : -1;
  if (ln >= 0) close(ln);
  return ok && fds[0] >= 0;
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// A peer that dies in the middle of a WRITE's payload: the last bytes it
// sent and the end of its stream reach us together, so one read comes back
// short with the end still queued behind it, and nothing will signal the
// socket again. The QP must still see the end: it goes to the error state
// and flushes its receive. `peer_reads` false: the peer dies with our
// hello unread, so the kernel resets the connection instead of closing it.
// (A short read used to be taken as "drained" even then: the QP waited for
// a peer that was gone.)
struct DeathCase {
  size_t write_len;  // the WRITE's announced payload
  size_t sent;       // how much of it the peer sent
  bool peer_reads;
};

class PeerDiesMidPayloadTest : public SoftFixture,
                               public ::testing::WithParamInterface<DeathCase> {
};

TEST_P(PeerDiesMidPayloadTest, TheEndIsSeenAfterAShortRead) {
  const DeathCase& c = GetParam();
  Drive(cq_b_.get());
  int fds[2];
  ASSERT_TRUE(TcpPair(fds));
  std::vector<char> land(c.write_len);
  auto mr = Reg(pd_b_.get(), land.data(), land.size());
  auto qp = CreateQpOnSocket(pd_b_.get(), Init(cq_b_.get()), fds[0]);
  ASSERT_TRUE(qp.ok()) << qp.status();
  uint64_t slot = 0;
  auto gmr = Reg(pd_b_.get(), &slot, sizeof(slot));
  ibv_sge r = Sge(&slot, 8, gmr->lkey());
  ASSERT_TRUE(PostRecv1(qp->get(), 5, &r, 1).ok());
  if (c.peer_reads) {
    char hello[wire::kHeaderSize];
    ASSERT_TRUE(ReadableWithin(fds[1], 5000));
    ASSERT_EQ(read(fds[1], hello, sizeof(hello)),
              static_cast<ssize_t>(sizeof(hello)));
  }
  // Everything the peer ever sends, then its end, before our side reads.
  std::vector<char> out(2 * wire::kHeaderSize + c.sent, 'x');
  wire::Header h;
  h.opcode = wire::kHello;
  h.addr = wire::kHelloMagic;
  h.dma_len = wire::kVersion;
  h.qpn = 77;
  wire::Encode(h, out.data());
  h = wire::Header{};
  h.opcode = wire::kWrite;
  h.payload_len = static_cast<uint32_t>(c.write_len);
  h.addr = reinterpret_cast<uintptr_t>(land.data());
  h.rkey = mr->rkey();
  wire::Encode(h, out.data() + wire::kHeaderSize);
  ASSERT_TRUE(WriteAll(fds[1], out.data(), out.size()));
  close(fds[1]);
  ibv_wc wc = PollOne(cq_b_.get(), std::chrono::seconds(10));
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.wr_id, 5u);
  EXPECT_EQ((*qp)->state(), IBV_QPS_ERR);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PeerDiesMidPayloadTest,
    ::testing::Values(
        // Received on the reactor (at most kInlineBulk left).
        DeathCase{128 * 1024, 16 * 1024, true},
        DeathCase{128 * 1024, 16 * 1024, false},
        // A bulk payload: received on the progress thread.
        DeathCase{2 * 1024 * 1024, 512 * 1024, true},
        DeathCase{2 * 1024 * 1024, 512 * 1024, false}));

}  // namespace
}  // namespace coverbs::transport::soft::testing
