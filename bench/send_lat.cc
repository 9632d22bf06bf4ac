// send_lat: ping-pong of Send/Recv, one in flight; latency = half the round
// trip (as ib_send_lat).
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/sample_clock.h"
#include "bench/test_kinds.h"

namespace coverbs::bench {

Task<absl::Status> DriveSendLat(ClientConn* c, const RunSpec& spec,
                                ConnRun* out) {
  const size_t size = spec.size;
  transport::LocalBuffer lb = Slot(c, 0, size);
  std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
  out->start = Clock::now();
  for (uint64_t i = 0; i < spec.iters; ++i) {
    if (spec.verify) FillPattern(b, i);
    const int64_t t0 = SampleTicks();
    absl::Status s = co_await c->conn->Send(lb);
    if (!s.ok()) co_return s;
    auto m = co_await c->conn->Recv();
    if (!m.ok()) co_return m.status();
    out->lat_ns.push_back(SampleNs(t0, SampleTicks()) / 2);
    ++out->ops;
    g_progress_ops.fetch_add(1, std::memory_order_relaxed);
    if (spec.verify &&
        (m->size() != size || FirstMismatch(m->data(), i) >= 0)) {
      out->Mismatch(absl::StrFormat("pong %d differs", i));
    }
  }
  out->end = Clock::now();
  co_return co_await ReadReply(c, out);
}

Task<absl::Status> ServeSendLat(cm::Connection* conn, const Params& p,
                                Reply* rep) {
  std::vector<std::byte> mem(std::max<uint64_t>(p.size, 1));
  auto mr = conn->worker().pd().Register(mem.data(), mem.size(),
                                          IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) co_return mr.status();
  transport::LocalBuffer lb = mr->Local();
  lb.length = p.size;
  for (uint64_t i = 0; i < p.iters; ++i) {
    auto m = co_await conn->Recv();
    if (!m.ok()) co_return m.status();
    if (p.verify && (m->size() != p.size || FirstMismatch(m->data(), i) >= 0)) {
      Mismatch(rep, absl::StrFormat("ping %d differs", i));
    }
    if (size_t n = std::min<size_t>(m->size(), p.size); n > 0) {
      std::memcpy(mem.data(), m->data().data(), n);
    }
    m = absl::CancelledError("");  // give the receive buffer back first
    absl::Status s = co_await conn->Send(lb);
    if (!s.ok()) co_return s;
  }
  co_return absl::OkStatus();
}

}  // namespace coverbs::bench
