// echo_client: calls "Echo" on an echo_server N times with payloads of a
// given size, keeping a given number of calls in flight, checks every echoed
// byte, and prints calls/s, MB/s and latency percentiles.
//
//   echo_client --server=127.0.0.1 --port=7471 --calls=10000 --size=4096
//               --concurrency=32
//
// Exit status: 0 when every call succeeded and every byte matched, 1
// otherwise (the first errors are printed), 2 for bad flags.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/sync.h"
#include "examples/common.h"
#include "rpc/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1",
          "Address of the echo_server (the address it listens on).");
ABSL_FLAG(uint16_t, port, 7471, "Port of the echo_server.");
ABSL_FLAG(int64_t, calls, 10000, "Number of Echo calls to make in all.");
ABSL_FLAG(int64_t, size, 4096,
          "Payload bytes per call (0 .. 64 MiB - 32). Payloads above the "
          "connection's rendezvous threshold (8 KiB) travel by RDMA WRITE.");
ABSL_FLAG(std::vector<std::string>, sizes, {},
          "Comma-separated payload sizes to run one after another on the "
          "same connections, one table row each (e.g. 64,4096,1048576); "
          "overrides --size.");
ABSL_FLAG(int, concurrency, 32,
          "Calls in flight at once, over all connections (pipelining).");
ABSL_FLAG(int, connections, 1,
          "Connections to open; the in-flight calls are spread over them.");
ABSL_FLAG(absl::Duration, hold, absl::ZeroDuration(),
          "Keep the connections open (idle) this long after the calls, "
          "e.g. to measure the server's memory per connection; prints a "
          "line when the hold starts.");
ABSL_FLAG(bool, verify, true,
          "Check every byte of every response against the request.");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(30),
          "Deadline of each call; an expired call counts as an error.");
ABSL_FLAG(std::string, provider, "auto",
          "RDMA provider: verbs, soft or auto (verbs if a device is present, "
          "else soft). Must match the server's.");
ABSL_FLAG(std::string, device, "",
          "verbs: the device to use (e.g. rxe0); empty = the first device "
          "with an active port.");
ABSL_FLAG(int64_t, max_memory_mb, 2048,
          "Refuse to start when --concurrency x the largest size would need "
          "more payload memory than this (each call in flight holds its "
          "request and its response).");
ABSL_FLAG(std::string, poll, "event",
          "How the client's reactor waits for completions: event, busy or "
          "adaptive.");

namespace coverbs::examples {
namespace {

struct Run {
  int64_t calls = 0;
  size_t size = 0;
  absl::Duration deadline;
  bool verify = true;

  std::atomic<int64_t> next{0};
  int64_t errors = 0;
  int64_t mismatches = 0;
  std::vector<std::string> first_errors;
  std::vector<int64_t> latency_ns;  // one per successful call
  WaitGroup done;

