// The verbs provider's error paths against a real RDMA device (the
// VerbsPairTest fixture, verbs_pair_fixture.h): remote access errors,
// flushes, queue overflow, SRQ, refused objects, teardown in any order,
// and the locked-memory limit. Skips where no RDMA device exists; runs
// for real in the VM harness (tests/vm), as verbs_provider_test.cc.
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/transport/verbs/verbs_pair_fixture.h"
#include "transport/provider.h"
#include "transport/verbs/verbs_provider.h"

extern char** environ;

namespace coverbs::transport {
namespace {

// A WRITE to a region without REMOTE_WRITE breaks the connection. On
// InfiniBand/RoCE the WRITE itself completes with an error; on iWARP its
// completion only means the data left (it may say success) and the QP fails
// when the peer's TERMINATE arrives. Either way b's QP ends in error and
// everything outstanding on it is flushed, including a receive posted before.
TEST_F(VerbsPairTest, RemoteAccessErrorPutsTheQpInError) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get(), IBV_ACCESS_LOCAL_WRITE));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  // b sends first (iWARP), so that a's side of the connection is live.
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 60));
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 0, 4, 61).ok());
  ExpectOne(cq_b_.get(), 61);
  ExpectOne(cq_a_.get(), 60);

  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.b.get(), bb, 1024, 64, 64));
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_RDMA_WRITE, bb, 0, 64, 62,
                       ba.Addr(0), ba.mr->rkey())
                  .ok());
  std::vector<ibv_wc> wc = PollN(cq_b_.get(), 2);
  ASSERT_EQ(wc.size(), 2u) << "b's QP did not fail";
  const ibv_wc* write = nullptr;
  const ibv_wc* recv = nullptr;
  for (const ibv_wc& w : wc) {
    std::printf("after a write to a region without REMOTE_WRITE: %s\n",
                WcString(w).c_str());
    (w.wr_id == 62 ? write : recv) = &w;
  }
  ASSERT_NE(write, nullptr);
  ASSERT_NE(recv, nullptr);
  EXPECT_EQ(recv->wr_id, 64u);
  EXPECT_EQ(recv->status, IBV_WC_WR_FLUSH_ERR) << WcString(*recv);
  if (pa_->caps().transport != TransportKind::kIWarp) {
    EXPECT_EQ(write->status, IBV_WC_REM_ACCESS_ERR) << WcString(*write);
  }
  // The requester's QP is in error now: what is posted next is flushed.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (pair_.b->state() != IBV_QPS_ERR && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(pair_.b->state(), IBV_QPS_ERR);
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 0, 4, 63).ok());
  wc = PollN(cq_b_.get(), 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR) << WcString(wc[0]);
  EXPECT_EQ(wc[0].wr_id, 63u);
  // Whatever the devices reported asynchronously is decoded (or nothing).
  for (Provider* p : {pa_.get(), pb_}) {
    for (;;) {
      absl::StatusOr<AsyncEvent> ev = p->GetAsyncEvent();
      if (!ev.ok()) {
        EXPECT_EQ(ev.status().code(), absl::StatusCode::kNotFound)
            << ev.status();
        break;
      }
      std::printf("async event: %s\n", ev->description.c_str());
      EXPECT_FALSE(ev->description.empty());
    }
  }
}

TEST_F(VerbsPairTest, SetErrorFlushesEverythingInOrder) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  for (uint64_t id = 1; id <= 3; ++id) {
    ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 64 * id, 64, id));
  }
  ASSERT_TRUE(pair_.a->SetError().ok());
  EXPECT_EQ(pair_.a->state(), IBV_QPS_ERR);
  std::vector<ibv_wc> wc = PollN(cq_a_.get(), 3);
  ASSERT_EQ(wc.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR) << WcString(wc[i]);
    EXPECT_EQ(wc[i].wr_id, i + 1);
  }
  // A send posted to a QP in error is flushed too.
  ASSERT_TRUE(PostSend(pair_.a.get(), IBV_WR_SEND, ba, 0, 8, 9).ok());
  wc = PollN(cq_a_.get(), 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR) << WcString(wc[0]);
  EXPECT_EQ(wc[0].wr_id, 9u);
  // A receive posted to a QP in error is flushed as well (hardware does it;
  // for rxe the provider re-issues the transition to ERR, for siw it
  // completes the WR itself).
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 10));
  wc = PollN(cq_a_.get(), 1);
  ASSERT_EQ(wc.size(), 1u) << "a receive posted in error was not flushed";
  EXPECT_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR) << WcString(wc[0]);
  EXPECT_EQ(wc[0].wr_id, 10u);
}

