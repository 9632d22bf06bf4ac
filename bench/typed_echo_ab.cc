// The typed 64 B echo against the byte echo, in one process over loopback
// (bench/results/typed_rpc_2026-11-27.md): a server on its own reactor
// thread, a client on this one with --depth calls in flight, runs of
// --calls calls alternating byte / typed-string / typed-struct for --pairs
// rounds, so that load changes on the machine hit all three alike.
//   bazel run -c opt //bench:typed_echo_ab -- --calls=100000 --pairs=5
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "coverbs/coverbs.h"

ABSL_FLAG(size_t, calls, 100000, "calls per run");
ABSL_FLAG(size_t, depth, 16, "calls in flight");
ABSL_FLAG(size_t, size, 64, "payload bytes (the struct variant is 64 B)");
ABSL_FLAG(int, pairs, 5, "rounds of (byte, typed string, typed struct)");

namespace coverbs {
namespace {

struct Blob64 {
  char bytes[64];
};

Task<absl::StatusOr<std::string>> EchoString(std::string s) { co_return s; }
Task<absl::StatusOr<Blob64>> EchoBlob(Blob64 b) { co_return b; }

enum Kind { kBytes, kString, kStruct };

Task<absl::StatusOr<double>> Run(rpc::Client& c, Kind kind, size_t calls,
                                 size_t depth, const std::string& payload) {
  Blob64 blob{};
  std::memcpy(blob.bytes, payload.data(),
              std::min(payload.size(), sizeof(blob)));
  const absl::Time t0 = absl::Now();
  auto out =
      co_await ForEachBounded(calls, depth, [&](size_t) -> Task<absl::Status> {
        if (kind == kBytes) {
          auto r = co_await c.Call("Echo", AsBytes(payload));
          co_return r.ok() && r->size() == payload.size() ? absl::OkStatus()
                                                          : r.status();
        } else if (kind == kString) {
          auto r = co_await c.Call<std::string>("EchoString", payload);
          co_return r.ok() && *r == payload ? absl::OkStatus() : r.status();
        }
        auto r = co_await c.Call<Blob64>("EchoBlob", blob);
        co_return r.status();
      });
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  for (auto& s : out) {
    if (!s.ok()) co_return s;
  }
  co_return calls / secs;
}

int Main() {
  rpc::Server server;
  (void)server.Register(
      "Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
        co_return std::move(r.payload);
      });
  (void)server.Register("EchoString", EchoString);
  (void)server.Register("EchoBlob", EchoBlob);
  auto device = transport::Device::Open();
  if (!device.ok()) return 1;
  auto pool = cm::WorkerPool::Create(**device);
  if (!pool.ok() || !server.Start(**pool, "127.0.0.1", 0).ok()) return 1;
  const uint16_t port = server.port();
  std::printf("provider %s, %zu B, %zu in flight, %zu calls per run\n",
              (*device)->name().c_str(), absl::GetFlag(FLAGS_size),
              absl::GetFlag(FLAGS_depth), absl::GetFlag(FLAGS_calls));
  int rc = RunMain([port](cm::Worker& worker) -> Task<absl::Status> {
    CO_ASSIGN_OR_RETURN(
        auto c, co_await rpc::Client::Connect(worker, "127.0.0.1", port));
    const std::string payload(absl::GetFlag(FLAGS_size), 'x');
    std::vector<double> sum(3, 0);
    for (Kind k : {kBytes, kString, kStruct}) {  // warm-up, not counted
      absl::StatusOr<double> warm =
          co_await Run(*c, k, absl::GetFlag(FLAGS_calls) / 10 + 1,
                       absl::GetFlag(FLAGS_depth), payload);
      CO_RETURN_IF_ERROR(warm.status());
    }
    for (int p = 0; p < absl::GetFlag(FLAGS_pairs); ++p) {
      double rate[3];
      for (Kind k : {kBytes, kString, kStruct}) {
        CO_ASSIGN_OR_RETURN(rate[k],
                            co_await Run(*c, k, absl::GetFlag(FLAGS_calls),
                                         absl::GetFlag(FLAGS_depth), payload));
        sum[k] += rate[k];
      }
      std::printf(
          "round %d: byte %.0f/s, typed string %.0f/s (%.3fx), "
          "typed struct %.0f/s (%.3fx)\n",
          p, rate[0], rate[1], rate[1] / rate[0], rate[2], rate[2] / rate[0]);
    }
    std::printf("mean: byte %.0f/s, typed string %.3fx, typed struct %.3fx\n",
                sum[0] / absl::GetFlag(FLAGS_pairs), sum[1] / sum[0],
                sum[2] / sum[0]);
    co_return co_await c->Close();
  });
  server.Shutdown();
  return rc;
}

}  // namespace
}  // namespace coverbs

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return coverbs::Main();
}
