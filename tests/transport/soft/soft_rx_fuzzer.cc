// libFuzzer entry point for the soft provider's receive path: the framing in
// transport/soft/qp_rx.cc and what each frame does (qp_rx_frames.cc), i.e.
// every byte a connected peer can send after the HELLO.
//
// Built two ways, as tests/rpc/wire_fuzzer.cc: with clang
// -fsanitize=fuzzer it is a real libFuzzer target (soft_rx_libfuzzer_test.sh
// builds and runs it on the committed corpus); with gcc it links
// soft_fuzz_driver.cc, which replays the corpus and mutations of it through
// the same entry point (so `bazel test --config=asan` runs it everywhere).
//
// One input is one connection. The harness plays the peer of a real soft
// QP over a UNIX socketpair: it reads the QP's HELLO, answers with a valid
// one, then writes the input's bytes as the rest of the stream, cut into
// chunks at points the input chooses and each chunk consumed by the QP
// before the next is written (so headers and payloads are split across
// reads at arbitrary offsets). Then it closes its side and waits for the QP
// to reach the error state.
//
// Input layout:
//   byte 0   mode: bit 0 the QP's receive CQ is driven (the harness thread
//            receives, as a reactor does: RxInline); bit 1 receives are
//            posted (else a SEND meets RNR); bit 2 the QP uses an SRQ
//   byte 1   seed of the chunk sizes
//   rest     the stream after the HELLO: frames as transport/soft/wire.h.
//            Since keys and addresses differ per process, an rkey
//            0xC0B5AE0i names region i below and an addr whose high 32
//            bits are 0xADD0000i is region i's base plus the low 32 bits
//            as a signed offset; other values go to the QP unchanged.
//   regions  0 full remote access, 1 REMOTE_READ only, 2 deregistered
//            (a stale key), 3 full access in another PD, 4 LOCAL_WRITE only
// Before the stream the QP has posted, in this order, seq 0 SEND (16 B),
// 1 RDMA WRITE (16 B), 2 RDMA READ (64 B), 3 compare-and-swap, 4
// fetch-and-add, so ACKs, NAKs and responses from the input find requests.
//
// Properties checked on every input (abort on violation):
//  - no crash, sanitizer report or hang (every wait is bounded: 10 s);
//  - the QP ends in the error state once the peer closed;
//  - every completion names a WR that was posted, at most once, and after
//    the QP is destroyed every posted WR has completed exactly once.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "transport/provider.h"
#include "transport/soft/soft_provider.h"
#include "transport/soft/wire.h"

