// One-sided access: regions exposed as tokens, RDMA READ / WRITE and 8-byte
// atomics straight to the QP.

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cm/connection_impl.h"

namespace coverbs::cm {
namespace internal {

Task<absl::Status> ConnectionImpl::OneSided(bool read, LocalBuffer local,
                                            RemoteRegion r) {
  const char* op = read ? "RDMA READ" : "RDMA WRITE";
  absl::Status s = CheckUp(op);
  if (!s.ok()) co_return s;
  // Not `read ? co_await a : co_await b`: gcc 12 miscompiles co_await in
  // both arms of a conditional (the result was garbage).
  absl::StatusOr<transport::WorkCompletion> wc;
  if (read) {
    wc = co_await qp_->Read(local, r);
  } else {
    wc = co_await qp_->Write(local, r);
  }
  if (!wc.ok()) co_return OpError(op, wc.status());
  co_return absl::OkStatus();
}

Task<absl::StatusOr<uint64_t>> ConnectionImpl::Atomic(bool cas, RemoteRegion r,
                                                      uint64_t a, uint64_t b) {
  const char* op = cas ? "COMPARE_SWAP" : "FETCH_ADD";
  if (!qp_->caps().atomics) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(op, " on ", name_, ": device ", qp_->caps().device_name,
                     " has no atomics"));
  }
  absl::Status s = CheckUp(op);
  if (!s.ok()) co_return s;
  s = co_await atomic_slots_.Acquire(1);
  if (!s.ok()) co_return s;
  uint32_t i = atomic_free_.back();
  atomic_free_.pop_back();
  LocalBuffer res = atomic_mr_.Local(i * sizeof(uint64_t), sizeof(uint64_t));
  absl::StatusOr<transport::WorkCompletion> wc;
  if (cas) {
    wc = co_await qp_->CompareSwap(res, r, a, b);
  } else {
    wc = co_await qp_->FetchAdd(res, r, a);
  }
  uint64_t v = atomic_mem_[i];
  atomic_free_.push_back(i);
  atomic_slots_.Release(1);
  if (!wc.ok()) co_return OpError(op, wc.status());
  co_return v;
}

Task<absl::Status> ConnectionImpl::OneSidedPlain(bool read,
                                                 const std::byte* data,
                                                 size_t length,
                                                 RemoteRegion r) {
  const char* op = read ? "RDMA READ" : "RDMA WRITE";
  if (length == 0) {
    co_return absl::InvalidArgumentError(
        absl::StrCat(op, " on ", name_, ": empty local buffer"));
  }
  // A READ lands in local memory (LOCAL_WRITE); a WRITE's source may be
  // read-only memory, which a LOCAL_WRITE registration would refuse.
  auto mr = ctx_.registrations().Get(data, length,
                                     read ? IBV_ACCESS_LOCAL_WRITE : 0);
  if (!mr.ok()) {
    co_return absl::Status(
        mr.status().code(),
        absl::StrCat(op, " on ", name_,
                     ": registering the local buffer: ", mr.status().message()));
  }
  // Held until the operation completed: eviction from the cache meanwhile
  // defers the deregistration.
  std::shared_ptr<const transport::MemoryRegion> hold = *std::move(mr);
  const size_t offset = static_cast<size_t>(
      data - static_cast<const std::byte*>(hold->addr()));
  auto done = OneSided(read, hold->Local(offset, length), r);
  co_return co_await std::move(done);
}

}  // namespace internal

absl::StatusOr<transport::RemoteRegion> Connection::Expose(
    const transport::MemoryRegion& mr, int access, size_t offset,
    size_t length) {
  constexpr int kRemote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_ATOMIC;
  if (!mr.valid()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expose on ", name(), ": the region is not registered"));
  }
  if ((access & ~kRemote) != 0 || access == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expose on ", name(),
        ": access must be a non-empty set of IBV_ACCESS_REMOTE_* flags"));
  }
  if ((mr.access() & access) != access) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: the region was registered with access 0x%x, which "
        "lacks 0x%x",
        name(), mr.access(), access & ~mr.access()));
  }
  if (offset > mr.length()) {
    return absl::OutOfRangeError(
        absl::StrCat("expose on ", name(), ": offset beyond the region"));
  }
  return mr.Remote(offset, length);
}

absl::StatusOr<transport::RemoteRegion> Connection::Expose(
    const transport::MemoryRegion& mr) {
  constexpr int kRemote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_ATOMIC;
  if (mr.valid() && (mr.access() & kRemote) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: the region was registered with access 0x%x, without "
        "any IBV_ACCESS_REMOTE_* flag: the peer could do nothing with it",
        name(), mr.access()));
  }
  return Expose(mr, mr.access() & kRemote);
}
}  // namespace coverbs::cm
