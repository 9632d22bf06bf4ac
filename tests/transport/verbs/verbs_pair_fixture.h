// Internal to the verbs provider's tests: the VerbsPairTest fixture (two
// QPs connected through rdma_cm on the device, with a PD and a CQ per side)
// and the helpers its tests share. verbs_provider_test.cc holds the device,
// data-path and event tests; verbs_provider_errors_test.cc the error,
// overflow, teardown and memlock tests. Both are one binary.
#ifndef COVERBS_TESTS_TRANSPORT_VERBS_VERBS_PAIR_FIXTURE_H_
#define COVERBS_TESTS_TRANSPORT_VERBS_VERBS_PAIR_FIXTURE_H_

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "transport/provider.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {

using Clock = std::chrono::steady_clock;

inline const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

inline std::string WcString(const ibv_wc& wc) {
  return absl::StrFormat("wr_id=%u status=%s opcode=%d byte_len=%u qp=0x%x",
                         wc.wr_id, ibv_wc_status_str(wc.status), wc.opcode,
                         wc.byte_len, wc.qp_num);
}

// Polls until `n` completions arrived or `timeout_ms` passed.
inline std::vector<ibv_wc> PollN(ProviderCq* cq, int n,
                                 int timeout_ms = 15000) {
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
inline bool QuietFor(ProviderCq* cq, int ms) {
  return PollN(cq, 1, ms).empty();
}

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

}  // namespace coverbs::transport

#endif  // COVERBS_TESTS_TRANSPORT_VERBS_VERBS_PAIR_FIXTURE_H_
