// tcp_pump: the raw TCP reference for coverbs_bench's send_bw on the soft
// provider. Same process layout as `coverbs_bench --loopback` (one process,
// a sending thread and a receiving thread, loopback TCP) and the same socket
// options as the soft provider; sends --iters messages of each size and
// reports MB/s once the receiver has read every byte.
//
//   tcp_pump --sizes=64,4K,64K,1M --iters=2000
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/report.h"
#include "transport/soft/soft_provider.h"

ABSL_FLAG(std::string, sizes, "65536", "Message sizes, as coverbs_bench --sizes.");
ABSL_FLAG(int64_t, iters, 1000, "Messages per size.");

namespace {

using Clock = std::chrono::steady_clock;

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= w;
  }
  return true;
}

bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= r;
  }
  return true;
}

// Seconds to move `iters` messages of `size` bytes; -1 on a socket error.
double Pump(size_t size, int64_t iters) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof(sa);
  coverbs::transport::soft::ConfigureSocket(l);
  if (bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(l, 1) != 0 ||
      getsockname(l, reinterpret_cast<sockaddr*>(&sa), &sl) != 0) {
    return -1;
  }
  int a = socket(AF_INET, SOCK_STREAM, 0);
  coverbs::transport::soft::ConfigureSocket(a);
  if (connect(a, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) return -1;
  int b = accept(l, nullptr, nullptr);
  close(l);
  std::vector<char> sbuf(size, 1), rbuf(size);
  bool read_ok = true;
  auto t0 = Clock::now();
  Clock::time_point t1;
  std::thread reader([&] {
    for (int64_t i = 0; i < iters && read_ok; ++i) read_ok = ReadAll(b, rbuf.data(), size);
    t1 = Clock::now();
  });
  bool write_ok = true;
  for (int64_t i = 0; i < iters && write_ok; ++i) write_ok = WriteAll(a, sbuf.data(), size);
  reader.join();
  close(a);
  close(b);
  if (!read_ok || !write_ok) return -1;
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Raw loopback TCP throughput, the soft provider's reference.");
  absl::ParseCommandLine(argc, argv);
  auto sizes = coverbs::bench::ParseSizes(absl::GetFlag(FLAGS_sizes));
  if (!sizes.ok()) {
    std::fprintf(stderr, "tcp_pump: %s\n", sizes.status().ToString().c_str());
    return 2;
  }
  const int64_t iters = absl::GetFlag(FLAGS_iters);
  std::printf("%10s %10s %12s\n", "#bytes", "iters", "MB/s");
  for (uint64_t size : *sizes) {
    if (size == 0) continue;
    double s = Pump(size, iters);
    if (s <= 0) {
      std::fprintf(stderr, "tcp_pump: size %llu failed\n", static_cast<unsigned long long>(size));
      return 1;
    }
    std::printf("%10llu %10lld %12.2f\n", static_cast<unsigned long long>(size),
                static_cast<long long>(iters), size * iters / s / 1e6);
  }
  return 0;
}
