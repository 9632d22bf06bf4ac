// coverbs_bench: throughput, message rate and latency of coverbs connections
// and RPC, in perftest's spirit. See bench/README.md.
//
//   coverbs_bench --loopback --test=all --sizes=2..1M
//   coverbs_bench --server [--address=A] [--port=P]
//   coverbs_bench --client=A [--port=P] --test=send_bw --sizes=64,64K
//
// Layout: the server listens for cm connections on --port (send_bw,
// write_bw, read_bw, send_lat) and serves the "Echo" RPC on --port + 1
// (rpc_rate, rpc_lat). The client opens --connections connections spread
// over --threads reactors and, for every test and size, tells the server
// what comes with a small parameter message on each connection, runs
// --iters operations per connection with --depth in flight, and collects
// the server's verdict (and, on connection 0, the server's CPU time).
//
// Files: flags.{h,cc} (the command line), side.{h,cc} (device, reactors,
// workers, CPU), server.{h,cc}, client.{h,cc} and driver.{h,cc} (the two
// ends), one file per test kind (send_bw.cc, send_lat.cc, one_sided.cc,
// rpc_echo.cc; see test_kinds.h), run_client.{h,cc} (the loop over tests
// and sizes) and report.{h,cc} (table, JSON, CSV, plot).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/flags.h"
#include "bench/run_client.h"
#include "bench/server.h"
#include "bench/side.h"

#ifdef COVERBS_BENCH_FAULT_INJECTION
ABSL_FLAG(
    int64_t, corrupt_message, -1,
    "Test builds only: send_bw flips one byte of this message (per connection) "
    "after filling it, so that --verify must catch it.");
#endif

namespace coverbs::bench {
namespace {

int64_t CorruptMessage() {
#ifdef COVERBS_BENCH_FAULT_INJECTION
  return absl::GetFlag(FLAGS_corrupt_message);
#else
  return -1;
#endif
}

std::string DefaultAddress() {
  if (const char* a = std::getenv("COVERBS_TEST_ADDR"); a && *a) return a;
  if (const char* a = std::getenv("COVERBS_VM_ADDR_A"); a && *a) return a;
  return "127.0.0.1";
}

int Main() {
  const bool server = absl::GetFlag(FLAGS_server);
  const bool loopback = absl::GetFlag(FLAGS_loopback);
  const std::string client = absl::GetFlag(FLAGS_client);
  if (static_cast<int>(server) + static_cast<int>(loopback) +
          static_cast<int>(!client.empty()) !=
      1) {
    std::fprintf(stderr,
                 "coverbs_bench: give exactly one of --server, --client=ADDR, "
                 "--loopback\n");
    return 2;
  }
  auto poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll.ok()) {
    std::fprintf(stderr, "coverbs_bench: --poll: %s\n",
                 poll.status().ToString().c_str());
    return 2;
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1 || threads > 64) {
    std::fprintf(stderr, "coverbs_bench: --threads must be 1..64\n");
    return 2;
  }
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) address = DefaultAddress();
  const uint16_t port = absl::GetFlag(FLAGS_port);
  const int rpc_flag = absl::GetFlag(FLAGS_rpc_port);
  const uint16_t rpc_port =
      rpc_flag < 0 ? port + 1 : static_cast<uint16_t>(rpc_flag);

  if (!client.empty()) {
    auto side = Side::Create(threads, *poll);
    if (!side.ok()) {
      std::fprintf(stderr, "coverbs_bench: %s\n",
                   side.status().ToString().c_str());
      return 1;
    }
    return RunClient(side->get(), client, port, rpc_port, "client",
                     CorruptMessage());
  }

  auto server_side = Side::Create(threads, *poll);
  if (!server_side.ok()) {
    std::fprintf(stderr, "coverbs_bench: server: %s\n",
                 server_side.status().ToString().c_str());
    return 1;
  }
  int rc = 0;
  {
    Server srv(server_side->get());
    absl::Status s = loopback ? srv.Start(address, 0, 0)
                              : srv.Start(address, port, rpc_port);
    if (!s.ok()) {
      std::fprintf(stderr, "coverbs_bench: server: %s\n", s.ToString().c_str());
      srv.Shutdown();
      return 1;
    }
    if (server) {
      std::printf(
          "coverbs_bench: server on %s, cm port %u, rpc port %u, provider %s\n",
          address.c_str(), srv.port(), srv.rpc_port(),
          (*server_side)->device->Describe().c_str());
      std::fflush(stdout);
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, SIGINT);
      sigaddset(&set, SIGTERM);
      int sig = 0;
      sigwait(&set, &sig);
    } else {
      auto client_side = Side::Create(threads, *poll);
      if (!client_side.ok()) {
        std::fprintf(stderr, "coverbs_bench: client: %s\n",
                     client_side.status().ToString().c_str());
        rc = 1;
      } else {
        rc = RunClient(client_side->get(), address, srv.port(), srv.rpc_port(),
                       "loopback", CorruptMessage());
      }
    }
    srv.Shutdown();
  }
  return rc;
}

}  // namespace
}  // namespace coverbs::bench

int main(int argc, char** argv) {
  // Before any thread: the server waits for these with sigwait.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  absl::SetProgramUsageMessage(
      "coverbs throughput, message rate and latency, in perftest's spirit.\n"
      "  coverbs_bench --loopback --test=all --sizes=2..1M\n"
      "  coverbs_bench --server [--address=A]   /   coverbs_bench --client=A "
      "--test=send_bw");
  absl::ParseCommandLine(argc, argv);
  return coverbs::bench::Main();
}
