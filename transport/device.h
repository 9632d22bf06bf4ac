// RAII handles for the verbs objects a user owns: Device, ProtectionDomain,
// MemoryRegion, and the plain values that describe memory to the NIC
// (LocalBuffer) and to the peer (RemoteRegion).
//
// Lifetimes: a Device outlives its ProtectionDomains, which outlive their
// MemoryRegions; a MemoryRegion outlives every operation that uses it (the
// queue pair keeps a buffer owned by an operation until its completion).
#ifndef COVERBS_TRANSPORT_DEVICE_H_
#define COVERBS_TRANSPORT_DEVICE_H_

#include <infiniband/verbs.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "core/task.h"
#include "transport/provider.h"

namespace coverbs::transport {

// Memory the local NIC may access: one scatter/gather element.
struct LocalBuffer {
  void* addr = nullptr;
  uint32_t length = 0;
  uint32_t lkey = 0;
  ibv_sge sge() const {
    return ibv_sge{reinterpret_cast<uint64_t>(addr), length, lkey};
  }
};

// Memory the peer exposed to us: what travels over the wire so that the
// peer's RDMA READ / WRITE / atomics can target it.
struct RemoteRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t rkey = 0;
  // A sub-range; offset/length are clamped to the region.
  RemoteRegion Slice(uint64_t offset, uint64_t len) const;

  // The 20 bytes that travel to the peer (addr, length, rkey; host order:
  // both ends run coverbs on the same architecture). A plain array, ready
  // for Send, no allocation:
  //   co_await conn->Send(region.Encode());
  //   CO_ASSIGN_OR_RETURN(auto remote, RemoteRegion::Decode(msg.data()));
  static constexpr size_t kEncodedSize = 20;
  std::array<std::byte, kEncodedSize> Encode() const;
  // InvalidArgument for a wrong size, an empty or a wrapping range.
  static absl::StatusOr<RemoteRegion> Decode(std::span<const std::byte> data);
};

// Memory access rights of a registration, typed (the values are verbs'
// IBV_ACCESS_* bits, so a raw int still converts both ways).
enum class Access : int {
  kNone = 0,
  kLocalWrite = IBV_ACCESS_LOCAL_WRITE,
  kRemoteWrite = IBV_ACCESS_REMOTE_WRITE,  // implies kLocalWrite
  kRemoteRead = IBV_ACCESS_REMOTE_READ,
  kRemoteAtomic = IBV_ACCESS_REMOTE_ATOMIC,  // implies kLocalWrite
  kMwBind = IBV_ACCESS_MW_BIND,  // memory windows may be bound over it
};
constexpr Access operator|(Access a, Access b) {
  return static_cast<Access>(static_cast<int>(a) | static_cast<int>(b));
}
constexpr bool operator&(Access a, Access b) {
  return (static_cast<int>(a) & static_cast<int>(b)) != 0;
}

// A registered memory region. Move-only; deregisters on destruction or on
// Deregister() -- after which remote accesses with its rkey fail with a
// remote access error on the requester.
class MemoryRegion {
 public:
  MemoryRegion() = default;
  explicit MemoryRegion(std::unique_ptr<ProviderMr> mr) : mr_(std::move(mr)) {}
  MemoryRegion(MemoryRegion&&) = default;
  MemoryRegion& operator=(MemoryRegion&&) = default;

  bool valid() const { return mr_ != nullptr; }
  void* addr() const { return mr_->addr(); }
  size_t length() const { return mr_->length(); }
  uint32_t lkey() const { return mr_->lkey(); }
  uint32_t rkey() const { return mr_->rkey(); }
  int access() const { return mr_->access(); }
  std::span<std::byte> bytes() const {
    return {static_cast<std::byte*>(addr()), length()};
  }

  // [offset, offset+len) as a local SGE; len = npos means "to the end".
  LocalBuffer Local(size_t offset = 0, size_t len = npos) const;
  // The token to hand to the peer for one-sided access.
  RemoteRegion Remote(size_t offset = 0, size_t len = npos) const;

  // Revokes the region now (rkey and lkey become invalid).
  void Deregister() { mr_.reset(); }
  const ProviderMr* provider() const { return mr_.get(); }

