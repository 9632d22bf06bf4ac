// echo_server: an RPC server with one method, "Echo", that returns the
// request payload unchanged (zero-copy: the response is sent from the
// request's receive or rendezvous buffer).
//
//   echo_server --address=127.0.0.1 --port=7471 --threads=2
//
// Runs until SIGINT/SIGTERM (or --run_for), then shuts down gracefully and
// prints what it served. See examples/README.md.
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "examples/common.h"
#include "rpc/metrics.h"
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
ABSL_FLAG(absl::Duration, accept_timeout, absl::Seconds(5),
          "A connecting peer must finish its handshake, including its first "
          "message on the connection, within this long, or it is dropped.");
ABSL_FLAG(absl::Duration, drain, absl::Seconds(10),
          "On SIGINT/SIGTERM, drain for at most this long: calls running "
          "finish, new ones are refused as \"server draining\" (a client "
          "pool sends them to another server); 0s cancels them at once.");
ABSL_FLAG(int, max_pending_handshakes, 1024,
          "Handshakes read at once; beyond it the oldest is dropped (silent "
          "peers cannot lock others out).");
ABSL_FLAG(int, srq_depth, 0,
          "Receive through one shared receive queue per reactor of this many "
          "buffers (--srq_buffer_size) instead of a ring per connection "
          "(less memory per idle connection; each connection starts with 2 "
          "receives promised plus 6 reserve, so this bounds connections per "
          "reactor to about srq_depth / 8). Its receives complete on the "
          "reactor's first CQ, which grows by srq_depth unless --cq_entries "
          "is given. 0: rings (64 receives per connection).");
ABSL_FLAG(int, eager_size, 8192,
          "Largest payload sent eagerly (SEND into the peer's receive "
          "buffers, which are this + 16 bytes; with --srq_depth, at most "
          "--srq_buffer_size - 16). Smaller: less memory per connection, and "
          "clients send larger messages by RDMA WRITE (landing buffers or "
          "rendezvous).");
ABSL_FLAG(int, srq_buffer_size, 2048 + 64,
          "With --srq_depth: bytes per SRQ receive buffer. Larger payloads "
          "come by RDMA WRITE.");
ABSL_FLAG(int, srq_initial_credits, 2,
          "With --srq_depth: receives promised to a new connection (its "
          "window grows while its client keeps running out). Fewer: less "
          "memory per idle connection.");
ABSL_FLAG(int, send_depth, 0,
          "Send work requests posted at once per connection (more wait in "
          "order); 0: 64, or 16 with --srq_depth. On a real NIC each costs "
          "send-queue memory even when idle.");
ABSL_FLAG(int, cq_entries, 0,
          "Entries per completion queue (0: the device's, at most 4096). A "
          "connection reserves 144 with the defaults (26 with --srq_depth); "
          "a reactor adds CQs as they fill, up to 64 (1,792 connections per "
          "reactor with rings).");
ABSL_FLAG(absl::Duration, keepalive, absl::ZeroDuration(),
          "Probe a connection whose peer said nothing for this long (0: "
          "off); after 3 unanswered probes the connection is closed (a "
          "frozen or vanished client).");
ABSL_FLAG(int, metrics_port, -1,
          "Serve Prometheus metrics (the server's counters, a latency "
          "histogram per method) at http://--address:PORT/metrics; 0 lets "
          "the system pick the port (it is printed); -1: off.");
ABSL_FLAG(absl::Duration, stats_interval, absl::ZeroDuration(),
          "Print the server's counters this often (0: never). SIGUSR1 prints "
          "them at any time.");