// Posting more WRs than the queue holds fails with ENOMEM: ResourceExhausted
// naming the QP. The reported max_*_wr is a lower bound: drivers may round the
// ring up (rxe does), so the failure can come later than max_*_wr + 1.
TEST_F(VerbsPairTest, OverflowingAQueueIsResourceExhausted) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  const uint32_t n = 4 * pair_.a->max_recv_wr() + 4;
  std::vector<ibv_recv_wr> wrs(n);
  ibv_sge sge = ba.Sge(0, 64);
  for (uint32_t i = 0; i < n; ++i) {
    wrs[i].wr_id = 1000 + i;
    wrs[i].sg_list = &sge;
    wrs[i].num_sge = 1;
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  absl::Status s = pair_.a->PostRecv(wrs.data(), &bad);
  ASSERT_FALSE(s.ok()) << n << " receives fit a queue of "
                       << pair_.a->max_recv_wr();
  std::printf("receive queue overflow: %s\n", s.ToString().c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_NE(bad, nullptr);
  EXPECT_GE(bad - wrs.data(), pair_.a->max_recv_wr());
  EXPECT_NE(s.message().find(absl::StrFormat("QP 0x%x", pair_.a->qp_num())),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("RECV"), std::string::npos) << s;

  // The same on the send queue, with unsignaled zero-length writes posted as
  // one list (the device sees them only at the end of the list).
  const uint32_t m = 4 * pair_.b->max_send_wr() + 4;
  std::vector<ibv_send_wr> swrs(m);
  for (uint32_t i = 0; i < m; ++i) {
    swrs[i].wr_id = 2000 + i;
    swrs[i].opcode = IBV_WR_RDMA_WRITE;
    swrs[i].num_sge = 0;
    swrs[i].wr.rdma.remote_addr = ba.Addr(0);
    swrs[i].wr.rdma.rkey = ba.mr->rkey();
    swrs[i].next = i + 1 < m ? &swrs[i + 1] : nullptr;
  }
  ibv_send_wr* sbad = nullptr;
  s = pair_.b->PostSend(swrs.data(), &sbad);
  if (s.ok() && pa_->caps().transport == TransportKind::kIWarp) {
    // siw's kernel thread consumes the send ring while it is being filled.
    std::printf(
        "send queue: %u WRs posted without overflow (the device "
        "drained the queue meanwhile)\n",
        m);
    return;
  }
  ASSERT_FALSE(s.ok()) << m << " sends fit a queue of "
                       << pair_.b->max_send_wr();
  std::printf("send queue overflow: %s\n", s.ToString().c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_NE(sbad, nullptr);
  EXPECT_GE(sbad - swrs.data(), pair_.b->max_send_wr());
  EXPECT_NE(s.message().find("RDMA_WRITE"), std::string::npos) << s;
  EXPECT_TRUE(QuietFor(cq_b_.get(), 200));  // unsignaled successes: silent
}

TEST_F(VerbsPairTest, SharedReceiveQueue) {
  auto srq = pd_a_->CreateSrq(16, 1);
  ASSERT_TRUE(srq.ok()) << srq.status();
  QpInit ia = InitA();
  ia.srq = srq->get();
  ASSERT_NO_FATAL_FAILURE(Connect(ia, InitB()));
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  for (uint64_t id = 1; id <= 2; ++id) {
    ibv_sge sge = ba.Sge(128 * id, 128);
    ibv_recv_wr wr{};
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_TRUE((*srq)->PostRecv(&wr, &bad).ok());
  }
  for (uint64_t id = 1; id <= 2; ++id) {
    ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 0, 32, 100 + id).ok());
    ExpectOne(cq_b_.get(), 100 + id);
  }
  std::vector<ibv_wc> wc = PollN(cq_a_.get(), 2);
  ASSERT_EQ(wc.size(), 2u);
  for (const ibv_wc& w : wc) {
    EXPECT_EQ(w.status, IBV_WC_SUCCESS) << WcString(w);
    EXPECT_EQ(w.qp_num, pair_.a->qp_num());
  }
  // Destroy the QP before the SRQ (the QP keeps it alive anyway).
  pair_ = QpPair{};
}

TEST_F(VerbsPairTest, RequestingTooMuchInlineFailsClearly) {
  const uint32_t max_inline = pa_->caps().max_inline_data;
  if (max_inline >= 4096) GTEST_SKIP() << "inline limit not found by the probe";
  QpInit ib = InitB();
  ib.max_inline_data = max_inline + 1;
  auto pair = pa_->CreateConnectedPair(pd_a_.get(), InitA(), pd_b_.get(), ib);
  ASSERT_FALSE(pair.ok());
  std::printf("too much inline: %s\n", pair.status().ToString().c_str());
  EXPECT_NE(pair.status().message().find("rdma_create_qp"), std::string::npos);
  EXPECT_NE(pair.status().message().find("max_inline_data"), std::string::npos);
  // And the provider still connects afterwards.
  ASSERT_NO_FATAL_FAILURE(Connect());
}

