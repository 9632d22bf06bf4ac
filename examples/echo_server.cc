// echo_server: an RPC server with one method, "Echo", that returns the
// request payload unchanged (zero-copy: the response is sent from the
// request's receive or rendezvous buffer).
//
//   echo_server --address=127.0.0.1 --port=7471 --threads=2
//
// Runs until SIGINT/SIGTERM (or --run_for), then shuts down gracefully and
// prints what it served. See examples/README.md.
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "examples/common.h"
#include "rpc/server.h"

ABSL_FLAG(std::string, address, "127.0.0.1",
          "Address to listen on. verbs provider: an IP address of the RDMA "
          "device's network interface (e.g. the rxe/siw netdev's address); "
          "soft provider: any local address. 0.0.0.0 listens on all.");
ABSL_FLAG(uint16_t, port, 7471,
          "Port to listen on; 0 lets the system pick one (it is printed, and "
          "written to --port_file).");
ABSL_FLAG(std::string, port_file, "",
          "If set, the listening port is written to this file (decimal, one "
          "line) once the server accepts connections. For scripts.");
ABSL_FLAG(int, threads, 2,
          "Reactor threads serving connections. Accepted connections are "
          "spread over them round-robin; each connection stays on one.");
ABSL_FLAG(std::string, provider, "auto",
          "RDMA provider: verbs (rdma-core: a real NIC, Soft-RoCE or "
          "SoftiWARP), soft (the software RNIC over TCP, any host), or auto "
          "(verbs if a device is present, else soft).");
ABSL_FLAG(std::string, device, "",
          "verbs: the device to use (e.g. rxe0); empty = the first device "
          "with an active port.");
ABSL_FLAG(std::string, poll, "event",
          "How the reactors wait for completions: event (sleep on the "
          "completion channel), busy (spin) or adaptive (spin briefly while "
          "work is in flight, then sleep).");
ABSL_FLAG(int, max_concurrent_calls, 128,
          "Echo handlers running at once per connection; further requests "
          "queue and then hold the client back through credits.");
ABSL_FLAG(absl::Duration, run_for, absl::InfiniteDuration(),
          "Exit after this long (e.g. 30s); default: until SIGINT/SIGTERM.");

namespace coverbs::examples {
namespace {

int Run() {
  if (!CheckAddressFlag("echo_server", "address", absl::GetFlag(FLAGS_address))) return 2;
  auto poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll.ok()) {
    std::fprintf(stderr, "echo_server: --poll: %s\n", poll.status().ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_threads) < 1) {
    std::fprintf(stderr, "echo_server: --threads must be at least 1\n");
    return 2;
  }
  auto device = OpenDevice(absl::GetFlag(FLAGS_provider), absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "echo_server: opening the provider: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  auto contexts = ContextPool::Create(**device, absl::GetFlag(FLAGS_threads), *poll);
  if (!contexts.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", contexts.status().ToString().c_str());
    return 1;
  }

  rpc::ServerOptions options;
  options.max_concurrent_calls = absl::GetFlag(FLAGS_max_concurrent_calls);
  auto server = std::make_unique<rpc::Server>(options);
  absl::Status s = server->Register(
      "Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
        co_return std::move(r.payload);
      });
  if (s.ok()) {
    s = server->Start((*contexts)->contexts(), absl::GetFlag(FLAGS_address),
                      absl::GetFlag(FLAGS_port));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("echo_server: listening on %s:%u, provider %s, %d reactor(s), poll %s\n",
              absl::GetFlag(FLAGS_address).c_str(), server->port(),
              DescribeDevice(**device).c_str(), absl::GetFlag(FLAGS_threads),
              absl::GetFlag(FLAGS_poll).c_str());
  std::fflush(stdout);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    // Write then rename, so a script polling for the file never reads half.
    const std::string tmp = f + ".tmp";
    {
      std::ofstream out(tmp);
      out << server->port() << "\n";
    }
    if (std::rename(tmp.c_str(), f.c_str()) != 0) {
      std::fprintf(stderr, "echo_server: cannot write --port_file %s\n", f.c_str());
      server->Shutdown();
      return 1;
    }
  }

  int sig = WaitForSignal(absl::GetFlag(FLAGS_run_for));
  std::printf("echo_server: %s, shutting down\n",
              sig == 0 ? "--run_for elapsed" : (sig == SIGINT ? "SIGINT" : "SIGTERM"));
  server->Shutdown();
  rpc::Server::Stats st = server->stats();
  std::printf("echo_server: served %llu call(s) on %llu connection(s); %llu "
              "cancelled, %llu unknown method, %llu protocol error(s)\n",
              static_cast<unsigned long long>(st.calls),
              static_cast<unsigned long long>(st.connections),
              static_cast<unsigned long long>(st.cancelled_calls),
              static_cast<unsigned long long>(st.unknown_method),
              static_cast<unsigned long long>(st.protocol_errors));
  server.reset();
  contexts->reset();
  return 0;
}

}  // namespace
}  // namespace coverbs::examples

int main(int argc, char** argv) {
  // Before any thread exists, so every reactor thread inherits the mask and
  // the signals reach WaitForSignal.
  coverbs::examples::BlockTerminationSignals();
  absl::SetProgramUsageMessage(
      "Serves the \"Echo\" RPC (returns the request payload) until SIGINT or "
      "SIGTERM.\nUsage: echo_server [--address=A] [--port=P] [--threads=N] "
      "[--provider=auto|verbs|soft]");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::examples::Run();
}
