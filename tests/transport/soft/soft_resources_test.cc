// Completion channels, CQ overrun, memory registration rules, object
// validation and the progress engine's life cycle.
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/transport/soft/soft_test_util.h"
#include "transport/soft/soft_provider.h"

namespace coverbs::transport::soft::testing {
namespace {

using SoftResourcesTest = SoftFixture;

bool Readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 1;
}

bool ReadableWithin(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, ms) == 1;
}

// Sends one inline message a -> b and waits for a's completion.
void SendOne(ProviderQp* qp, ProviderCq* cq, uint64_t id) {
  uint32_t v = static_cast<uint32_t>(id);
  ibv_sge s = Sge(&v, 4, 0);
  ASSERT_TRUE(
      PostSend1(qp, id, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE | IBV_SEND_SIGNALED)
          .ok());
}

// Polls without touching the completion channel (PollN arms the CQ).
std::vector<ibv_wc> RawPoll(ProviderCq* cq, int n) {
  std::vector<ibv_wc> out;
  auto deadline = Clock::now() + kWait;
  ibv_wc w;
  while (static_cast<int>(out.size()) < n && Clock::now() < deadline) {
    if (cq->Poll(1, &w) == 1) {
      out.push_back(w);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return out;
}

TEST_F(SoftResourcesTest, CompletionChannelArming) {
  Connect();
  std::vector<uint32_t> dst(8);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size() * 4);
  for (int i = 0; i < 8; ++i) {
    ibv_sge r = Sge(&dst[i], 4, dmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), 100 + i, &r, 1).ok());
  }
  int fd = cq_a_->fd();
  EXPECT_FALSE(Readable(fd));
  EXPECT_EQ(cq_a_->GetEvents(), 0);  // non-blocking, nothing pending

  // A completion on an unarmed CQ does not make the channel readable.
  SendOne(a(), cq_a_.get(), 1);
  std::vector<ibv_wc> w = RawPoll(cq_a_.get(), 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].wr_id, 1u);
  EXPECT_FALSE(ReadableWithin(fd, 20));
  ASSERT_EQ(RawPoll(cq_b_.get(), 1).size(), 1u);

  // Arming does not fire for completions already in the CQ: the receive
  // completion is known to be there once its event fired.
  int bfd = cq_b_->fd();
  ASSERT_TRUE(cq_b_->RequestNotify().ok());
  SendOne(a(), cq_a_.get(), 2);
  ASSERT_TRUE(ReadableWithin(bfd, 5000));
  EXPECT_EQ(cq_b_->GetEvents(), 1);
  cq_b_->AckEvents(1);
  ASSERT_TRUE(cq_b_->RequestNotify().ok());
  EXPECT_FALSE(ReadableWithin(bfd, 30));
  w = RawPoll(cq_b_.get(), 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].wr_id, 101u);
  w = RawPoll(cq_a_.get(), 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].wr_id, 2u);
  EXPECT_FALSE(Readable(fd));

  // Armed + a new completion: readable, one event.
  ASSERT_TRUE(cq_a_->RequestNotify().ok());
  SendOne(a(), cq_a_.get(), 3);
  EXPECT_TRUE(ReadableWithin(fd, 5000));
  EXPECT_EQ(cq_a_->GetEvents(), 1);
  EXPECT_FALSE(Readable(fd));
  EXPECT_EQ(UnackedCqEvents(cq_a_.get()), 1);
  cq_a_->AckEvents(1);
  EXPECT_EQ(UnackedCqEvents(cq_a_.get()), 0);
  w = RawPoll(cq_a_.get(), 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].wr_id, 3u);

  // One-shot: the next completion without re-arming stays silent.
  SendOne(a(), cq_a_.get(), 4);
  w = RawPoll(cq_a_.get(), 1);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].wr_id, 4u);
  EXPECT_FALSE(ReadableWithin(fd, 20));

  // Several completions after one arm: a single event.
  ASSERT_TRUE(cq_a_->RequestNotify().ok());
  SendOne(a(), cq_a_.get(), 5);
  SendOne(a(), cq_a_.get(), 6);
  EXPECT_TRUE(ReadableWithin(fd, 5000));
  EXPECT_EQ(RawPoll(cq_a_.get(), 2).size(), 2u);
  EXPECT_EQ(cq_a_->GetEvents(), 1);
  cq_a_->AckEvents(1);
  EXPECT_FALSE(Readable(fd));
}

