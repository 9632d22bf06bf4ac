// The verbs provider against a real RDMA device: a connected pair through
// rdma_cm, SEND/RECV, RDMA WRITE/READ, immediate data, atomics, SRQ, the
// completion channel and the error statuses.
//
// Skips (GTEST_SKIP, with the reason) when no RDMA device exists, as on hosts
// without an RDMA stack. It runs for real in the VM harness (tests/vm) with
// Soft-RoCE (rxe) or SoftiWARP (siw):
//   VM_RDMA=rxe VM_NETDEV=dummy tests/vm/run-in-vm.sh <this binary>
// Environment:
//   COVERBS_DEVICE, COVERBS_GID_INDEX, COVERBS_TEST_ADDR,
//   COVERBS_TEST_PEER_ADDR    as for the provider (see transport/verbs);
//   COVERBS_TEST_DEVICE_B     device for side b when the active side of the
//                             pair lands on another device (two-device veth
//                             setups); default $COVERBS_VM_DEV_B;
//   COVERBS_VM_RDMA           rxe|siw: also check the detected transport.
#include "transport/verbs/verbs_provider.h"

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
#include "transport/provider.h"

extern char** environ;

namespace coverbs::transport {
namespace {

using Clock = std::chrono::steady_clock;

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

std::string WcString(const ibv_wc& wc) {
  return absl::StrFormat("wr_id=%u status=%s opcode=%d byte_len=%u qp=0x%x",
                         wc.wr_id, ibv_wc_status_str(wc.status), wc.opcode,
                         wc.byte_len, wc.qp_num);
}

// Polls until `n` completions arrived or `timeout_ms` passed.
std::vector<ibv_wc> PollN(ProviderCq* cq, int n, int timeout_ms = 15000) {
  std::vector<ibv_wc> out;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (static_cast<int>(out.size()) < n && Clock::now() < deadline) {
    ibv_wc wc[16];
    int got = cq->Poll(16, wc);
    if (got < 0) {
      ADD_FAILURE() << "Poll returned " << got;
      break;
    }
    out.insert(out.end(), wc, wc + got);
    if (got == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return out;
}

// Nothing more arrives within `ms`.
bool QuietFor(ProviderCq* cq, int ms) { return PollN(cq, 1, ms).empty(); }

// A registered, 64-byte aligned buffer.
struct Buffer {
  explicit Buffer(size_t n) : size(n) {
    data = static_cast<char*>(std::aligned_alloc(64, (n + 63) / 64 * 64));
    std::memset(data, 0, n);
  }
  ~Buffer() {
    mr.reset();
    std::free(data);
  }
  ibv_sge Sge(size_t offset, uint32_t len) const {
    return ibv_sge{reinterpret_cast<uintptr_t>(data + offset), len, mr->lkey()};
  }
  uint64_t Addr(size_t offset) const {
    return reinterpret_cast<uintptr_t>(data + offset);
  }
  char* data;
  size_t size;
  std::unique_ptr<ProviderMr> mr;
};

constexpr int kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

class VerbsPairTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!VerbsDevicesPresent()) {
      GTEST_SKIP() << "no RDMA device on this host (ibv_get_device_list found "
                      "none): this suite runs for real in the VM harness "
                      "(VM_RDMA=rxe|siw tests/vm/run-in-vm.sh)";
    }
    auto p = OpenVerbsProvider(ProviderOptions{});
    ASSERT_TRUE(p.ok()) << p.status();
    pa_ = std::move(*p);
    const char* dev_b = Env("COVERBS_TEST_DEVICE_B");
    if (dev_b == nullptr) dev_b = Env("COVERBS_VM_DEV_B");
    if (dev_b != nullptr && pa_->caps().device_name != dev_b) {
      ProviderOptions ob;
      ob.device = dev_b;
      auto q = OpenVerbsProvider(ob);
      ASSERT_TRUE(q.ok()) << q.status();
      pb_owned_ = std::move(*q);
    }
    pb_ = pb_owned_ != nullptr ? pb_owned_.get() : pa_.get();
    auto pd_a = pa_->AllocPd();
    ASSERT_TRUE(pd_a.ok()) << pd_a.status();
    pd_a_ = std::move(*pd_a);
    auto pd_b = pb_->AllocPd();
    ASSERT_TRUE(pd_b.ok()) << pd_b.status();
    pd_b_ = std::move(*pd_b);
    auto cq_a = pa_->CreateCq(256);
    ASSERT_TRUE(cq_a.ok()) << cq_a.status();
    cq_a_ = std::move(*cq_a);
    auto cq_b = pb_->CreateCq(256);
    ASSERT_TRUE(cq_b.ok()) << cq_b.status();
    cq_b_ = std::move(*cq_b);
  }