namespace {

using namespace coverbs::transport;
namespace wire = coverbs::transport::soft::wire;
using Clock = std::chrono::steady_clock;

constexpr auto kLimit = std::chrono::seconds(10);
constexpr size_t kRegion = 4096;
constexpr int kRegions = 5;
constexpr uint32_t kKeyTag = 0xC0B5AE00;
constexpr uint32_t kAddrTag = 0xADD00000;
constexpr int kSends = 5;  // requester WRs posted before the stream
constexpr int kRecvs = 4;

void Fail(const char* what) {
  std::fprintf(stderr, "soft_rx_fuzzer: %s\n", what);
  std::abort();
}

void Check(bool ok, const char* what) {
  if (!ok) Fail(what);
}

// Process-wide objects, made once: the PDs, the regions and a QP that
// stays connected so that the progress thread is not restarted per input.
struct Env {
  std::unique_ptr<Provider> provider;
  std::unique_ptr<ProviderPd> pd;
  std::unique_ptr<ProviderPd> other_pd;
  std::unique_ptr<ProviderCq> cq;      // polled by the harness
  std::unique_ptr<ProviderCq> driven;  // BeginBatch'd: received inline
  alignas(64) char mem[kRegions][kRegion];
  alignas(64) char local[kRegion];  // the QP's own buffers
  std::unique_ptr<ProviderMr> mr[kRegions];
  std::unique_ptr<ProviderMr> local_mr;
  uint32_t rkey[kRegions] = {};
  std::unique_ptr<ProviderQp> keeper;
  int keeper_peer = -1;
};

Env& GetEnv() {
  static Env* env = [] {
    auto* e = new Env();
    e->provider = CreateSoftProvider();
    auto pd = e->provider->AllocPd();
    auto other = e->provider->AllocPd();
    auto cq = e->provider->CreateCq(1024);
    auto driven = e->provider->CreateCq(1024);
    Check(pd.ok() && other.ok() && cq.ok() && driven.ok(), "setup failed");
    e->pd = *std::move(pd);
    e->other_pd = *std::move(other);
    e->cq = *std::move(cq);
    e->driven = *std::move(driven);
    e->driven->BeginBatch();  // marks it driven (as a reactor's first turn)
    e->driven->EndBatch();
    constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    const int access[kRegions] = {kAll, IBV_ACCESS_REMOTE_READ, kAll, kAll,
                                  IBV_ACCESS_LOCAL_WRITE};
    for (int i = 0; i < kRegions; ++i) {
      ProviderPd* pd_i = i == 3 ? e->other_pd.get() : e->pd.get();
      auto mr = pd_i->RegisterMemory(e->mem[i], kRegion, access[i]);
      Check(mr.ok(), "RegisterMemory failed");
      e->mr[i] = *std::move(mr);
      e->rkey[i] = e->mr[i]->rkey();
    }
    e->mr[2].reset();  // region 2's key is stale from now on
    auto local = e->pd->RegisterMemory(e->local, kRegion, kAll);
    Check(local.ok(), "RegisterMemory failed");
    e->local_mr = *std::move(local);
    int sv[2];
    Check(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair failed");
    QpInit init;
    init.send_cq = e->cq.get();
    init.recv_cq = e->cq.get();
    auto keeper = soft::CreateQpOnSocket(e->pd.get(), init, sv[0]);
    Check(keeper.ok(), "keeper QP failed");
    e->keeper = *std::move(keeper);
    e->keeper_peer = sv[1];
    return e;
  }();
  return *env;
}

// The stream with symbolic keys and addresses resolved, walking frames as
// the QP's parser does (header, then payload_len bytes).
std::vector<char> Resolve(const Env& env, const uint8_t* p, size_t n) {
  std::vector<char> s(p, p + n);
  size_t pos = 0;
  while (pos + wire::kHeaderSize <= s.size()) {
    wire::Header h = wire::Decode(s.data() + pos);
    if ((h.rkey & 0xffffff00u) == kKeyTag && (h.rkey & 0xff) < kRegions) {
      h.rkey = env.rkey[h.rkey & 0xff];
    }
    uint32_t hi = static_cast<uint32_t>(h.addr >> 32);
    if ((hi & 0xffffff00u) == kAddrTag && (hi & 0xff) < kRegions) {
      auto off = static_cast<int32_t>(static_cast<uint32_t>(h.addr));
      h.addr = reinterpret_cast<uintptr_t>(env.mem[hi & 0xff]) +
               static_cast<int64_t>(off);
    }
    char reserved = s[pos + 3];
    wire::Encode(h, s.data() + pos);
    s[pos + 3] = reserved;  // Encode writes 0; the peer may send anything
    pos += wire::kHeaderSize + h.payload_len;
  }
  return s;
}

struct Completions {
  std::vector<int> seen;  // per wr_id
  void Take(ProviderCq* cq) {
    ibv_wc wc[32];
    int got;
    while ((got = cq->Poll(32, wc)) > 0) {
      for (int i = 0; i < got; ++i) {
        Check(wc[i].wr_id < seen.size(), "completion for a WR never posted");
        Check(++seen[wc[i].wr_id] == 1, "a WR completed twice");
      }
    }
  }
};

// The QP's side of the connection made progress: drain what it sent (so it
// never blocks on a full socket), run the driven CQ's receive as a reactor
// would, take completions.
void Pump(Env& env, int fd, bool driven, Completions& c, int timeout_ms) {
  pollfd p[2] = {{fd, POLLIN, 0}, {env.driven->fd(), POLLIN, 0}};
  poll(p, driven ? 2 : 1, timeout_ms);
  char sink[65536];
  while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  if (driven) {
    env.driven->BeginBatch();
    int ev = env.driven->GetEvents();
    if (ev > 0) env.driven->AckEvents(ev);
    c.Take(env.driven.get());
    env.driven->EndBatch();
  }
  c.Take(env.cq.get());
}

void WriteAll(Env& env, int fd, const char* p, size_t n, bool driven,
              Completions& c, Clock::time_point deadline) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= w;
      continue;
    }
    // EPIPE: the QP closed its end after an error; the rest is moot.
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return;
    Check(Clock::now() < deadline, "the QP stopped reading (hang)");
    Pump(env, fd, driven, c, 1);
  }
}

// Until the QP has taken every byte written so far (or closed).
void WaitConsumed(Env& env, int fd, bool driven, Completions& c,
                  Clock::time_point deadline) {
  for (;;) {
    int queued = 0;
    if (ioctl(fd, SIOCOUTQ, &queued) != 0 || queued == 0) return;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 0);
    if (p.revents & (POLLHUP | POLLERR)) return;
    Check(Clock::now() < deadline, "the QP stopped reading (hang)");
    Pump(env, fd, driven, c, 1);
  }
}

void PostRequests(Env& env, ProviderQp* qp) {
  char* l = env.local;
  uint32_t lkey = env.local_mr->lkey();
  ibv_sge sge[kSends] = {
      {reinterpret_cast<uintptr_t>(l), 16, lkey},
      {reinterpret_cast<uintptr_t>(l + 16), 16, lkey},
      {reinterpret_cast<uintptr_t>(l + 1024), 64, lkey},
      {reinterpret_cast<uintptr_t>(l + 2048), 8, lkey},
      {reinterpret_cast<uintptr_t>(l + 2056), 8, lkey},
  };
  const ibv_wr_opcode ops[kSends] = {
      IBV_WR_SEND, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ,
      IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD};
  ibv_send_wr wr[kSends] = {};
  for (int i = 0; i < kSends; ++i) {
    wr[i].wr_id = i;
    wr[i].opcode = ops[i];
    wr[i].sg_list = &sge[i];
    wr[i].num_sge = 1;
    wr[i].send_flags = IBV_SEND_SIGNALED;
    wr[i].next = i + 1 < kSends ? &wr[i + 1] : nullptr;
    if (i >= 3) {
      wr[i].wr.atomic.remote_addr = 0x1000;
      wr[i].wr.atomic.rkey = 0x1234;
      wr[i].wr.atomic.compare_add = 1;
    } else {
      wr[i].wr.rdma.remote_addr = 0x1000;
      wr[i].wr.rdma.rkey = 0x1234;
    }
  }
  ibv_send_wr* bad = nullptr;
  Check(qp->PostSend(wr, &bad).ok(), "PostSend failed");
}