TEST_F(SoftResourcesTest, CqOverrunIsReported) {
  auto small = *provider_->CreateCq(4);
  EXPECT_GE(small->capacity(), 4);
  QpInit ia = Init(small.get());
  Connect(ia, Init(cq_b_.get()));
  std::vector<uint32_t> dst(16);
  auto dmr = Reg(pd_b_.get(), dst.data(), dst.size() * 4);
  for (int i = 0; i < 16; ++i) {
    ibv_sge r = Sge(&dst[i], 4, dmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), i, &r, 1).ok());
  }
  for (int i = 0; i < 10; ++i) SendOne(a(), small.get(), i);
  pollfd p{provider_->async_fd(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1);
  bool saw_cq_err = false;
  for (;;) {
    auto ev = provider_->GetAsyncEvent();
    if (!ev.ok()) break;
    if (ev->type == IBV_EVENT_CQ_ERR) saw_cq_err = true;
  }
  EXPECT_TRUE(saw_cq_err);
  // The stored completions are still there, then the CQ reports its error.
  ibv_wc wc[16];
  int got = small->Poll(16, wc);
  EXPECT_EQ(got, 4);
  EXPECT_EQ(small->Poll(16, wc), -EOVERFLOW);
  // The QP whose completion was lost is in error.
  EXPECT_TRUE(WaitState(a(), IBV_QPS_ERR));
  pair_ = QpPair();
}

TEST_F(SoftResourcesTest, MemoryRegistrationRules) {
  std::vector<char> buf(4096);
  auto bad1 = pd_a_->RegisterMemory(buf.data(), 4096, IBV_ACCESS_REMOTE_WRITE);
  EXPECT_TRUE(absl::IsInvalidArgument(bad1.status())) << bad1.status();
  auto bad2 =
      pd_a_->RegisterMemory(buf.data(), 4096, IBV_ACCESS_REMOTE_ATOMIC);
  EXPECT_TRUE(absl::IsInvalidArgument(bad2.status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      pd_a_->RegisterMemory(nullptr, 10, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      pd_a_->RegisterMemory(buf.data(), 0, 0).status()));
  auto ro = pd_a_->RegisterMemory(buf.data(), 4096, IBV_ACCESS_REMOTE_READ);
  ASSERT_TRUE(ro.ok());
  EXPECT_EQ((*ro)->access(), IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ((*ro)->addr(), buf.data());
  EXPECT_EQ((*ro)->length(), 4096u);

  // Keys are unique, lkey != rkey, and stale keys are not handed out again.
  std::set<uint32_t> keys;
  std::vector<std::unique_ptr<ProviderMr>> mrs;
  for (int i = 0; i < 500; ++i) {
    auto mr = pd_a_->RegisterMemory(buf.data() + i, 8, kAllAccess);
    ASSERT_TRUE(mr.ok());
    EXPECT_TRUE(keys.insert((*mr)->lkey()).second);
    EXPECT_TRUE(keys.insert((*mr)->rkey()).second);
    mrs.push_back(*std::move(mr));
  }
  mrs.clear();
  for (int i = 0; i < 500; ++i) {
    auto mr = pd_a_->RegisterMemory(buf.data(), 8, kAllAccess);
    ASSERT_TRUE(mr.ok());
    EXPECT_TRUE(keys.insert((*mr)->lkey()).second);
    EXPECT_TRUE(keys.insert((*mr)->rkey()).second);
  }
}

TEST_F(SoftResourcesTest, ObjectValidation) {
  EXPECT_TRUE(absl::IsInvalidArgument(provider_->CreateCq(0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(provider_->CreateCq(65537).status()));
  auto cq = provider_->CreateCq(100);
  ASSERT_TRUE(cq.ok());
  EXPECT_GE((*cq)->capacity(), 100);
  EXPECT_TRUE(absl::IsInvalidArgument(pd_a_->CreateSrq(0, 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(pd_a_->CreateSrq(10, 17).status()));

  QpInit init = Init(cq_a_.get());
  init.max_send_sge = 17;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateQp(pd_a_.get(), init).status()));
  init = Init(cq_a_.get());
  init.max_inline_data = 257;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateQp(pd_a_.get(), init).status()));
  init = Init(cq_a_.get());
  init.max_send_wr = 16385;
  EXPECT_TRUE(absl::IsInvalidArgument(CreateQp(pd_a_.get(), init).status()));
  init = Init(nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(CreateQp(pd_a_.get(), init).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateQp(nullptr, Init(cq_a_.get())).status()));
  // A socket that is not a stream: refused, fd taken.
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_DGRAM, 0, fds), 0);
  auto qp = CreateQpOnSocket(pd_a_.get(), Init(cq_a_.get()), fds[0]);
  EXPECT_TRUE(absl::IsInvalidArgument(qp.status())) << qp.status();
  close(fds[1]);
}