namespace coverbs::examples {
namespace {

void PrintStats(const rpc::Server& server) {
  rpc::Server::Stats st = server.stats();
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf("echo_server: served %llu call(s) on %llu connection(s) (%llu open, "
              "%llu refused, %llu handshake(s) pending, %llu accept error(s)); "
              "%llu failed, %llu cancelled, %llu unknown method, %llu protocol "
              "error(s); %llu request / %llu response bytes; %llu rendezvous, "
              "%llu credit stall(s) on closed connections\n",
              u(st.calls), u(st.connections), u(st.open_connections),
              u(st.rejected_connections), u(st.pending_handshakes),
              u(st.accept_errors), u(st.failed_calls), u(st.cancelled_calls),
              u(st.unknown_method), u(st.protocol_errors), u(st.request_bytes),
              u(st.response_bytes), u(st.rendezvous), u(st.credit_stalls));
  // Why connections ended, and the reactors' stalls, where any.
  std::string closes;
  for (size_t i = 1; i < cm::kCloseCauses; ++i) {
    if (st.closed_by_cause[i] == 0) continue;
    absl::StrAppend(&closes, closes.empty() ? "" : ", ", st.closed_by_cause[i],
                    " ", cm::CloseCauseName(static_cast<cm::CloseCause>(i)));
  }
  std::printf("echo_server: connections ended: %s; %llu reactor stall(s)\n",
              closes.empty() ? "none" : closes.c_str(), u(st.reactor_stalls));
  std::fflush(stdout);
}

int Run() {
  if (!CheckAddressFlag("echo_server", "address", absl::GetFlag(FLAGS_address))) return 2;
  if (!CheckProviderFlag("echo_server", absl::GetFlag(FLAGS_provider))) return 2;
  auto poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll.ok()) {
    std::fprintf(stderr, "echo_server: --poll: %s\n", poll.status().ToString().c_str());
    return 2;
  }
  // Every numeric flag has a stated range; a value outside it exits 2
  // naming the flag and the range.
  constexpr const char* kP = "echo_server";
  const absl::Duration forever = absl::Hours(24 * 365 * 100);
  const int eager = absl::GetFlag(FLAGS_eager_size);
  const int srq_buffer = absl::GetFlag(FLAGS_srq_buffer_size);
  if (!CheckIntFlag(kP, "threads", absl::GetFlag(FLAGS_threads), 1, 1024) ||
      !CheckIntFlag(kP, "max_concurrent_calls",
                    absl::GetFlag(FLAGS_max_concurrent_calls), 1, 1 << 20) ||
      !CheckIntFlag(kP, "max_pending_handshakes",
                    absl::GetFlag(FLAGS_max_pending_handshakes), 1, 1 << 20) ||
      !CheckIntFlag(kP, "srq_depth", absl::GetFlag(FLAGS_srq_depth), 0,
                    1 << 20) ||
      !CheckIntFlag(kP, "cq_entries", absl::GetFlag(FLAGS_cq_entries), 0,
                    1 << 22) ||
      !CheckIntFlag(kP, "eager_size", eager, 64, 1 << 20, "bytes (1 MiB)") ||
      !CheckIntFlag(kP, "srq_buffer_size", srq_buffer, 64, (1 << 20) + 64,
                    "bytes (1 MiB + 64)") ||
      !CheckIntFlag(kP, "send_depth", absl::GetFlag(FLAGS_send_depth), 0,
                    16384) ||
      !CheckDurationFlag(kP, "run_for", absl::GetFlag(FLAGS_run_for),
                         absl::Milliseconds(1), forever,
                         /*infinite_ok=*/true) ||
      !CheckDurationFlag(kP, "accept_timeout",
                         absl::GetFlag(FLAGS_accept_timeout),
                         absl::Milliseconds(1), absl::Hours(1)) ||
      !CheckDurationFlag(kP, "keepalive", absl::GetFlag(FLAGS_keepalive),
                         absl::ZeroDuration(), absl::Hours(24)) ||
      !CheckDurationFlag(kP, "drain", absl::GetFlag(FLAGS_drain),
                         absl::ZeroDuration(), absl::Hours(1)) ||
      !CheckDurationFlag(kP, "stats_interval",
                         absl::GetFlag(FLAGS_stats_interval),
                         absl::ZeroDuration(), forever) ||
      !CheckOutputFileFlag(kP, "port_file", absl::GetFlag(FLAGS_port_file))) {
    return 2;
  }
  if (absl::GetFlag(FLAGS_srq_initial_credits) < 2 ||
      absl::GetFlag(FLAGS_srq_initial_credits) > 16384) {
    std::fprintf(stderr,
                 "echo_server: --srq_initial_credits must be >= 2 (a "
                 "rendezvous needs two "
                 "credits) and at most 16384; got %d\n",
                 absl::GetFlag(FLAGS_srq_initial_credits));
    return 2;
  }
  cm::WorkerOptions ctx_options;
  ctx_options.srq_depth = static_cast<uint32_t>(absl::GetFlag(FLAGS_srq_depth));
  ctx_options.cq_entries = absl::GetFlag(FLAGS_cq_entries);
  ctx_options.srq_buffer_size = static_cast<uint32_t>(srq_buffer);
  // Every flag checked: now the device (it logs which provider it chose).
  auto device = OpenDevice(absl::GetFlag(FLAGS_provider), absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "echo_server: opening the provider: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  cm::WorkerPool::Options pool_options;
  pool_options.threads = static_cast<size_t>(absl::GetFlag(FLAGS_threads));
  pool_options.reactor.poll_mode = *poll;
  pool_options.worker = ctx_options;
  auto workers = cm::WorkerPool::Create(**device, pool_options);
  if (!workers.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", workers.status().ToString().c_str());
    return 1;
  }

  rpc::ServerOptions options;
  options.max_concurrent_calls = absl::GetFlag(FLAGS_max_concurrent_calls);
  options.listener.accept_timeout = absl::GetFlag(FLAGS_accept_timeout);
  options.listener.max_pending_handshakes =
      static_cast<size_t>(absl::GetFlag(FLAGS_max_pending_handshakes));
  options.listener.connection.use_srq = ctx_options.srq_depth > 0;
  options.listener.connection.rendezvous_threshold = static_cast<size_t>(eager);
  options.listener.connection.srq_initial_credits =
      static_cast<uint32_t>(absl::GetFlag(FLAGS_srq_initial_credits));
  options.listener.connection.send_depth = static_cast<uint32_t>(absl::GetFlag(FLAGS_send_depth));
  options.listener.connection.keepalive_interval = absl::GetFlag(FLAGS_keepalive);
  ApplyConnectionFlags(options.listener.connection);
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < -1 || metrics_port > 65535) {
    std::fprintf(stderr, "echo_server: --metrics_port must be -1 (off) or in [0, 65535]\n");
    return 2;
  }
  // Declared before the server: its observer must outlive it.
  std::unique_ptr<rpc::ServerMetrics> metrics;
  if (metrics_port >= 0) {
    metrics = std::make_unique<rpc::ServerMetrics>();
    options.call_observer = metrics->Observer();
  }
  auto server = std::make_unique<rpc::Server>(options);
  absl::Status s = server->Register(
      "Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
        co_return std::move(r.payload);
      });
  if (s.ok()) {
    s = server->Start(**workers, absl::GetFlag(FLAGS_address),
                      absl::GetFlag(FLAGS_port));
  }
  if (s.ok() && metrics != nullptr) {
    metrics->Watch(server.get());
    s = metrics->Listen(absl::GetFlag(FLAGS_address), static_cast<uint16_t>(metrics_port));
    if (s.ok()) {
      std::printf("echo_server: metrics on port %u\n", metrics->port());
    } else {
      metrics->Watch(nullptr);
      server->Shutdown();
    }
  }
  if (!s.ok()) {
    std::fprintf(stderr, "echo_server: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("echo_server: listening on %s:%u, provider %s, %d reactor(s), poll %s\n",
              absl::GetFlag(FLAGS_address).c_str(), server->port(),
              (*device)->Describe().c_str(), absl::GetFlag(FLAGS_threads),
              absl::GetFlag(FLAGS_poll).c_str());
  std::fflush(stdout);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    // Write then rename, so a script polling for the file never reads half.
    const std::string tmp = f + ".tmp";
    std::ofstream out(tmp);
    out << server->port() << "\n";
    out.close();
    // errno from the failed open/write or rename: the reason to print.
    if (out.fail() || std::rename(tmp.c_str(), f.c_str()) != 0) {
      std::fprintf(stderr, "echo_server: cannot write --port_file %s: %s\n",
                   f.c_str(), std::strerror(errno));
      server->Shutdown();
      return 1;
    }
  }