  void TearDown() override {
    pair_.a.reset();
    pair_.b.reset();
    pair_.keepalive.reset();
  }

  QpInit InitA() const {
    QpInit i;
    i.send_cq = i.recv_cq = cq_a_.get();
    i.max_send_wr = i.max_recv_wr = 32;
    i.max_send_sge = i.max_recv_sge = 1;
    i.min_rnr_timer = 1;
    return i;
  }
  QpInit InitB() const {
    QpInit i = InitA();
    i.send_cq = i.recv_cq = cq_b_.get();
    return i;
  }

  void Connect(const QpInit& a, const QpInit& b) {
    auto pair = pa_->CreateConnectedPair(pd_a_.get(), a, pd_b_.get(), b);
    ASSERT_TRUE(pair.ok()) << pair.status();
    pair_ = std::move(*pair);
    ASSERT_NE(pair_.a, nullptr);
    ASSERT_NE(pair_.b, nullptr);
  }
  void Connect() { Connect(InitA(), InitB()); }

  void Register(Buffer& buf, ProviderPd* pd, int access = kAllAccess) {
    auto mr = pd->RegisterMemory(buf.data, buf.size, access);
    ASSERT_TRUE(mr.ok()) << mr.status();
    buf.mr = std::move(*mr);
  }

  void PostRecv(ProviderQp* qp, const Buffer& buf, size_t off, uint32_t len,
                uint64_t wr_id) {
    ibv_sge sge = buf.Sge(off, len);
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    absl::Status s = qp->PostRecv(&wr, &bad);
    ASSERT_TRUE(s.ok()) << s;
  }

  absl::Status PostSend(ProviderQp* qp, ibv_wr_opcode op, const Buffer& buf,
                        size_t off, uint32_t len, uint64_t wr_id,
                        uint64_t remote = 0, uint32_t rkey = 0,
                        uint32_t imm = 0) {
    ibv_sge sge = buf.Sge(off, len);
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.opcode = op;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htobe32(imm);
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    return qp->PostSend(&wr, &bad);
  }

  // One completion on `cq`, successful, with `wr_id`.
  ibv_wc ExpectOne(ProviderCq* cq, uint64_t wr_id) {
    std::vector<ibv_wc> wc = PollN(cq, 1);
    EXPECT_EQ(wc.size(), 1u) << "no completion for wr_id " << wr_id;
    if (wc.empty()) return ibv_wc{};
    EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS) << WcString(wc[0]);
    EXPECT_EQ(wc[0].wr_id, wr_id) << WcString(wc[0]);
    return wc[0];
  }

  std::unique_ptr<Provider> pa_;
  std::unique_ptr<Provider> pb_owned_;
  Provider* pb_ = nullptr;
  std::unique_ptr<ProviderPd> pd_a_, pd_b_;
  std::unique_ptr<ProviderCq> cq_a_, cq_b_;
  QpPair pair_;
};

