// Helpers for the soft provider tests: every wait is bounded so that a bug
// fails a test instead of hanging it.
#ifndef COVERBS_TESTS_TRANSPORT_SOFT_SOFT_TEST_UTIL_H_
#define COVERBS_TESTS_TRANSPORT_SOFT_SOFT_TEST_UTIL_H_

#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "transport/provider.h"
#include "transport/soft/soft_provider.h"

namespace coverbs::transport::soft::testing {

using Clock = std::chrono::steady_clock;
inline constexpr auto kWait = std::chrono::seconds(20);

// Polls `cq` until `n` completions arrived or `timeout` passed; sleeps on the
// completion channel in between.
inline std::vector<ibv_wc> PollN(ProviderCq* cq, size_t n,
                                 Clock::duration timeout = kWait) {
  std::vector<ibv_wc> out;
  auto deadline = Clock::now() + timeout;
  ibv_wc wc[64];
  while (out.size() < n) {
    int want = static_cast<int>(std::min<size_t>(64, n - out.size()));
    int got = cq->Poll(want, wc);
    if (got < 0) {
      ADD_FAILURE() << "Poll failed: " << got;
      break;
    }
    if (got > 0) {
      out.insert(out.end(), wc, wc + got);
      continue;
    }
    if (Clock::now() >= deadline) break;
    EXPECT_TRUE(cq->RequestNotify().ok());
    got = cq->Poll(want, wc);  // completions that raced with arming
    if (got > 0) {
      out.insert(out.end(), wc, wc + got);
      continue;
    }
    pollfd p{cq->fd(), POLLIN, 0};
    poll(&p, 1, 10);
    int ev = cq->GetEvents();
    if (ev > 0) cq->AckEvents(ev);
  }
  return out;
}

inline ibv_wc PollOne(ProviderCq* cq, Clock::duration timeout = kWait) {
  std::vector<ibv_wc> v = PollN(cq, 1, timeout);
  if (v.empty()) {
    ADD_FAILURE() << "no completion within the timeout";
    ibv_wc none{};
    none.status = IBV_WC_GENERAL_ERR;
    none.wr_id = ~0ULL;
    return none;
  }
  return v[0];
}

// Nothing arrives on `cq` within `d`.
inline void ExpectEmpty(ProviderCq* cq,
                        Clock::duration d = std::chrono::milliseconds(50)) {
  std::this_thread::sleep_for(d);
  ibv_wc wc;
  int got = cq->Poll(1, &wc);
  EXPECT_EQ(got, 0) << "unexpected completion wr_id " << wc.wr_id
                    << " status " << ibv_wc_status_str(wc.status);
}

inline bool WaitState(ProviderQp* qp, ibv_qp_state s,
                      Clock::duration timeout = kWait) {
  auto deadline = Clock::now() + timeout;
  while (qp->state() != s) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline ibv_sge Sge(const void* addr, uint32_t len, uint32_t lkey) {
  ibv_sge s;
  s.addr = reinterpret_cast<uintptr_t>(addr);
  s.length = len;
  s.lkey = lkey;
  return s;
}

inline absl::Status PostSend1(ProviderQp* qp, uint64_t wr_id, ibv_wr_opcode op,
                              ibv_sge* sges, int nsge, unsigned flags,
                              uint64_t remote = 0, uint32_t rkey = 0,
                              uint32_t imm = 0) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sges;
  wr.num_sge = nsge;
  wr.send_flags = flags;
  wr.imm_data = imm;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  return qp->PostSend(&wr, &bad);
}

inline absl::Status PostAtomic(ProviderQp* qp, uint64_t wr_id,
                               ibv_wr_opcode op, ibv_sge* sge, uint64_t remote,
                               uint32_t rkey, uint64_t compare_add,
                               uint64_t swap) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.atomic.remote_addr = remote;
  wr.wr.atomic.rkey = rkey;
  wr.wr.atomic.compare_add = compare_add;
  wr.wr.atomic.swap = swap;
  ibv_send_wr* bad = nullptr;
  return qp->PostSend(&wr, &bad);
}

inline absl::Status PostRecv1(ProviderQp* qp, uint64_t wr_id, ibv_sge* sges,
                              int nsge) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sges;
  wr.num_sge = nsge;
  ibv_recv_wr* bad = nullptr;
  return qp->PostRecv(&wr, &bad);
}

constexpr int kAllAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                           IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

// A provider, two PDs, two CQs (one per side, shared by send and recv).
class SoftFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    provider_ = CreateSoftProvider();
    pd_a_ = *provider_->AllocPd();
    pd_b_ = *provider_->AllocPd();
    cq_a_ = *provider_->CreateCq(16384);
    cq_b_ = *provider_->CreateCq(16384);
#ifdef COVERBS_SOFT_TEST_DRIVEN_CQS
    // The *_driven targets: both CQs are driven, as by a reactor, so the
    // QPs connected to them receive on whoever calls GetEvents (PollN does)
    // or, when nobody does, on the progress thread's periodic check.
    for (ProviderCq* cq : {cq_a_.get(), cq_b_.get()}) {
      cq->BeginBatch();
      cq->EndBatch();
    }
#endif
  }
  void TearDown() override { pair_ = QpPair(); }

  QpInit Init(ProviderCq* cq) const {
    QpInit init;
    init.send_cq = cq;
    init.recv_cq = cq;
    init.max_send_wr = 256;
    init.max_recv_wr = 1024;
    init.max_send_sge = 16;
    init.max_recv_sge = 16;
    init.max_inline_data = 256;
    return init;
  }

  void Connect() { Connect(Init(cq_a_.get()), Init(cq_b_.get())); }
  void Connect(const QpInit& a, const QpInit& b) {
    auto pair =
        provider_->CreateConnectedPair(pd_a_.get(), a, pd_b_.get(), b);
    ASSERT_TRUE(pair.ok()) << pair.status();
    pair_ = *std::move(pair);
    ASSERT_EQ(pair_.a->state(), IBV_QPS_RTS);
    ASSERT_EQ(pair_.b->state(), IBV_QPS_RTS);
  }

  std::unique_ptr<ProviderMr> Reg(ProviderPd* pd, void* p, size_t n,
                                  int access = kAllAccess) {
    auto mr = pd->RegisterMemory(p, n, access);
    EXPECT_TRUE(mr.ok()) << mr.status();
    return mr.ok() ? *std::move(mr) : nullptr;
  }

  ProviderQp* a() { return pair_.a.get(); }
  ProviderQp* b() { return pair_.b.get(); }

  std::unique_ptr<Provider> provider_;
  std::unique_ptr<ProviderPd> pd_a_, pd_b_;
  std::unique_ptr<ProviderCq> cq_a_, cq_b_;
  QpPair pair_;
};

inline void Fill(std::vector<char>& v, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (char& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
}

}  // namespace coverbs::transport::soft::testing

#endif  // COVERBS_TESTS_TRANSPORT_SOFT_SOFT_TEST_UTIL_H_