  const absl::Duration run_for = absl::GetFlag(FLAGS_run_for);
  const absl::Duration interval = absl::GetFlag(FLAGS_stats_interval);
  const absl::Time end =
      run_for == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + run_for;
  absl::Time next_stats =
      interval > absl::ZeroDuration() ? absl::Now() + interval : absl::InfiniteFuture();
  int sig = 0;
  for (;;) {
    absl::Time wake = std::min(end, next_stats);
    sig = WaitForSignal(wake == absl::InfiniteFuture() ? absl::InfiniteDuration()
                                                       : wake - absl::Now(),
                        /*stats_signal=*/true);
    if (sig == SIGUSR1) {
      PrintStats(*server);
      continue;
    }
    if (sig != 0) break;
    if (absl::Now() >= end) break;
    if (absl::Now() >= next_stats) {
      PrintStats(*server);
      next_stats += interval;
    }
  }
  std::printf("echo_server: %s, shutting down\n",
              sig == 0 ? "--run_for elapsed" : (sig == SIGINT ? "SIGINT" : "SIGTERM"));
  server->Shutdown(sig == 0 ? absl::ZeroDuration()
                            : absl::GetFlag(FLAGS_drain));
  PrintStats(*server);
  if (metrics != nullptr) metrics->Watch(nullptr);
  server.reset();
  metrics.reset();
  workers->reset();
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