TEST_F(VerbsPairTest, CapsDescribeTheDevice) {
  const DeviceCaps& c = pa_->caps();
  std::printf(
      "device %s port %d transport %s gid_index %d max_qp_wr %u max_sge %u "
      "max_cqe %u max_inline %u max_srq_wr %u max_rd_atom %u atomics %d "
      "write_imm %d send_imm %d active_first %d\n",
      c.device_name.c_str(), c.port, TransportKindName(c.transport), c.gid_index,
      c.max_qp_wr, c.max_sge, c.max_cqe, c.max_inline_data, c.max_srq_wr,
      c.max_qp_rd_atom, c.atomics, c.write_with_imm, c.send_with_imm,
      c.active_side_sends_first);
  EXPECT_EQ(c.provider, "verbs");
  EXPECT_FALSE(c.device_name.empty());
  EXPECT_GE(c.port, 1);
  EXPECT_GT(c.max_qp_wr, 0u);
  EXPECT_GT(c.max_sge, 0u);
  EXPECT_GT(c.max_cqe, 0u);
  EXPECT_NE(VerbsContext(*pa_), nullptr);
  const bool iwarp = c.transport == TransportKind::kIWarp;
  EXPECT_EQ(c.write_with_imm, !iwarp);
  EXPECT_EQ(c.send_with_imm, !iwarp);
  EXPECT_EQ(c.active_side_sends_first, iwarp);
  EXPECT_EQ(c.gid_index >= 0, c.transport == TransportKind::kRoCE);
  if (const char* kind = Env("COVERBS_VM_RDMA")) {
    if (std::string(kind) == "rxe") {
      EXPECT_EQ(c.transport, TransportKind::kRoCE);
      EXPECT_TRUE(c.atomics);
    }
    if (std::string(kind) == "siw") {
      EXPECT_EQ(c.transport, TransportKind::kIWarp);
    }
    EXPECT_GT(c.max_inline_data, 0u);
  }
  if (const char* dev = Env("COVERBS_VM_DEV")) {
    EXPECT_EQ(c.device_name, dev);
  }
  if (const char* gid = Env("COVERBS_VM_GID_INDEX_A");
      gid != nullptr && c.transport == TransportKind::kRoCE) {
    // The harness computed the IPv4-mapped GID's index from sysfs.
    EXPECT_EQ(c.gid_index, std::atoi(gid));
  }
}

TEST_F(VerbsPairTest, OpenOptionsAreChecked) {
  ProviderOptions bad_dev;
  bad_dev.device = "no_such_dev0";
  auto p = OpenVerbsProvider(bad_dev);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
  // The message lists the devices that exist.
  EXPECT_NE(p.status().message().find(pa_->caps().device_name),
            std::string::npos)
      << p.status();

  ProviderOptions bad_port;
  bad_port.device = pa_->caps().device_name;
  bad_port.port = 77;
  p = OpenVerbsProvider(bad_port);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
      << p.status();

  if (pa_->caps().transport == TransportKind::kRoCE) {
    ProviderOptions bad_gid;
    bad_gid.gid_index = 100000;
    p = OpenVerbsProvider(bad_gid);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
        << p.status();
    ProviderOptions same_gid;
    same_gid.gid_index = pa_->caps().gid_index;
    p = OpenVerbsProvider(same_gid);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)->caps().gid_index, pa_->caps().gid_index);
  }
}

