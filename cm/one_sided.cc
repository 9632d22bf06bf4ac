// One-sided access: regions exposed as tokens (each a memory window bound
// to the connection's QP, or by explicit choice the region's PD-wide rkey),
// RDMA READ / WRITE and 8-byte atomics straight to the QP.

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
  if (detached_) co_return DownError(op);  // the Worker is gone
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
  if (detached_) co_return DownError(op);  // the Worker is gone
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

absl::StatusOr<RemoteRegion> ConnectionImpl::ExposeWindow(
    const MemoryRegion& mr, int access, size_t offset, size_t length) {
  if (detached_) return DownError("expose");  // the Worker is gone
  const transport::DeviceCaps& caps = qp_->caps();
  if (!caps.memory_windows) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "expose on %s: device %s has no type-2 memory windows, so it cannot "
        "limit a key to one connection (a region's rkey is valid from every "
        "QP of its protection domain); pass ExposeScope::kProtectionDomain "
        "to hand out the region's own rkey, usable from every connection of "
        "this Worker",
        name_, caps.device_name));
  }
  if (!status_.ok() || closing_) {
    return absl::Status(
        status_.ok() ? absl::StatusCode::kUnavailable : status_.code(),
        absl::StrCat("expose on ", name_, ": ",
                     status_.ok() ? "closing" : status_.message()));
  }
  length = std::min(length, mr.length() - offset);
  if (length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expose on ", name_, ": an empty range"));
  }
  const bool too_many = options_.max_exposures != 0 &&
                        exposures_.size() >= options_.max_exposures;
  if (too_many || (options_.max_exposed_bytes != 0 &&
                   exposed_bytes_ + length > options_.max_exposed_bytes)) {
    ++stats_.exposures_refused;
    SharedOf(ctx_).exposures_refused.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        too_many
            ? absl::StrFormat(
                  "expose on %s: %d exposures live, the most this connection "
                  "may hold (ConnectionOptions::max_exposures); revoke one "
                  "first",
                  name_, exposures_.size())
            : absl::StrFormat(
                  "expose on %s: %d bytes exposed and %d more would pass "
                  "ConnectionOptions::max_exposed_bytes (%d); revoke one "
                  "first",
                  name_, exposed_bytes_, length,
                  options_.max_exposed_bytes));
  }
  constexpr int kWrites = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  if ((access & kWrites) != 0 && (mr.access() & IBV_ACCESS_LOCAL_WRITE) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: remote write or atomic access needs the region "
        "registered with IBV_ACCESS_LOCAL_WRITE (it has 0x%x)",
        name_, mr.access()));
  }
  // A registration of the exposed range that only windows can reach
  // remotely (the caller's may carry remote access of its own, or no
  // MW_BIND): what the window binds to, and what Revoke drops with it.
  auto e = std::make_unique<Exposure>();
  std::byte* base = static_cast<std::byte*>(mr.addr()) + offset;
  auto reg = ctx_.pd().Register(
      base, length,
      IBV_ACCESS_MW_BIND | (mr.access() & IBV_ACCESS_LOCAL_WRITE));
  if (!reg.ok()) {
    return absl::Status(reg.status().code(),
                        absl::StrCat("expose on ", name_,
                                     ": registering the range for a window: ",
                                     reg.status().message()));
  }
  e->mr = *std::move(reg);
  auto window = ctx_.pd().AllocateWindow();
  if (!window.ok()) {
    return absl::Status(
        window.status().code(),
        absl::StrCat("expose on ", name_, ": ", window.status().message()));
  }
  e->window = *std::move(window);
  auto rkey = qp_->PostBind(e->window, e->mr, {base, length}, access);
  if (!rkey.ok()) {
    return absl::Status(
        rkey.status().code(),
        absl::StrCat("expose on ", name_, ": ", rkey.status().message()));
  }
  e->rkey = *rkey;
  e->bytes = length;
  exposed_bytes_ += length;
  exposures_.push_back(std::move(e));
  return RemoteRegion{reinterpret_cast<uint64_t>(base), length, *rkey};
}

absl::Status ConnectionImpl::Revoke(const RemoteRegion& token) {
  for (auto it = exposures_.begin(); it != exposures_.end(); ++it) {
    if ((*it)->rkey == token.rkey) {
      // Deallocating the window ends it (soft and verbs alike); its
      // registration goes after it, then what its owner kept.
      exposed_bytes_ -= (*it)->bytes;
      exposures_.erase(it);
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrFormat(
      "revoke on %s: rkey 0x%x is no exposure of this connection", name_,
      token.rkey));
}

}  // namespace internal

absl::StatusOr<transport::RemoteRegion> Connection::Expose(
    const transport::MemoryRegion& mr, int access, size_t offset, size_t length,
    ExposeScope scope) {
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
  if (offset > mr.length()) {
    return absl::OutOfRangeError(
        absl::StrCat("expose on ", name(), ": offset beyond the region"));
  }
  if (scope == ExposeScope::kConnection) {
    return impl_->ExposeWindow(mr, access, offset, length);
  }
  if ((mr.access() & access) != access) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: the region was registered with access 0x%x, which "
        "lacks 0x%x (a PD-wide exposure is the region's own rkey)",
        name(), mr.access(), access & ~mr.access()));
  }
  return mr.Remote(offset, length);
}

absl::StatusOr<transport::RemoteRegion> Connection::ExposeOwned(
    std::shared_ptr<void> owner, const transport::MemoryRegion& mr,
    transport::Access access) {
  auto token = Expose(mr, access);
  if (!token.ok()) return token;
  impl_->KeepWithExposure(token->rkey, std::move(owner));
  return token;
}

absl::StatusOr<transport::RemoteRegion> Connection::Expose(
    const transport::MemoryRegion& mr) {
  constexpr int kRemote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_ATOMIC;
  if (mr.valid() && (mr.access() & kRemote) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "expose on %s: the region was registered with access 0x%x, without "
        "any IBV_ACCESS_REMOTE_* flag: say which access to give "
        "(Expose(mr, access))",
        name(), mr.access()));
  }
  return Expose(mr, mr.access() & kRemote);
}

absl::Status Connection::Revoke(const transport::RemoteRegion& token) {
  return impl_->Revoke(token);
}

}  // namespace coverbs::cm
