// send_bw: `co_await conn.Send(registered buffer)` with --depth in flight;
// the time runs until the server has received every message.
#include <cstring>
#include <span>

#include "absl/strings/str_format.h"
#include "bench/sample_clock.h"
#include "bench/test_kinds.h"
#include "core/reactor.h"

namespace coverbs::bench {
namespace {

Task<void> SendOne(ClientConn* c, Window* w, int slot,
                   transport::LocalBuffer lb, ConnRun* out) {
  const int64_t t0 = SampleTicks();
  absl::Status s = co_await c->conn->Send(lb);
  out->lat_ns.push_back(SampleNs(t0, SampleTicks()));
  if (!s.ok()) out->Error(s);
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
  w->wg.Done();
}

}  // namespace

Task<absl::Status> DriveSendBw(ClientConn* c, const RunSpec& spec,
                               ConnRun* out) {
  const size_t size = spec.size;
  const int depth = spec.depth;
  Reactor* r = Reactor::Current();
  Window w(depth);
  if (!spec.verify) std::memset(c->mem.data(), 0x5a, c->mem.size());
  out->start = Clock::now();
  for (uint64_t i = 0; i < spec.iters; ++i) {
    auto slot = co_await TakeSlot(&w);
    if (!slot.ok()) break;
    transport::LocalBuffer lb = Slot(c, *slot, size);
    if (spec.verify) {
      std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
      FillPattern(b, i);
      if (static_cast<int64_t>(i) == spec.corrupt_message && size > 0) {
        b[size / 2] ^= std::byte{0x01};  // the fault --verify must catch
      }
    }
    r->Spawn(SendOne(c, &w, *slot, lb, out), spec.stop);
  }
  co_await Drain(&w);
  // The bandwidth counts until the server has received every message.
  absl::Status s = co_await ReadReply(c, out);
  out->end = Clock::now();
  co_return s;
}

Task<absl::Status> ServeSendBw(cm::Connection* conn, const Params& p,
                               Reply* rep) {
  for (uint64_t i = 0; i < p.iters; ++i) {
    auto m = co_await conn->Recv();
    if (!m.ok()) co_return m.status();
    if (!p.verify) continue;
    if (m->size() != p.size) {
      Mismatch(rep, absl::StrFormat("message %d: %d bytes, expected %d", i,
                                    m->size(), p.size));
    } else if (int64_t at = FirstMismatch(m->data(), i); at >= 0) {
      Mismatch(rep, absl::StrFormat("message %d: byte %d differs", i, at));
    }
  }
  co_return absl::OkStatus();
}

}  // namespace coverbs::bench