TEST_F(VerbsPairTest, CreateCqChecksItsArgument) {
  EXPECT_EQ(pa_->CreateCq(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  if (pa_->caps().max_cqe < (1u << 30)) {
    auto cq = pa_->CreateCq(static_cast<int>(pa_->caps().max_cqe) + 1);
    EXPECT_EQ(cq.status().code(), absl::StatusCode::kInvalidArgument)
        << cq.status();
  }
  EXPECT_GE(cq_a_->capacity(), 256);
  int fl = fcntl(cq_a_->fd(), F_GETFL);
  EXPECT_TRUE(fl & O_NONBLOCK);
  EXPECT_EQ(cq_a_->GetEvents(), 0);  // nothing pending, does not block
}

TEST_F(VerbsPairTest, RegisterMemoryAddsLocalWriteForRemoteWrite) {
  Buffer buf(4096);
  auto mr = pd_a_->RegisterMemory(
      buf.data, buf.size, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ((*mr)->addr(), buf.data);
  EXPECT_EQ((*mr)->length(), buf.size);
  EXPECT_EQ((*mr)->access(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ);
  auto ro = pd_a_->RegisterMemory(buf.data, buf.size, IBV_ACCESS_REMOTE_READ);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_EQ((*ro)->access(), IBV_ACCESS_REMOTE_READ);
}

TEST_F(VerbsPairTest, SendRecvBothWays) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 256, 11));
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.b.get(), bb, 0, 256, 21));
  // b (the active side) sends first: required on iWARP.
  std::strcpy(bb.data + 1024, "hello from b");
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 1024, 13, 22).ok());
  ibv_wc s = ExpectOne(cq_b_.get(), 22);
  EXPECT_EQ(s.opcode, IBV_WC_SEND);
  ibv_wc r = ExpectOne(cq_a_.get(), 11);
  EXPECT_EQ(r.opcode, IBV_WC_RECV);
  EXPECT_EQ(r.byte_len, 13u);
  EXPECT_EQ(r.qp_num, pair_.a->qp_num());
  EXPECT_STREQ(ba.data, "hello from b");

  std::strcpy(ba.data + 1024, "and back from a");
  ASSERT_TRUE(PostSend(pair_.a.get(), IBV_WR_SEND, ba, 1024, 16, 12).ok());
  ExpectOne(cq_a_.get(), 12);
  r = ExpectOne(cq_b_.get(), 21);
  EXPECT_EQ(r.byte_len, 16u);
  EXPECT_STREQ(bb.data, "and back from a");
  EXPECT_EQ(pair_.a->state(), IBV_QPS_RTS);
  EXPECT_EQ(pair_.b->state(), IBV_QPS_RTS);
  EXPECT_GE(pair_.a->max_send_wr(), 32u);
  EXPECT_GE(pair_.a->max_recv_wr(), 32u);
}

// rnr_retry / retry_cnt travel through the CM, timeout through
// RDMA_OPTION_ID_ACK_TIMEOUT, min_rnr_timer through an RTS->RTS modify. On
// InfiniBand/RoCE each QP gets its own timeout, min_rnr_timer and rnr_retry;
// retry_cnt is one value for both (the connect request carries it): init_b's.
// iWARP QPs have none of these (and siw does not report them).
TEST_F(VerbsPairTest, ConnectionAttributesFollowQpInit) {
  QpInit ia = InitA(), ib = InitB();
  ia.rnr_retry = 5;
  ia.retry_cnt = 6;
  ia.timeout = 15;
  ia.min_rnr_timer = 3;
  ib.rnr_retry = 4;
  ib.retry_cnt = 3;
  ib.timeout = 16;
  ib.min_rnr_timer = 2;
  ASSERT_NO_FATAL_FAILURE(Connect(ia, ib));
  for (auto [name, qp, init] : {std::tuple("a", pair_.a.get(), &ia),
                                std::tuple("b", pair_.b.get(), &ib)}) {
    ibv_qp* raw = VerbsQpHandle(qp);
    ASSERT_NE(raw, nullptr);
    ibv_qp_attr attr{};
    ibv_qp_init_attr init_attr{};
    ASSERT_EQ(
        ibv_query_qp(raw, &attr,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MIN_RNR_TIMER |
                         IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC,
                     &init_attr),
        0);
    std::printf(
        "QP %s 0x%x: state %d timeout %u retry_cnt %u rnr_retry %u "
        "min_rnr_timer %u max_rd_atomic %u max_dest_rd_atomic %u (asked "
        "timeout %u retry_cnt %u rnr_retry %u min_rnr_timer %u)\n",
        name, qp->qp_num(), attr.qp_state, attr.timeout, attr.retry_cnt,
        attr.rnr_retry, attr.min_rnr_timer, attr.max_rd_atomic,
        attr.max_dest_rd_atomic, init->timeout, init->retry_cnt,
        init->rnr_retry, init->min_rnr_timer);
    if (pa_->caps().transport != TransportKind::kIWarp) {
      EXPECT_EQ(attr.timeout, init->timeout) << name;
      EXPECT_EQ(attr.min_rnr_timer, init->min_rnr_timer) << name;
      EXPECT_EQ(attr.rnr_retry, init->rnr_retry) << name;
      EXPECT_EQ(attr.retry_cnt, ib.retry_cnt) << name;
    }
  }
}