  static constexpr size_t npos = static_cast<size_t>(-1);

 private:
  std::unique_ptr<ProviderMr> mr_;
};

// A type-2 memory window (DeviceCaps::memory_windows): remote access to
// part of a region for one transfer. SendBatch::AddBind binds it with a
// fresh rkey; the peer's SEND_WITH_INV naming that rkey ends the bind, and
// the window may be bound again. Move-only; destroying it invalidates it.
// The region it is bound to must stay registered until then.
class MemoryWindow {
 public:
  MemoryWindow() = default;
  explicit MemoryWindow(std::unique_ptr<ProviderMw> mw) : mw_(std::move(mw)) {}
  MemoryWindow(MemoryWindow&&) = default;
  MemoryWindow& operator=(MemoryWindow&&) = default;

  bool valid() const { return mw_ != nullptr; }
  // The rkey of the last bind (prepared by AddBind).
  uint32_t rkey() const { return mw_->rkey(); }
  ProviderMw* provider() const { return mw_.get(); }

 private:
  std::unique_ptr<ProviderMw> mw_;
};

class Device;

class ProtectionDomain {
 public:
  ProtectionDomain(Device* device, std::unique_ptr<ProviderPd> pd)
      : device_(device), pd_(std::move(pd)) {}

  // Registers caller-owned memory. Access flags are explicit
  // (IBV_ACCESS_LOCAL_WRITE, _REMOTE_READ, _REMOTE_WRITE, _REMOTE_ATOMIC);
  // remote write/atomic access implies LOCAL_WRITE (verbs and iWARP require
  // it). Fails with ResourceExhausted naming RLIMIT_MEMLOCK when the
  // locked-memory limit is what stopped it.
  absl::StatusOr<MemoryRegion> Register(void* addr, size_t length, int access);
  absl::StatusOr<MemoryRegion> Register(std::span<std::byte> mem, int access) {
    return Register(mem.data(), mem.size(), access);
  }
  // The same with typed flags (Access::kRemoteRead | Access::kLocalWrite).
  absl::StatusOr<MemoryRegion> Register(std::span<std::byte> mem,
                                        Access access) {
    return Register(mem.data(), mem.size(), static_cast<int>(access));
  }

  // An unbound type-2 memory window; Unimplemented on a device without
  // them (DeviceCaps::memory_windows).
  absl::StatusOr<MemoryWindow> AllocateWindow();

  Device* device() const { return device_; }
  ProviderPd* provider() const { return pd_.get(); }

 private:
  Device* device_;
  std::unique_ptr<ProviderPd> pd_;
};

class Device {
 public:
  // Opens the provider selected by `options` (see transport/provider.h).
  static absl::StatusOr<std::unique_ptr<Device>> Open(
      const ProviderOptions& options = {});
  explicit Device(std::unique_ptr<Provider> p) : provider_(std::move(p)) {}

  const DeviceCaps& caps() const { return provider_->caps(); }
  const std::string& name() const { return provider_->caps().device_name; }
  // For logs and reports: "soft", or the provider and device ("verbs
  // (rxe0)").
  std::string Describe() const;
  Provider* provider() const { return provider_.get(); }

  absl::StatusOr<std::unique_ptr<ProtectionDomain>> AllocPd();

  // Watches asynchronous device events (QP fatal, port change, device fatal,
  // CQ error) on `reactor` and hands each, decoded, to `handler` on that
  // reactor's thread, until `stop` is requested. Completes immediately if
  // the provider has no async event fd.
  Task<absl::Status> WatchAsyncEvents(
      Reactor* reactor, std::function<void(const AsyncEvent&)> handler);

  // The asynchronous events pending now, without waiting: each is handed to
  // `handler` on the calling thread (any thread). Events go to one reader:
  // whoever reads one (this or WatchAsyncEvents) consumes it.
  void DrainAsyncEvents(const std::function<void(const AsyncEvent&)>& handler);
  // The fd readable while events are pending; -1 if the provider has none.
  int async_event_fd() const { return provider_->async_fd(); }

 private:
  std::unique_ptr<Provider> provider_;
};

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_DEVICE_H_
