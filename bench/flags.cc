// coverbs_bench's flags; --help explains each.
#include "bench/flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"

ABSL_FLAG(bool, server, false,
          "Run the server side and wait for clients (until SIGINT/SIGTERM).");
ABSL_FLAG(
    std::string, client, "",
    "Run the client side against the coverbs_bench --server at this address.");
ABSL_FLAG(bool, loopback, false,
          "Run server and client in this process (separate devices, reactors "
          "and threads) "
          "over --address.");
ABSL_FLAG(
    std::string, address, "",
    "Server: address to listen on; loopback: address both sides use. Default: "
    "$COVERBS_TEST_ADDR, else $COVERBS_VM_ADDR_A, else 127.0.0.1 (verbs needs "
    "an "
    "address of the RDMA device's netdev).");
ABSL_FLAG(uint16_t, port, 18515,
          "cm port (send/write/read tests); the RPC server uses port + 1. "
          "Loopback picks "
          "free ports.");
ABSL_FLAG(
    int, rpc_port, -1,
    "RPC server port (rpc_rate, rpc_lat); -1 = --port + 1, 0 = any free port.");
ABSL_FLAG(std::string, test, "send_bw",
          "Tests to run, comma-separated: send_bw, write_bw, read_bw, "
          "send_lat, rpc_rate, "
          "rpc_lat, or all.");
ABSL_FLAG(
    std::string, sizes, "65536",
    "Message sizes: a list (64,4K,1M; K/M/G binary) and/or power-of-two ranges "
    "(2..8M).");
ABSL_FLAG(int64_t, iters, 1000,
          "Operations per connection for each test and size.");
ABSL_FLAG(
    int64_t, warmup, 100,
    "Untimed operations per connection before each test and size (first-touch "
    "page faults, lazy binding and cold caches stay out of the figures).");
ABSL_FLAG(absl::Duration, duration, absl::ZeroDuration(),
          "If set, repeat --iters batches for each test and size until this "
          "much time "
          "has passed (perftest -D).");
ABSL_FLAG(int, depth, 16,
          "Operations in flight per connection (bandwidth and rpc_rate tests; "
          "latency "
          "tests use 1).");
ABSL_FLAG(int, connections, 1, "Connections (each test runs on all at once).");
ABSL_FLAG(int, inline_size, -1,
          "Largest send copied into the work request (QpOptions::"
          "max_inline_data, clamped to the device's; perftest --inline_size); "
          "-1: the library's default.");
ABSL_FLAG(int, threads, 1,
          "Reactor threads per side; connections are spread over them.");
ABSL_FLAG(std::string, poll, "event",
          "How reactors wait for completions: event, busy or adaptive.");
ABSL_FLAG(std::string, provider, "auto",
          "verbs, soft, loop (both sides in this process: --loopback), or "
          "auto (verbs if a device exists).");
ABSL_FLAG(std::string, device, "",
          "verbs device (e.g. rxe0); empty = first active.");
ABSL_FLAG(
    bool, verify, false,
    "Check data integrity and order: every message, written slot and read is "
    "checked against the pattern it must hold (costs throughput).");
ABSL_FLAG(std::string, json, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::string, csv, "", "Write the results as CSV to this file.");
ABSL_FLAG(std::string, plot, "",
          "Write an SVG chart of throughput, message rate and latency (p50, "
          "p99) against size to this file.");
ABSL_FLAG(std::string, progress, "auto",
          "Progress line on stderr for runs longer than 2 s: on, off, or auto "
          "(on when "
          "stderr is a terminal).");
ABSL_FLAG(absl::Duration, run_timeout, absl::Minutes(5),
          "Limit for one test at one size; beyond it the run is cancelled and "
          "reported "
          "as failed.");