TEST_F(VerbsPairTest, CompletionChannelWakesAndAcks) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 1));
  ASSERT_TRUE(cq_a_->RequestNotify().ok());
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND, bb, 0, 8, 2).ok());
  pollfd pfd{cq_a_->fd(), POLLIN, 0};
  ASSERT_EQ(poll(&pfd, 1, 15000), 1) << "the completion channel never fired";
  int events = cq_a_->GetEvents();
  EXPECT_GE(events, 1);
  cq_a_->AckEvents(events);
  ExpectOne(cq_a_.get(), 1);
  ExpectOne(cq_b_.get(), 2);
  EXPECT_EQ(cq_a_->GetEvents(), 0);  // consumed; not re-armed
}

TEST_F(VerbsPairTest, InlineSend) {
  const uint32_t max_inline = pa_->caps().max_inline_data;
  if (max_inline < 16) GTEST_SKIP() << "device inline limit " << max_inline;
  QpInit ia = InitA(), ib = InitB();
  ib.max_inline_data = std::min<uint32_t>(64, max_inline);
  ASSERT_NO_FATAL_FAILURE(Connect(ia, ib));
  EXPECT_GE(pair_.b->max_inline_data(), ib.max_inline_data);
  Buffer ba(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 5));
  char msg[16] = "inline payload";  // not registered: inline copies it
  ibv_sge sge{reinterpret_cast<uintptr_t>(msg), sizeof(msg), 0};
  ibv_send_wr wr{};
  wr.wr_id = 6;
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  ASSERT_TRUE(pair_.b->PostSend(&wr, &bad).ok());
  std::memset(msg, 'x', sizeof(msg));  // already copied at post
  ExpectOne(cq_b_.get(), 6);
  ExpectOne(cq_a_.get(), 5);
  EXPECT_STREQ(ba.data, "inline payload");
}

TEST_F(VerbsPairTest, RdmaWriteAndRead) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(8192), bb(8192);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  for (int i = 0; i < 4096; ++i) bb.data[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_RDMA_WRITE, bb, 0, 4096, 31,
                       ba.Addr(4096), ba.mr->rkey())
                  .ok());
  ExpectOne(cq_b_.get(), 31);
  // A write completion means the data is placed at the target.
  EXPECT_EQ(std::memcmp(ba.data + 4096, bb.data, 4096), 0);

  for (int i = 0; i < 1000; ++i) ba.data[i] = static_cast<char>(255 - i);
  ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_RDMA_READ, bb, 4096, 1000, 32,
                       ba.Addr(0), ba.mr->rkey())
                  .ok());
  ibv_wc wc = ExpectOne(cq_b_.get(), 32);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(std::memcmp(bb.data + 4096, ba.data, 1000), 0);
  // One-sided: nothing on a's CQ.
  EXPECT_TRUE(QuietFor(cq_a_.get(), 50));
}

