// The verbs provider against a real RDMA device: a connected pair through
// rdma_cm, SEND/RECV, RDMA WRITE/READ, immediate data, atomics and the
// completion channel. The error statuses, SRQ, teardown and the memlock
// limit are in verbs_provider_errors_test.cc (the same binary).
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
#include "tests/transport/verbs/verbs_pair_fixture.h"
#include "transport/provider.h"

namespace coverbs::transport {
namespace {

TEST_F(VerbsPairTest, CapsDescribeTheDevice) {
  const DeviceCaps& c = pa_->caps();
  std::printf(
      "device %s port %d transport %s gid_index %d max_qp_wr %u max_sge %u "
      "max_cqe %u max_inline %u max_srq_wr %u max_rd_atom %u atomics %d "
      "write_imm %d send_imm %d active_first %d\n",
      c.device_name.c_str(), c.port, TransportKindName(c.transport),
      c.gid_index, c.max_qp_wr, c.max_sge, c.max_cqe, c.max_inline_data,
      c.max_srq_wr, c.max_qp_rd_atom, c.atomics, c.write_with_imm,
      c.send_with_imm, c.active_side_sends_first);
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

}  // namespace
}  // namespace coverbs::transport