  void Error(std::string e) {
    ++errors;
    if (first_errors.size() < 5) first_errors.push_back(std::move(e));
  }
};

// One of --concurrency callers: takes the next call index until all are
// taken. Its request buffer (`request`: run->size bytes, filled with a
// pattern of the worker's own before the run's clock starts) carries the
// call index in the first 8 bytes so that every echo is distinct.
Task<void> Caller(Run* run, rpc::Client* client, int worker,
                  std::span<std::byte> request) {
  while (true) {
    int64_t i = run->next.fetch_add(1);
    if (i >= run->calls) break;
    if (!request.empty()) std::memcpy(request.data(), &i, std::min(sizeof(i), request.size()));
    rpc::CallOptions options;
    options.deadline = absl::Now() + run->deadline;
    auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<rpc::Response> r = co_await client->Call("Echo", request, options);
    auto t1 = std::chrono::steady_clock::now();
    if (!r.ok()) {
      run->Error(absl::StrCat("call ", i, ": ", r.status().ToString()));
      continue;
    }
    run->latency_ns.push_back(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
    if (!run->verify) continue;
    std::span<const std::byte> got = r->data();
    if (got.size() != request.size()) {
      ++run->mismatches;
      run->Error(absl::StrCat("call ", i, ": echoed ", got.size(), " bytes, sent ",
                              request.size()));
    } else if (!got.empty() && std::memcmp(got.data(), request.data(), got.size()) != 0) {
      size_t at = 0;
      while (got[at] == request[at]) ++at;
      ++run->mismatches;
      run->Error(absl::StrCat("call ", i, ": byte ", at, " differs"));
    }
  }
  run->done.Done();
}

// Runs every size in `runs` in turn over the same connections; fills in
// each run's elapsed time.
Task<absl::Status> Main(cm::Worker* ctx, std::vector<Run>* runs,
                        std::vector<absl::Duration>* elapsed) {
  const std::string server = absl::GetFlag(FLAGS_server);
  const uint16_t port = absl::GetFlag(FLAGS_port);
  std::vector<std::unique_ptr<rpc::Client>> clients;
  for (int c = 0; c < absl::GetFlag(FLAGS_connections); ++c) {
    rpc::ClientOptions co;
    ApplyConnectionFlags(co.connect.connection);
    auto client = co_await rpc::Client::Connect(*ctx, server, port, co);
    if (!client.ok()) {
      // Connections must be gone before the Worker: close the others.
      for (auto& c : clients) (void)co_await c->Close();
      co_return absl::UnavailableError(absl::StrCat("connecting to ", server, ":", port,
                                                    ": ", client.status().ToString()));
    }
    clients.push_back(*std::move(client));
  }
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  absl::Status status;
  for (Run& run : *runs) {
    // Every caller's request is allocated and written before the clock
    // starts: done by each caller as it started, the first calls' latency
    // included the later callers' page faults (16 x 1 MiB: ~10 ms).
    std::vector<std::vector<std::byte>> requests(concurrency);
    for (int w = 0; w < concurrency; ++w) {
      requests[w].resize(run.size);
      FillPattern(requests[w], w);
    }
    run.done.Add(concurrency);
    absl::Time start = absl::Now();
    for (int w = 0; w < concurrency; ++w) {
      Reactor::Current()->Spawn(
          Caller(&run, clients[w % clients.size()].get(), w, requests[w]));
    }
    status = co_await run.done.Wait();
    elapsed->push_back(absl::Now() - start);
    if (!status.ok()) break;
  }
  if (status.ok() && absl::GetFlag(FLAGS_hold) > absl::ZeroDuration()) {
    std::printf("echo_client: holding %zu idle connection(s) for %s\n", clients.size(),
                absl::FormatDuration(absl::GetFlag(FLAGS_hold)).c_str());
    std::fflush(stdout);
    auto sleep = Reactor::Current()->Sleep(absl::GetFlag(FLAGS_hold));
    (void)co_await sleep;
  }
  for (auto& c : clients) {
    absl::Status s = co_await c->Close();
    if (!s.ok()) std::fprintf(stderr, "echo_client: close: %s\n", s.ToString().c_str());
  }
  co_return status;
}

int RunMain() {
  if (!CheckAddressFlag("echo_client", "server", absl::GetFlag(FLAGS_server))) return 2;
  if (!CheckProviderFlag("echo_client", absl::GetFlag(FLAGS_provider))) return 2;
  std::vector<int64_t> sizes;
  for (const std::string& v : absl::GetFlag(FLAGS_sizes)) {
    int64_t n;
    if (!absl::SimpleAtoi(v, &n)) {
      std::fprintf(stderr, "echo_client: --sizes: '%s' is not a number\n", v.c_str());
      return 2;
    }
    sizes.push_back(n);
  }
  if (sizes.empty()) sizes.push_back(absl::GetFlag(FLAGS_size));
  const int64_t calls = absl::GetFlag(FLAGS_calls);
  // Every numeric flag has a stated range; a value outside it exits 2
  // naming the flag and the range.
  constexpr const char* kP = "echo_client";
  for (int64_t n : sizes) {
    if (!CheckIntFlag(kP, absl::GetFlag(FLAGS_sizes).empty() ? "size" : "sizes",
                      n, 0, (64ll << 20) - 32, "bytes (64 MiB - 32)")) {
      return 2;
    }
  }
  if (!CheckIntFlag(kP, "calls", calls, 0, int64_t{1} << 40) ||
      !CheckIntFlag(kP, "concurrency", absl::GetFlag(FLAGS_concurrency), 1,
                    1 << 20) ||
      !CheckIntFlag(kP, "connections", absl::GetFlag(FLAGS_connections), 1,
                    65536) ||
      !CheckIntFlag(kP, "max_memory_mb", absl::GetFlag(FLAGS_max_memory_mb), 1,
                    1 << 30, "MiB") ||
      !CheckDurationFlag(kP, "deadline", absl::GetFlag(FLAGS_deadline),
                         absl::Milliseconds(1), absl::Hours(24)) ||
      !CheckDurationFlag(kP, "hold", absl::GetFlag(FLAGS_hold),
                         absl::ZeroDuration(), absl::Hours(24 * 365))) {
    return 2;
  }
  // Each caller holds a request buffer and, while it checks it, the
  // response: bound that before allocating rather than dying in bad_alloc.
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  const int64_t need_mb =
      (2 * largest * absl::GetFlag(FLAGS_concurrency) + (1 << 20) - 1) >> 20;
  if (need_mb > absl::GetFlag(FLAGS_max_memory_mb)) {
    std::fprintf(stderr,
                 "echo_client: --concurrency=%d x size %lld needs about %lld MiB of "
                 "payload buffers (request + response per call in flight), above "
                 "--max_memory_mb=%lld; lower --concurrency or the size, or raise "
                 "--max_memory_mb\n",
                 absl::GetFlag(FLAGS_concurrency), static_cast<long long>(largest),
                 static_cast<long long>(need_mb),
                 static_cast<long long>(absl::GetFlag(FLAGS_max_memory_mb)));
    return 2;
  }
  std::vector<Run> runs(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    runs[k].calls = calls;
    runs[k].size = static_cast<size_t>(sizes[k]);
    runs[k].deadline = absl::GetFlag(FLAGS_deadline);
    runs[k].verify = absl::GetFlag(FLAGS_verify);
    runs[k].latency_ns.reserve(calls);
  }
  auto poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll.ok()) {
    std::fprintf(stderr, "echo_client: --poll: %s\n", poll.status().ToString().c_str());
    return 2;
  }
  auto device = OpenDevice(absl::GetFlag(FLAGS_provider), absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "echo_client: opening the provider: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  ReactorOptions ro;
  ro.poll_mode = *poll;
  auto reactor = Reactor::Create(ro);
  if (!reactor.ok()) {
    std::fprintf(stderr, "echo_client: %s\n", reactor.status().ToString().c_str());
    return 1;
  }
  auto ctx = cm::Worker::Create(**reactor, **device);
  if (!ctx.ok()) {
    std::fprintf(stderr, "echo_client: %s\n", ctx.status().ToString().c_str());
    return 1;
  }
  std::vector<absl::Duration> elapsed;
  absl::Status status = (*reactor)->BlockOn(Main(ctx->get(), &runs, &elapsed));
  ctx->reset();

  std::printf("echo_client: provider %s, server %s:%u, %d connection(s), %d in flight, verify %s\n",
              (*device)->Describe().c_str(), absl::GetFlag(FLAGS_server).c_str(),
              absl::GetFlag(FLAGS_port), absl::GetFlag(FLAGS_connections),
              absl::GetFlag(FLAGS_concurrency), absl::GetFlag(FLAGS_verify) ? "on" : "off");
  std::printf("%10s %9s %7s %10s %11s %10s %9s %9s %9s\n", "size(B)", "calls", "errors",
              "elapsed(s)", "calls/s", "MB/s", "p50(us)", "p99(us)", "p999(us)");
  int64_t errors = 0, mismatches = 0;
  for (size_t k = 0; k < elapsed.size(); ++k) {
    Run& run = runs[k];
    std::sort(run.latency_ns.begin(), run.latency_ns.end());
    const double secs = std::max(absl::ToDoubleSeconds(elapsed[k]), 1e-9);
    const double ok_calls = static_cast<double>(run.latency_ns.size());
    auto us = [&](double p) { return Percentile(run.latency_ns, p) / 1000.0; };
    std::printf("%10zu %9lld %7lld %10.3f %11.1f %10.2f %9.1f %9.1f %9.1f\n", run.size,
                static_cast<long long>(run.calls), static_cast<long long>(run.errors), secs,
                ok_calls / secs, ok_calls * run.size / secs / 1e6, us(0.50), us(0.99),
                us(0.999));
    for (const std::string& e : run.first_errors) {
      std::fprintf(stderr, "echo_client: error (size %zu): %s\n", run.size, e.c_str());
    }
    errors += run.errors;
    mismatches += run.mismatches;
  }
  std::printf("(MB/s: payload bytes echoed per second, each direction; latency: "
              "from Call to its response, with %d in flight)\n",
              absl::GetFlag(FLAGS_concurrency));
  if (!status.ok()) {
    std::fprintf(stderr, "echo_client: %s\n", status.ToString().c_str());
    return 1;
  }
  if (errors > 0) {
    std::fprintf(stderr, "echo_client: FAILED: %lld error(s), %lld data mismatch(es)\n",
                 static_cast<long long>(errors), static_cast<long long>(mismatches));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace coverbs::examples

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Calls \"Echo\" on an echo_server and reports throughput and latency.\n"
      "Usage: echo_client --server=A --port=P [--calls=N] [--size=B] "
      "[--concurrency=K] [--connections=C] [--provider=auto|verbs|soft]");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::examples::RunMain();
}