TEST_F(VerbsPairTest, ImmediateDataOrAClearRefusal) {
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(4096), bb(4096);
  ASSERT_NO_FATAL_FAILURE(Register(ba, pd_a_.get()));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  const DeviceCaps& caps = pa_->caps();
  if (caps.write_with_imm) {
    ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 41));
    std::strcpy(bb.data, "imm write");
    ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_RDMA_WRITE_WITH_IMM, bb, 0, 10,
                         42, ba.Addr(1024), ba.mr->rkey(), 0xabcd)
                    .ok());
    ExpectOne(cq_b_.get(), 42);
    ibv_wc wc = ExpectOne(cq_a_.get(), 41);
    EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
    EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
    EXPECT_EQ(be32toh(wc.imm_data), 0xabcdu);
    EXPECT_STREQ(ba.data + 1024, "imm write");
  }
  if (caps.send_with_imm) {
    ASSERT_NO_FATAL_FAILURE(PostRecv(pair_.a.get(), ba, 0, 64, 43));
    ASSERT_TRUE(PostSend(pair_.b.get(), IBV_WR_SEND_WITH_IMM, bb, 0, 4, 44, 0,
                         0, 0x1234)
                    .ok());
    ExpectOne(cq_b_.get(), 44);
    ibv_wc wc = ExpectOne(cq_a_.get(), 43);
    EXPECT_EQ(wc.opcode, IBV_WC_RECV);
    EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
    EXPECT_EQ(be32toh(wc.imm_data), 0x1234u);
  }
  if (!caps.write_with_imm) {
    // siw refuses at post time; the Status names the QP and the opcode.
    absl::Status s = PostSend(pair_.b.get(), IBV_WR_RDMA_WRITE_WITH_IMM, bb, 0,
                              4, 45, ba.Addr(0), ba.mr->rkey(), 1);
    if (s.ok()) {
      std::vector<ibv_wc> wc = PollN(cq_b_.get(), 1);
      ASSERT_EQ(wc.size(), 1u);
      EXPECT_NE(wc[0].status, IBV_WC_SUCCESS) << WcString(wc[0]);
    } else {
      std::printf("WRITE_WITH_IMM refused: %s\n", s.ToString().c_str());
      const std::string msg(s.message());
      EXPECT_NE(msg.find("RDMA_WRITE_WITH_IMM"), std::string::npos) << msg;
      EXPECT_NE(msg.find(absl::StrFormat("QP 0x%x", pair_.b->qp_num())),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("iWARP"), std::string::npos) << msg;
    }
  }
}

TEST_F(VerbsPairTest, Atomics) {
  if (!pa_->caps().atomics) {
    GTEST_SKIP() << pa_->caps().device_name << " has no atomics";
  }
  ASSERT_NO_FATAL_FAILURE(Connect());
  Buffer ba(64), bb(64);
  ASSERT_NO_FATAL_FAILURE(
      Register(ba, pd_a_.get(), kAllAccess | IBV_ACCESS_REMOTE_ATOMIC));
  ASSERT_NO_FATAL_FAILURE(Register(bb, pd_b_.get()));
  uint64_t* target = reinterpret_cast<uint64_t*>(ba.data);
  uint64_t* result = reinterpret_cast<uint64_t*>(bb.data);
  *target = 5;
  ibv_sge sge = bb.Sge(0, 8);
  ibv_send_wr wr{};
  wr.wr_id = 51;
  wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.atomic.remote_addr = ba.Addr(0);
  wr.wr.atomic.rkey = ba.mr->rkey();
  wr.wr.atomic.compare_add = 5;
  wr.wr.atomic.swap = 9;
  ibv_send_wr* bad = nullptr;
  ASSERT_TRUE(pair_.b->PostSend(&wr, &bad).ok());
  ibv_wc wc = ExpectOne(cq_b_.get(), 51);
  EXPECT_EQ(wc.opcode, IBV_WC_COMP_SWAP);
  EXPECT_EQ(*result, 5u);
  EXPECT_EQ(*target, 9u);

  wr.wr_id = 52;
  wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  wr.wr.atomic.compare_add = 3;
  ASSERT_TRUE(pair_.b->PostSend(&wr, &bad).ok());
  wc = ExpectOne(cq_b_.get(), 52);
  EXPECT_EQ(wc.opcode, IBV_WC_FETCH_ADD);
  EXPECT_EQ(*result, 9u);
  EXPECT_EQ(*target, 12u);
}

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
