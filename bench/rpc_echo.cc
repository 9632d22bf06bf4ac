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

Task<void> CallOne(ClientConn* c, Window* w, int slot,
                   std::span<const std::byte> req, bool verify, ConnRun* out) {
  const int64_t t0 = SampleTicks();
  auto r = co_await c->rpc->Call("Echo", req);
  out->lat_ns.push_back(SampleNs(t0, SampleTicks()));
  if (!r.ok()) {
    out->Error(r.status());
  } else if (verify &&
             (r->size() != req.size() ||
              (!req.empty() &&
               std::memcmp(r->data().data(), req.data(), req.size()) != 0))) {
    out->Mismatch("echoed payload differs from the request");
  }
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
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
  for (uint64_t i = 0; i < spec.iters; ++i) {
    auto slot = co_await TakeSlot(&w);
    if (!slot.ok()) break;
    std::span<std::byte> req(c->mem.data() + *slot * size, size);
    if (spec.verify) FillPattern(req, i);
    r->Spawn(CallOne(c, &w, *slot, req, spec.verify, out), spec.stop);
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
