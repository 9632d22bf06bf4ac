#include "bench/driver.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace coverbs::bench {

std::atomic<uint64_t> g_progress_ops{0};

Task<absl::Status> EnsureMemory(ClientConn* c, size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  if (c->mem.size() >= bytes && c->mr.valid()) co_return absl::OkStatus();
  c->mr.Deregister();
  c->mem.assign(bytes, std::byte{0});
  auto mr = c->ctx->pd().Register(c->mem.data(), c->mem.size(),
                                  IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) co_return mr.status();
  c->mr = std::move(*mr);
  co_return absl::OkStatus();
}

transport::LocalBuffer Slot(ClientConn* c, int slot, size_t size) {
  transport::LocalBuffer lb = c->mr.Local();
  lb.addr = c->mem.data() + slot * size;
  lb.length = size;
  return lb;
}

Task<absl::Status> SendParams(ClientConn* c, const Params& p) {
  co_return co_await c->conn->Send(AsBytes(p));
}

Task<absl::Status> ReadReply(ClientConn* c, ConnRun* out, Reply* rep_out) {
  auto m = co_await c->conn->Recv();
  if (!m.ok()) co_return m.status();
  Reply rep;
  if (m->size() != sizeof(rep))
    co_return absl::DataLossError("bad reply from the server");
  std::memcpy(&rep, m->data().data(), sizeof(rep));
  if (rep.magic != kMagic) co_return absl::DataLossError("bad reply magic");
  rep.error[sizeof(rep.error) - 1] = '\0';
  if (!rep.ok) {
    co_return absl::InternalError(absl::StrCat("server: ", rep.error));
  }
  if (rep.mismatches > 0) {
    out->mismatches += rep.mismatches;
    if (out->first_error.empty())
      out->first_error = absl::StrCat("server: ", rep.error);
  }
  if (rep_out != nullptr) *rep_out = rep;
  co_return absl::OkStatus();
}

namespace {
Task<void> WaitChildren(Window* w) { (void)co_await w->wg.Wait(); }
}  // namespace

Task<void> Drain(Window* w) {
  Task<void> t = WaitChildren(w);
  t.SetStopToken({});
  co_await std::move(t);
}

Task<absl::StatusOr<int>> TakeSlot(Window* w) {
  absl::Status s = co_await w->sem.Acquire();
  if (!s.ok()) co_return s;
  int slot = w->free_slots.back();
  w->free_slots.pop_back();
  w->wg.Add(1);
  co_return slot;
}

}  // namespace coverbs::bench
