// rpc_rate and rpc_lat: `co_await client.Call("Echo", payload)` with --depth
// calls in flight per connection (rpc_lat: one at a time; latency = the
// whole call).
#include <cstring>
#include <span>
#include <utility>

#include "bench/sample_clock.h"
#include "bench/test_kinds.h"
#include "core/reactor.h"

namespace coverbs::bench {
namespace {

// One slot of the window: its calls one after another, until `iters` were
// issued on the connection. A loop per slot rather than a task spawned per
// call: the spawn, its record and the window's semaphore were core code run
// for the bench (~280 instructions per call on the client, which
// callgrind_cost.sh counted as the framework's).
Task<void> CallLoop(ClientConn* c, const RunSpec* spec, int slot,
                    uint64_t* next, Window* w, ConnRun* out) {
  const size_t size = spec->size;
  std::span<std::byte> req(c->mem.data() + slot * size, size);
  while (*next < spec->iters && !spec->stop.stop_requested()) {
    const uint64_t i = (*next)++;
    if (spec->verify) FillPattern(req, i);
    const int64_t t0 = SampleTicks();
    auto r = co_await c->rpc->Call("Echo", req);
    out->lat_ns.push_back(SampleNs(t0, SampleTicks()));
    if (!r.ok()) {
      out->Error(r.status());
    } else if (spec->verify &&
               (r->size() != req.size() ||
                (!req.empty() &&
                 std::memcmp(r->data().data(), req.data(), req.size()) != 0))) {
      out->Mismatch("echoed payload differs from the request");
    }
    ++out->ops;
    g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  }
  w->wg.Done();
}

}  // namespace

Task<absl::Status> DriveRpc(ClientConn* c, const RunSpec& spec, ConnRun* out) {
  const size_t size = spec.size;
  const int depth = IsLatencyTest(spec.test) ? 1 : spec.depth;
  Reactor* r = Reactor::Current();
  absl::Status s = co_await EnsureMemory(c, size * depth);
  if (!s.ok()) co_return s;
  Window w(depth);
  out->start = Clock::now();
  uint64_t next = 0;
  w.wg.Add(depth);
  for (int slot = 0; slot < depth; ++slot) {
    r->Spawn(CallLoop(c, &spec, slot, &next, &w, out), spec.stop);
  }
  co_await Drain(&w);
  out->end = Clock::now();
  co_return absl::OkStatus();
}

absl::Status RegisterEcho(rpc::Server& server) {
  return server.Register(
      "Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
        co_return std::move(r.payload);
      });
}

}  // namespace coverbs::bench