TEST_F(VerbsPairTest, ForeignObjectsAreRejected) {
  QpInit ia = InitA();
  ia.send_cq = nullptr;
  auto pair = pa_->CreateConnectedPair(pd_a_.get(), ia, pd_b_.get(), InitB());
  ASSERT_FALSE(pair.ok());
  EXPECT_EQ(pair.status().code(), absl::StatusCode::kInvalidArgument)
      << pair.status();
  EXPECT_EQ(pa_->CreateConnectedPair(nullptr, InitA(), pd_b_.get(), InitB())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(VerbsPairTest, DestroyInAnyOrderAndWithUnackedEvents) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 1));
  ASSERT_TRUE(cq_a_->RequestNotify().ok());
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 0, 8, 2).ok());
  ExpectOne(cq_b_.get(), 2);
  pollfd pfd{cq_a_->fd(), POLLIN, 0};
  ASSERT_EQ(poll(&pfd, 1, 15000), 1);
  EXPECT_GE(cq_a_->GetEvents(), 1);  // consumed, deliberately not acked
  ExpectOne(cq_a_.get(), 1);
  ba.mr.reset();
  bb.mr.reset();

  // Worst order: the connection state first (QpPair's own member order),
  // then the CQs and PDs while the QPs live, the QPs last. Must neither hang
  // (ibv_destroy_cq waits for unacked events) nor fail with EBUSY.
  testing::internal::CaptureStderr();
  pair_.keepalive.reset();
  cq_a_.reset();
  cq_b_.reset();
  pd_a_.reset();
  pd_b_.reset();
  pair_.a.reset();
  pair_.b.reset();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("coverbs/verbs"), std::string::npos) << err;
}

TEST_F(VerbsPairTest, ManyPairsInSequence) {
  for (int i = 0; i < 5; ++i) {
    ASSERT_NO_FATAL_FAILURE(Connect());
    pair_ = QpPair{};
  }
}

// ------------------------------------------------------------ memlock
// The locked-memory limit: registering more than RLIMIT_MEMLOCK must fail
// with ResourceExhausted naming the limit. Runs in a child process (it lowers
// the limit and drops CAP_IPC_LOCK, which lifts it for root).

constexpr char kMemlockChildEnv[] = "COVERBS_VERBS_TEST_MEMLOCK_CHILD";

bool DropIpcLock() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  data[0].effective &= ~(1u << CAP_IPC_LOCK);
  return syscall(SYS_capset, &hdr, data) == 0;
}

TEST(VerbsMemlockChild, RegistrationBeyondTheLimit) {
  if (Env(kMemlockChildEnv) == nullptr) {
    GTEST_SKIP() << "runs only as the child of VerbsPairTest.MemlockLimit";
  }
  ASSERT_TRUE(DropIpcLock()) << std::strerror(errno);
  rlimit rl{64 * 1024, 64 * 1024};
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &rl), 0) << std::strerror(errno);
  auto p = OpenVerbsProvider(ProviderOptions{});
  ASSERT_TRUE(p.ok()) << p.status();
  auto pd = (*p)->AllocPd();
  ASSERT_TRUE(pd.ok()) << pd.status();
  std::vector<char> big(4 << 20, 1);
  auto mr =
      (*pd)->RegisterMemory(big.data(), big.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_FALSE(mr.ok()) << "4 MiB registered under a 64 KiB memlock limit";
  std::printf("memlock: %s\n", mr.status().ToString().c_str());
  EXPECT_EQ(mr.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(mr.status().message());
  EXPECT_NE(msg.find("RLIMIT_MEMLOCK"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ulimit -l` = 64"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(big.size())), std::string::npos) << msg;
}

TEST_F(VerbsPairTest, MemlockLimitIsNamed) {
  std::string exe(4096, '\0');
  ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  ASSERT_GT(n, 0);
  exe.resize(n);
  std::string filter = "--gtest_filter=VerbsMemlockChild.*";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  setenv(kMemlockChildEnv, "1", 1);
  // The child must not write the parent's test XML.
  std::string saved_output = Env("GTEST_OUTPUT") ? Env("GTEST_OUTPUT") : "";
  std::string saved_xml = Env("XML_OUTPUT_FILE") ? Env("XML_OUTPUT_FILE") : "";
  unsetenv("GTEST_OUTPUT");
  unsetenv("XML_OUTPUT_FILE");
  pid_t pid = 0;
  int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, environ);
  unsetenv(kMemlockChildEnv);
  if (!saved_output.empty()) setenv("GTEST_OUTPUT", saved_output.c_str(), 1);
  if (!saved_xml.empty()) setenv("XML_OUTPUT_FILE", saved_xml.c_str(), 1);
  ASSERT_EQ(rc, 0) << std::strerror(rc);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died: status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the memlock child test failed (above)";
}

}  // namespace
}  // namespace coverbs::transport
