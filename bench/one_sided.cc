// write_bw and read_bw: `co_await conn.Write / Read(local, remote)` with
// --depth in flight, into / from a region the server exposed. One file for
// both: they differ only in the direction of the operation and what
// --verify checks.
#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/sample_clock.h"
#include "bench/test_kinds.h"
#include "core/reactor.h"

namespace coverbs::bench {
namespace {

Task<void> OneSided(ClientConn* c, Window* w, int slot,
                    transport::LocalBuffer lb, transport::RemoteRegion remote,
                    bool write, uint64_t check_tag, bool verify, ConnRun* out) {
  const int64_t t0 = SampleTicks();
  absl::Status s;
  if (write) {
    s = co_await c->conn->Write(lb, remote);
  } else {
    s = co_await c->conn->Read(lb, remote);
  }
  out->lat_ns.push_back(SampleNs(t0, SampleTicks()));
  if (!s.ok()) {
    out->Error(s);
  } else if (verify && !write) {
    std::span<const std::byte> got(static_cast<const std::byte*>(lb.addr),
                                   lb.length);
    if (int64_t at = FirstMismatch(got, check_tag); at >= 0) {
      out->Mismatch(
          absl::StrFormat("read of slot %d: byte %d differs", check_tag, at));
    }
  }
  ++out->ops;
  g_progress_ops.fetch_add(1, std::memory_order_relaxed);
  w->free_slots.push_back(slot);
  w->sem.Release();
  w->wg.Done();
}

}  // namespace

Task<absl::Status> DriveOneSided(ClientConn* c, const RunSpec& spec,
                                 ConnRun* out) {
  const size_t size = spec.size;
  const int depth = spec.depth;
  Reactor* r = Reactor::Current();
  // write_bw / read_bw: the server's region token first.
  const bool write = spec.test == Test::kWriteBw;
  transport::RemoteRegion remote;
  {
    auto m = co_await c->conn->Recv();
    if (!m.ok()) co_return m.status();
    auto token = transport::RemoteRegion::Decode(m->data());
    if (!token.ok()) co_return token.status();
    remote = *token;
  }
  std::vector<uint64_t> last_tag(depth, ~uint64_t{0});
  Window w(depth);
  out->start = Clock::now();
  for (uint64_t i = 0; i < spec.iters; ++i) {
    auto slot = co_await TakeSlot(&w);
    if (!slot.ok()) break;
    transport::LocalBuffer lb = Slot(c, *slot, size);
    // Writes go to the remote slot of the local one, so no two writes in
    // flight target the same bytes; reads cycle over the server's slots.
    const uint32_t rslot = write ? *slot : static_cast<uint32_t>(i % depth);
    if (spec.verify) {
      std::span<std::byte> b(static_cast<std::byte*>(lb.addr), size);
      if (write) {
        FillPattern(b, i);
        last_tag[*slot] = i;
      } else {
        std::memset(b.data(), 0, size);
      }
    }
    r->Spawn(OneSided(c, &w, *slot, lb, remote.Slice(rslot * size, size), write,
                      rslot, spec.verify, out),
             spec.stop);
  }
  co_await Drain(&w);
  out->end = Clock::now();
  std::vector<std::byte> done(write ? depth * sizeof(uint64_t) : 0);
  if (write) std::memcpy(done.data(), last_tag.data(), done.size());
  absl::Status s = co_await c->conn->Send(done);
  if (!s.ok()) co_return s;
  co_return co_await ReadReply(c, out);
}

Task<absl::Status> ServeOneSided(cm::Connection* conn, const Params& p,
                                 Reply* rep) {
  const Test test = static_cast<Test>(p.test);
  const bool write = test == Test::kWriteBw;
  const size_t bytes = std::max<uint64_t>(p.size * p.slots, 1);
  std::vector<std::byte> mem(bytes);
  if (!write) {
    for (uint32_t k = 0; k < p.slots; ++k) {
      FillPattern(std::span(mem).subspan(k * p.size, p.size), k);
    }
  }
  const int access = IBV_ACCESS_LOCAL_WRITE |
                     (write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
  auto mr = conn->worker().pd().Register(mem.data(), mem.size(), access);
  if (!mr.ok()) co_return mr.status();
  const int remote = write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
  auto token = conn->Expose(*mr, remote);
  if (token.status().code() == absl::StatusCode::kFailedPrecondition) {
    // No memory windows (siw): the bench's one client may have the
    // region's PD-wide key.
    token = conn->Expose(*mr, remote, 0, transport::MemoryRegion::npos,
                         cm::ExposeScope::kProtectionDomain);
  }
  if (!token.ok()) co_return token.status();
  auto enc = token->Encode();
  absl::Status s = co_await conn->Send(enc);
  if (!s.ok()) co_return s;
  // The client's "done": for write_bw the tag last written to each slot.
  auto done = co_await conn->Recv();
  if (!done.ok()) co_return done.status();
  // Revoke before checking: no write can land while we look.
  conn->Revoke(*token).IgnoreError();
  mr->Deregister();
  if (write && p.verify) {
    if (done->size() != p.slots * sizeof(uint64_t)) {
      co_return absl::InvalidArgumentError("bad write_bw done message");
    }
    for (uint32_t k = 0; k < p.slots; ++k) {
      uint64_t tag;
      std::memcpy(&tag, done->data().data() + k * 8, 8);
      if (tag == ~uint64_t{0}) continue;  // never written
      if (int64_t at =
              FirstMismatch(std::span(mem).subspan(k * p.size, p.size), tag);
          at >= 0) {
        Mismatch(rep, absl::StrFormat("slot %d (write %d): byte %d differs", k,
                                      tag, at));
      }
    }
  }
  co_return absl::OkStatus();
}

}  // namespace coverbs::bench