TEST_F(SoftResourcesTest, EngineStopsAndRestarts) {
  for (int i = 0; i < 3; ++i) {
    Connect();
    uint32_t got = 0;
    auto gmr = Reg(pd_b_.get(), &got, 4);
    ibv_sge r = Sge(&got, 4, gmr->lkey());
    ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
    SendOne(a(), cq_a_.get(), 40 + i);
    EXPECT_EQ(PollOne(cq_a_.get()).status, IBV_WC_SUCCESS);
    EXPECT_EQ(PollOne(cq_b_.get()).status, IBV_WC_SUCCESS);
    EXPECT_EQ(got, 40u + i);
    pair_ = QpPair();  // last QP gone: the progress thread is joined
  }
}

// Threads of this process named coverbs-soft (the progress thread).
int ProgressThreads() {
  int n = 0;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(t.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name == "coverbs-soft") ++n;
  }
  return n;
}

// The progress thread's io_uring and eventfd are made ahead of it, by the
// provider and again by each engine that ends: a process that has run out
// of descriptors (EMFILE) still gets QPs on the sockets it holds, also
// after an earlier progress thread ended. (They used to be made by the
// first QP, which then failed with "io_uring_queue_init for the progress
// thread: Too many open files".)
TEST(SoftEngineTest, QpsAfterDescriptorsRanOut) {
  auto provider = CreateSoftProvider();
  auto pd = provider->AllocPd();
  ASSERT_TRUE(pd.ok()) << pd.status();
  auto cq = provider->CreateCq(64);
  ASSERT_TRUE(cq.ok()) << cq.status();
  uint32_t got = 0;
  auto mr = (*pd)->RegisterMemory(&got, 4, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_TRUE(mr.ok()) << mr.status();
  QpInit init;
  init.send_cq = init.recv_cq = cq->get();
  init.max_send_wr = 16;
  init.max_recv_wr = 16;
  init.max_send_sge = 1;
  init.max_recv_sge = 1;
  init.max_inline_data = 16;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    // No progress thread: none yet, then the first one ended with its QPs.
    for (int w = 0; w < 500 && ProgressThreads() > 0; ++w) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(ProgressThreads(), 0);
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    // Every descriptor taken.
    std::vector<int> taken;
    for (;;) {
      int fd = dup(sv[0]);
      if (fd < 0) {
        ASSERT_EQ(errno, EMFILE) << std::strerror(errno);
        break;
      }
      taken.push_back(fd);
      ASSERT_LT(taken.size(), 1u << 20) << "no descriptor limit";
    }
    auto a = CreateQpOnSocket(pd->get(), init, sv[0]);
    auto b = CreateQpOnSocket(pd->get(), init, sv[1]);
    for (int fd : taken) close(fd);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    // And they work: a SEND from a to b.
    got = 0;
    ibv_sge r = Sge(&got, 4, (*mr)->lkey());
    ASSERT_TRUE(PostRecv1(b->get(), 1, &r, 1).ok());
    uint32_t v = 77 + round;
    ibv_sge s = Sge(&v, 4, 0);
    ASSERT_TRUE(PostSend1(a->get(), 2, IBV_WR_SEND, &s, 1,
                          IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                    .ok());
    EXPECT_EQ(PollOne(cq->get()).status, IBV_WC_SUCCESS);
    EXPECT_EQ(PollOne(cq->get()).status, IBV_WC_SUCCESS);
    EXPECT_EQ(got, 77u + round);
    EXPECT_EQ(ProgressThreads(), 1);
    a->reset();  // the last QPs: the progress thread ends
    b->reset();
  }
}

TEST_F(SoftResourcesTest, RnrTimerScaling) {
  EXPECT_EQ(RnrTimerDelay(12), std::chrono::microseconds(64));
  EXPECT_EQ(RnrTimerDelay(1), std::chrono::microseconds(1));
  EXPECT_EQ(RnrTimerDelay(31), std::chrono::microseconds(49152));
  EXPECT_EQ(RnrTimerDelay(0), std::chrono::microseconds(65536));
}

TEST_F(SoftResourcesTest, UnackedEventsAreTracked) {
  Connect();
  std::vector<uint32_t> dst(2);
  auto dmr = Reg(pd_b_.get(), dst.data(), 8);
  ibv_sge r = Sge(dst.data(), 4, dmr->lkey());
  ASSERT_TRUE(PostRecv1(b(), 1, &r, 1).ok());
  ASSERT_TRUE(cq_b_->RequestNotify().ok());
  SendOne(a(), cq_a_.get(), 1);
  ASSERT_TRUE(ReadableWithin(cq_b_->fd(), 5000));
  EXPECT_EQ(cq_b_->GetEvents(), 1);
  EXPECT_EQ(UnackedCqEvents(cq_b_.get()), 1);
  // Destroying a CQ with unacknowledged events is allowed for soft.
  pair_ = QpPair();
  cq_b_.reset();
}


// Deregistration is synchronous even while data is landing: the region is
// unmapped right after its MR is gone, so any later access by the provider
// would crash the test (or fail the transfer with EFAULT).
TEST_F(SoftResourcesTest, DeregisterWhileWriteLands) {
  constexpr size_t kSize = 32 << 20;
  std::vector<char> src(kSize, 'w');
  auto smr = Reg(pd_a_.get(), src.data(), kSize);
  for (int round = 0; round < 6; ++round) {
    Connect();
    void* p = mmap(nullptr, kSize, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    auto dmr = Reg(pd_b_.get(), p, kSize);
    ibv_sge s = Sge(src.data(), kSize, smr->lkey());
    ASSERT_TRUE(PostSend1(a(), 1, IBV_WR_RDMA_WRITE, &s, 1,
                          IBV_SEND_SIGNALED,
                          reinterpret_cast<uintptr_t>(p), dmr->rkey())
                    .ok());
    std::this_thread::sleep_for(std::chrono::microseconds(round * 700));
    dmr.reset();
    ASSERT_EQ(munmap(p, kSize), 0);
    ibv_wc w = PollOne(cq_a_.get());
    EXPECT_TRUE(w.status == IBV_WC_SUCCESS ||
                w.status == IBV_WC_REM_ACCESS_ERR)
        << ibv_wc_status_str(w.status);
    pair_ = QpPair();
  }
}

double CpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// An idle progress thread sleeps (idle CPU ~0), also with QPs connected and
// receives posted.
TEST_F(SoftResourcesTest, IdleProgressThreadSleeps) {
  Connect();
  std::vector<char> buf(64);
  auto mr = Reg(pd_a_.get(), buf.data(), 64);
  ibv_sge r = Sge(buf.data(), 64, mr->lkey());
  ASSERT_TRUE(PostRecv1(a(), 1, &r, 1).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  double before = CpuSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(CpuSeconds() - before, 0.05);
}


// Objects still alive at exit(): the progress thread is stopped and joined by
// an atexit handler and the process ends normally.
TEST(SoftExitTest, LeakedObjectsDoNotHangExit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto provider = CreateSoftProvider();
        auto pd = *provider->AllocPd();
        auto cq = *provider->CreateCq(64);
        QpInit init;
        init.send_cq = init.recv_cq = cq.get();
        init.max_inline_data = 16;
        auto pair =
            *provider->CreateConnectedPair(pd.get(), init, pd.get(), init);
        uint32_t v = 1;
        ibv_sge s = Sge(&v, 4, 0);
        // Stuck in RNR (no receive posted) while the process exits.
        if (!PostSend1(pair.a.get(), 1, IBV_WR_SEND, &s, 1, IBV_SEND_INLINE)
                 .ok()) {
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace coverbs::transport::soft::testing