void PostRecvs(Env& env, ProviderQp* qp, ProviderSrq* srq) {
  uint32_t lkey = env.local_mr->lkey();
  ibv_sge sge[kRecvs][2];
  ibv_recv_wr wr[kRecvs] = {};
  for (int i = 0; i < kRecvs; ++i) {
    char* base = env.local + 3072 + i * 256;
    sge[i][0] = {reinterpret_cast<uintptr_t>(base), 100, lkey};
    sge[i][1] = {reinterpret_cast<uintptr_t>(base + 128), 128, lkey};
    wr[i].wr_id = kSends + i;
    wr[i].sg_list = sge[i];
    wr[i].num_sge = 2;
    wr[i].next = i + 1 < kRecvs ? &wr[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  absl::Status s = srq ? srq->PostRecv(wr, &bad) : qp->PostRecv(wr, &bad);
  Check(s.ok(), "PostRecv failed");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Env& env = GetEnv();
  const bool driven = data[0] & 1;
  const bool recvs = data[0] & 2;
  const bool use_srq = data[0] & 4;
  uint32_t rng = 0x9e3779b9u * (data[1] + 1);
  std::vector<char> stream = Resolve(env, data + 2, size - 2);

  // A fresh SRQ per input: one keeps the receives no message landed in.
  std::unique_ptr<ProviderSrq> srq;
  if (use_srq) {
    auto s = env.pd->CreateSrq(16, 2);
    Check(s.ok(), "CreateSrq failed");
    srq = *std::move(s);
  }
  int sv[2];
  Check(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair failed");
  QpInit init;
  init.send_cq = driven ? env.driven.get() : env.cq.get();
  init.recv_cq = init.send_cq;
  init.srq = srq.get();
  init.max_send_wr = 16;
  init.max_recv_wr = 16;
  init.max_recv_sge = 2;
  auto qp_or = soft::CreateQpOnSocket(env.pd.get(), init, sv[0]);
  Check(qp_or.ok(), "CreateQpOnSocket failed");
  std::unique_ptr<ProviderQp> qp = *std::move(qp_or);
  int fd = sv[1];
  fcntl(fd, F_SETFL, O_NONBLOCK);
  const auto deadline = Clock::now() + kLimit;
  Completions c;
  c.seen.assign(kSends + kRecvs, 0);
  PostRequests(env, qp.get());
  if (recvs) PostRecvs(env, qp.get(), srq.get());

  wire::Header hello;
  hello.opcode = wire::kHello;
  hello.addr = wire::kHelloMagic;
  hello.dma_len = wire::kVersion;
  hello.qpn = 0x77;
  char hb[wire::kHeaderSize];
  wire::Encode(hello, hb);
  WriteAll(env, fd, hb, sizeof(hb), driven, c, deadline);

  size_t pos = 0;
  for (int chunk = 0; pos < stream.size(); ++chunk) {
    rng = rng * 1664525u + 1013904223u;
    size_t len = stream.size() - pos;
    if (chunk < 24) {  // later: the rest at once
      uint32_t r = rng >> 16;
      len = std::min<size_t>(len, r % 4 == 0 ? 1 + r % 7 : 1 + r % 97);
    }
    WriteAll(env, fd, stream.data() + pos, len, driven, c, deadline);
    pos += len;
    WaitConsumed(env, fd, driven, c, deadline);
  }
  shutdown(fd, SHUT_WR);
  // The QP sees the end of the stream (or met an error before): it goes to
  // error and closes its end.
  while (qp->state() != IBV_QPS_ERR) {
    Check(Clock::now() < deadline, "the QP did not reach the error state");
    Pump(env, fd, driven, c, 1);
  }
  qp.reset();  // synchronous: nothing touches the QP afterwards
  Pump(env, fd, driven, c, 0);
  close(fd);
  for (int i = 0; i < kSends; ++i) {
    Check(c.seen[i] == 1, "a send WR did not complete exactly once");
  }
  if (recvs && !use_srq) {
    for (int i = kSends; i < kSends + kRecvs; ++i) {
      Check(c.seen[i] == 1, "a receive WR did not complete exactly once");
    }
  }
  // An SRQ's receives are not flushed (only those a message landed in
  // completed, each at most once: checked by Take); it goes with its QP.
  return 0;
}
