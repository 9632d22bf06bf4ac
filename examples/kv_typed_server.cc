// The typed key-value service (README.md, "Writing a service"): Put and
// Get as typed methods, and a Snapshot the client reads by one RDMA READ
// from a region exposed to that client's connection only. Serves on
// --threads reactors until SIGINT/SIGTERM, with the server's counters and
// a latency histogram per method at http://--address:--metrics_port/metrics.
// kv_typed_test.sh runs it with kv_typed_client and counts the lines of both.
//   kv_typed_server --port=7471 [--address=127.0.0.1] [--threads=4]
//                   [--metrics_port=9471]
#include <memory>
#include <mutex>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "coverbs/metrics.h"
#include "examples/kv_typed.h"
using namespace coverbs;

ABSL_FLAG(std::string, address, "127.0.0.1", "address to listen on");
ABSL_FLAG(uint16_t, port, 7471, "port to listen on");
ABSL_FLAG(size_t, threads, 4, "reactors serving connections");
ABSL_FLAG(uint16_t, metrics_port, 9471, "Prometheus /metrics port");

// The store, shared by every reactor's handlers. std::mutex, not absl::Mutex:
// Debian's prebuilt absl is not instrumented for ThreadSanitizer.
std::mutex mu;
KvMap store;  // mu

Task<absl::StatusOr<uint64_t>> Put(PutArgs a) {
  std::lock_guard lock(mu);
  store[std::move(a.key)] = std::move(a.value);
  co_return store.size();
}

Task<absl::StatusOr<std::string>> Get(std::string key) {
  std::lock_guard lock(mu);
  auto it = store.find(key);
  if (it == store.end()) co_return absl::NotFoundError("no key " + key);
  co_return it->second;
}

Task<absl::StatusOr<RemoteRegion>> Snapshot(rpc::Context& ctx) {
  std::string bytes;
  auto encode = [&] {  // heavy: on a pool thread, not on the reactor
    std::lock_guard lock(mu);
    rpc::Codec<KvMap>::Encode(store, bytes);
  };
  // Named, not a temporary in the co_await (gcc 12: README, "Building").
  CO_RETURN_IF_ERROR(co_await OffloadUntilDone(encode));
  // This connection's key only; the bytes live until Release or its end.
  co_return ctx.ExposeBytes(std::move(bytes));
}

Task<absl::StatusOr<bool>> Release(rpc::Context& ctx, RemoteRegion token) {
  CO_RETURN_IF_ERROR(ctx.Revoke(token));
  co_return true;
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  rpc::ServerMetrics metrics;  // outlives the server
  rpc::Server server({.call_observer = metrics.Observer()});
  if (!server.Register(kPut, Put).ok() || !server.Register(kGet, Get).ok() ||
      !server.Register(kSnapshot, Snapshot).ok() ||
      !server.Register(kRelease, Release).ok()) {
    return 1;
  }
  ServeOptions options{.threads = absl::GetFlag(FLAGS_threads)};
  options.setup = ExportMetrics(metrics, server, absl::GetFlag(FLAGS_address),
                                absl::GetFlag(FLAGS_metrics_port));
  return Serve(server, absl::GetFlag(FLAGS_address), absl::GetFlag(FLAGS_port),
               options);
}
