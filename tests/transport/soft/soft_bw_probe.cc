// A quick throughput check of the soft provider against a raw TCP pump on
// loopback, side by side in one run (not a unit test: prints a ratio).
//   bazel run -c opt //tests/transport/soft:soft_bw_probe -- [msg_bytes] [secs]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "transport/provider.h"
#include "transport/soft/soft_provider.h"

namespace {

using Clock = std::chrono::steady_clock;
using coverbs::transport::ProviderCq;

double RawTcp(size_t msg, double secs) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  listen(l, 1);
  socklen_t sl = sizeof(sa);
  getsockname(l, reinterpret_cast<sockaddr*>(&sa), &sl);
  int a = socket(AF_INET, SOCK_STREAM, 0);
  coverbs::transport::soft::ConfigureSocket(a);
  coverbs::transport::soft::ConfigureSocket(l);
  if (connect(a, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) abort();
  int b = accept(l, nullptr, nullptr);
  close(l);
  std::vector<char> sbuf(msg, 1), rbuf(msg);
  size_t got = 0;
  auto t0 = Clock::now();
  std::thread reader([&] {
    for (;;) {
      ssize_t n = read(b, rbuf.data(), msg);
      if (n <= 0) break;
      got += n;
    }
  });
  auto end = t0 + std::chrono::duration<double>(secs);
  size_t sent = 0;
  while (Clock::now() < end) {
    size_t off = 0;
    while (off < msg) {
      ssize_t n = write(a, sbuf.data() + off, msg - off);
      if (n <= 0) abort();
      off += n;
    }
    sent += msg;
  }
  shutdown(a, SHUT_WR);
  reader.join();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  close(a);
  close(b);
  return got / s;
}

// Event mode: poll, else arm the CQ and sleep on its channel.
int Poll(ProviderCq* cq, ibv_wc* wc, int n, int timeout_ms = 100) {
  for (;;) {
    int got = cq->Poll(n, wc);
    if (got != 0) return got;
    // A failed arm only costs a timeout: the loop polls again.
    cq->RequestNotify().IgnoreError();
    got = cq->Poll(n, wc);
    if (got != 0) return got;
    pollfd p{cq->fd(), POLLIN, 0};
    if (poll(&p, 1, timeout_ms) == 0) return 0;
    int ev = cq->GetEvents();
    if (ev > 0) cq->AckEvents(ev);
  }
}

double Soft(size_t msg, double secs, int depth) {
  auto provider = coverbs::transport::CreateSoftProvider();
  auto pd = *provider->AllocPd();
  auto cqa = *provider->CreateCq(4096);
  auto cqb = *provider->CreateCq(4096);
  coverbs::transport::QpInit ia, ib;
  ia.send_cq = ia.recv_cq = cqa.get();
  ib.send_cq = ib.recv_cq = cqb.get();
  ia.max_send_wr = ib.max_recv_wr = depth;
  auto pair = *provider->CreateConnectedPair(pd.get(), ia, pd.get(), ib);
  std::vector<char> src(msg, 1), dst(msg * depth);
  auto smr = *pd->RegisterMemory(src.data(), msg, IBV_ACCESS_LOCAL_WRITE);
  auto dmr = *pd->RegisterMemory(dst.data(), dst.size(),
                                 IBV_ACCESS_LOCAL_WRITE);
  auto post_recv = [&](int i) {
    ibv_sge s{reinterpret_cast<uintptr_t>(&dst[i * msg]),
              static_cast<uint32_t>(msg), dmr->lkey()};
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad;
    if (!pair.b->PostRecv(&wr, &bad).ok()) abort();
  };
  for (int i = 0; i < depth; ++i) post_recv(i);
  // The receiver replenishes on its own thread, as a server would.
  bool stop = false;
  size_t received = 0;
  std::thread receiver([&] {
    ibv_wc wc[32];
    while (!__atomic_load_n(&stop, __ATOMIC_ACQUIRE)) {
      int n = Poll(cqb.get(), wc, 32, 10);
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) abort();
        received += wc[i].byte_len;
        post_recv(static_cast<int>(wc[i].wr_id));
      }
    }
  });
  ibv_sge s{reinterpret_cast<uintptr_t>(src.data()),
            static_cast<uint32_t>(msg), smr->lkey()};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad;
  int inflight = 0;
  size_t done = 0;
  auto t0 = Clock::now();
  auto end = t0 + std::chrono::duration<double>(secs);
  ibv_wc wc[32];
  while (Clock::now() < end) {
    while (inflight < depth) {
      if (!pair.a->PostSend(&wr, &bad).ok()) abort();
      ++inflight;
    }
    int n = Poll(cqa.get(), wc, 32);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) abort();
      done += msg;
    }
    inflight -= n;
  }
  double el = std::chrono::duration<double>(Clock::now() - t0).count();
  while (inflight > 0) inflight -= Poll(cqa.get(), wc, 32);
  __atomic_store_n(&stop, true, __ATOMIC_RELEASE);
  receiver.join();
  return done / el;
}

}  // namespace

int main(int argc, char** argv) {
  size_t msg = argc > 1 ? strtoull(argv[1], nullptr, 0) : (1 << 20);
  double secs = argc > 2 ? atof(argv[2]) : 2.0;
  int depth = argc > 3 ? atoi(argv[3]) : 16;
  if (argc > 4 && std::string(argv[4]) == "soft") {  // for profiling
    printf("soft send_bw %.2f GB/s\n", Soft(msg, secs, depth) / 1e9);
    return 0;
  }
  double raw = RawTcp(msg, secs);
  double soft = Soft(msg, secs, depth);
  double raw2 = RawTcp(msg, secs);
  printf("msg %zu depth %d: raw tcp %.2f / %.2f GB/s, soft send_bw %.2f GB/s,"
         " ratio %.2f\n",
         msg, depth, raw / 1e9, raw2 / 1e9, soft / 1e9,
         soft / ((raw + raw2) / 2));
  return 0;
}
