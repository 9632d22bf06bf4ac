// A soft QP against a hand-written peer: the test writes raw frames
// (transport/soft/wire.h) on the other end of a UNIX socketpair, as a
// hostile peer would, and reads what the QP answers. Regression tests for
// what soft_rx_fuzzer found or was built to look for.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "transport/provider.h"
#include "transport/soft/soft_provider.h"
#include "transport/soft/wire.h"

namespace coverbs::transport::soft {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWait = std::chrono::seconds(10);
constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                     IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

class PeerFramesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    provider_ = CreateSoftProvider();
    pd_ = *provider_->AllocPd();
    cq_ = *provider_->CreateCq(256);
    mr_ = *pd_->RegisterMemory(region_.data(), region_.size(), kAll);
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    QpInit init;
    init.send_cq = cq_.get();
    init.recv_cq = cq_.get();
    auto qp = CreateQpOnSocket(pd_.get(), init, sv[0]);
    ASSERT_TRUE(qp.ok()) << qp.status();
    qp_ = *std::move(qp);
    fd_ = sv[1];
    wire::Header hello;
    hello.opcode = wire::kHello;
    hello.addr = wire::kHelloMagic;
    hello.dma_len = wire::kVersion;
    hello.qpn = 0x42;
    Write(hello);
    wire::Header theirs = ReadFrame();
    ASSERT_EQ(theirs.opcode, wire::kHello);
  }
  void TearDown() override {
    qp_.reset();
    if (fd_ >= 0) close(fd_);
  }

  // `h` with payload_len set to the payload's size.
  void Write(wire::Header h, const std::string& payload = "") {
    h.payload_len = payload.size();
    char b[wire::kHeaderSize];
    wire::Encode(h, b);
    std::string all(b, sizeof(b));
    all += payload;
    ASSERT_EQ(send(fd_, all.data(), all.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(all.size()));
  }
  void ReadExactly(char* p, size_t n) {
    auto deadline = Clock::now() + kWait;
    while (n > 0 && Clock::now() < deadline) {
      pollfd pf{fd_, POLLIN, 0};
      poll(&pf, 1, 100);
      ssize_t r = recv(fd_, p, n, MSG_DONTWAIT);
      if (r == 0) break;
      if (r > 0) {
        p += r;
        n -= r;
      }
    }
    ASSERT_EQ(n, 0u) << "the QP sent less than a frame";
  }
  // The next frame the QP sends (its payload skipped).
  wire::Header ReadFrame() {
    char b[wire::kHeaderSize];
    ReadExactly(b, sizeof(b));
    wire::Header h = wire::Decode(b);
    std::vector<char> skip(h.payload_len);
    if (!skip.empty()) ReadExactly(skip.data(), skip.size());
    return h;
  }
  bool WaitForError() {
    auto deadline = Clock::now() + kWait;
    while (qp_->state() != IBV_QPS_ERR && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return qp_->state() == IBV_QPS_ERR;
  }
  std::optional<AsyncEvent> WaitForAsyncEvent() {
    pollfd p{provider_->async_fd(), POLLIN, 0};
    poll(&p, 1, 5000);
    auto ev = provider_->GetAsyncEvent();
    if (!ev.ok()) return std::nullopt;
    return *ev;
  }
  uint64_t Addr(size_t off = 0) {
    return reinterpret_cast<uintptr_t>(region_.data()) + off;
  }

  std::unique_ptr<Provider> provider_;
  std::unique_ptr<ProviderPd> pd_;
  std::unique_ptr<ProviderCq> cq_;
  std::vector<char> region_ = std::vector<char>(4096);
  std::unique_ptr<ProviderMr> mr_;
  std::unique_ptr<ProviderQp> qp_;
  int fd_ = -1;
};

// A peer that sends READ requests without reading the responses it is owed
// must not make the responder queue them without bound: past the backlog
// limit (kMaxCtrlBacklog, far beyond max_qp_rd_atom) the QP goes to error
// with a protocol error. Each response here is 4 KiB, so the socket fills
// after a few dozen and the rest would queue.
TEST_F(PeerFramesTest, ReadRequestsFromAPeerThatNeverReadsEndTheQp) {
  constexpr int kRequests = 2000;
  std::string frames;
  for (int i = 0; i < kRequests; ++i) {
    wire::Header h;
    h.opcode = wire::kReadReq;
    h.seq = i;
    h.addr = Addr();
    h.rkey = mr_->rkey();
    h.dma_len = 4096;
    char b[wire::kHeaderSize];
    wire::Encode(h, b);
    frames.append(b, sizeof(b));
  }
  ASSERT_EQ(send(fd_, frames.data(), frames.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(frames.size()));
  EXPECT_TRUE(WaitForError()) << "the QP kept queueing READ responses";
  std::optional<AsyncEvent> ev = WaitForAsyncEvent();
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->type, IBV_EVENT_QP_FATAL);
  EXPECT_NE(ev->description.find("responses are still owed"), std::string::npos)
      << ev->description;
}

// Every one-sided request with a key or range the QP must refuse is NAKed
// with REM_ACCESS_ERR and ends the QP (one connection per case).
struct BadRemote {
  const char* name;
  uint8_t opcode;
  uint32_t (*rkey)(const ProviderMr&);
  uint64_t offset;  // from the region's base; ~0 = a wrapping address
  uint32_t len;
};

uint32_t KeyZero(const ProviderMr&) { return 0; }
uint32_t KeyRandom(const ProviderMr& mr) { return mr.rkey() ^ 0x5a5a1234; }
uint32_t KeyGood(const ProviderMr& mr) { return mr.rkey(); }

class BadRemoteTest : public PeerFramesTest,
                      public ::testing::WithParamInterface<BadRemote> {};

TEST_P(BadRemoteTest, IsNakedWithRemoteAccessError) {
  const BadRemote& c = GetParam();
  wire::Header h;
  h.opcode = c.opcode;
  h.seq = 0;
  h.rkey = c.rkey(*mr_);
  h.addr = c.offset == ~0ULL ? ~0ULL - 7 : Addr(c.offset);
  std::string payload;
  if (c.opcode == wire::kReadReq) {
    h.dma_len = c.len;
  } else if (c.opcode == wire::kCmpSwap || c.opcode == wire::kFetchAdd) {
    payload.assign(wire::kAtomicReqSize, '\0');
  } else {
    payload.assign(c.len, 'x');
  }
  Write(h, payload);
  wire::Header nak = ReadFrame();
  EXPECT_EQ(nak.opcode, wire::kNak);
  EXPECT_EQ(nak.seq, 0u);
  EXPECT_EQ(nak.syndrome, IBV_WC_REM_ACCESS_ERR);
  EXPECT_TRUE(WaitForError());
  EXPECT_EQ(region_, std::vector<char>(4096)) << "the region was written";
}

INSTANTIATE_TEST_SUITE_P(
    Keys, BadRemoteTest,
    ::testing::Values(
        BadRemote{"WriteKeyZero", wire::kWrite, KeyZero, 0, 16},
        BadRemote{"WriteImmKeyZero", wire::kWriteImm, KeyZero, 0, 16},
        BadRemote{"ReadKeyZero", wire::kReadReq, KeyZero, 0, 16},
        BadRemote{"CmpSwapKeyZero", wire::kCmpSwap, KeyZero, 0, 8},
        BadRemote{"FetchAddKeyZero", wire::kFetchAdd, KeyZero, 0, 8},
        BadRemote{"WriteRandomKey", wire::kWrite, KeyRandom, 0, 16},
        BadRemote{"ReadRandomKey", wire::kReadReq, KeyRandom, 0, 16},
        BadRemote{"FetchAddRandomKey", wire::kFetchAdd, KeyRandom, 0, 8},
        BadRemote{"WritePastTheEnd", wire::kWrite, KeyGood, 4090, 16},
        BadRemote{"ReadPastTheEnd", wire::kReadReq, KeyGood, 4000, 200},
        BadRemote{"ReadLengthWraps", wire::kReadReq, KeyGood, 8, 0xffffffff},
        BadRemote{"WriteAddressWraps", wire::kWrite, KeyGood, ~0ULL, 32},
        BadRemote{"ReadAddressWraps", wire::kReadReq, KeyGood, ~0ULL, 32},
        BadRemote{"AtomicUnaligned", wire::kFetchAdd, KeyGood, 4, 8},
        BadRemote{"AtomicPastTheEnd", wire::kCmpSwap, KeyGood, 4096, 8}),
    [](const ::testing::TestParamInfo<BadRemote>& i) { return i.param.name; });

}  // namespace
}  // namespace coverbs::transport::soft
