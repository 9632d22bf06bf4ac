#include "transport/device.h"

#include <poll.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"

namespace coverbs::transport {

std::array<std::byte, RemoteRegion::kEncodedSize> RemoteRegion::Encode()
    const {
  std::array<std::byte, kEncodedSize> out{};
  std::memcpy(out.data(), &addr, 8);
  std::memcpy(out.data() + 8, &length, 8);
  std::memcpy(out.data() + 16, &rkey, 4);
  return out;
}

absl::StatusOr<RemoteRegion> RemoteRegion::Decode(
    std::span<const std::byte> data) {
  if (data.size() != kEncodedSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "remote region: %d bytes, expected %d", data.size(), kEncodedSize));
  }
  RemoteRegion r;
  std::memcpy(&r.addr, data.data(), 8);
  std::memcpy(&r.length, data.data() + 8, 8);
  std::memcpy(&r.rkey, data.data() + 16, 4);
  if (r.length == 0 || r.addr + r.length < r.addr) {
    return absl::InvalidArgumentError(
        "remote region: empty or wrapping range");
  }
  return r;
}

std::string Device::Describe() const {
  if (caps().provider == "soft") return "soft";
  return absl::StrFormat("%s (%s)", caps().provider, name());
}

RemoteRegion RemoteRegion::Slice(uint64_t offset, uint64_t len) const {
  offset = std::min(offset, length);
  len = std::min(len, length - offset);
  return RemoteRegion{addr + offset, len, rkey};
}

LocalBuffer MemoryRegion::Local(size_t offset, size_t len) const {
  offset = std::min(offset, length());
  len = std::min(len, length() - offset);
  return LocalBuffer{static_cast<char*>(addr()) + offset,
                     static_cast<uint32_t>(len), lkey()};
}

RemoteRegion MemoryRegion::Remote(size_t offset, size_t len) const {
  offset = std::min(offset, length());
  len = std::min(len, length() - offset);
  return RemoteRegion{reinterpret_cast<uint64_t>(addr()) + offset, len,
                      rkey()};
}

absl::StatusOr<MemoryRegion> ProtectionDomain::Register(void* addr,
                                                        size_t length,
                                                        int access) {
  if (access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) {
    access |= IBV_ACCESS_LOCAL_WRITE;
  }
  auto mr = pd_->RegisterMemory(addr, length, access);
  if (!mr.ok()) return mr.status();
  return MemoryRegion(*std::move(mr));
}

absl::StatusOr<MemoryWindow> ProtectionDomain::AllocateWindow() {
  if (!device_->caps().memory_windows) {
    return absl::UnimplementedError(absl::StrFormat(
        "memory windows: %s has no type-2 windows", device_->Describe()));
  }
  auto mw = pd_->AllocMw();
  if (!mw.ok()) return mw.status();
  return MemoryWindow(*std::move(mw));
}

absl::StatusOr<std::unique_ptr<Device>> Device::Open(
    const ProviderOptions& options) {
  auto p = OpenProvider(options);
  if (!p.ok()) return p.status();
  return std::make_unique<Device>(*std::move(p));
}

absl::StatusOr<std::unique_ptr<ProtectionDomain>> Device::AllocPd() {
  auto pd = provider_->AllocPd();
  if (!pd.ok()) return pd.status();
  return std::make_unique<ProtectionDomain>(this, *std::move(pd));
}

Task<absl::Status> Device::WatchAsyncEvents(
    Reactor* reactor, std::function<void(const AsyncEvent&)> handler) {
  int fd = provider_->async_fd();
  if (fd < 0) co_return absl::OkStatus();
  for (;;) {
    absl::StatusOr<uint32_t> ready = co_await reactor->WaitFd(fd, POLLIN);
    if (!ready.ok()) {
      if (ready.status().code() == absl::StatusCode::kCancelled) {
        co_return absl::OkStatus();
      }
      co_return ready.status();
    }
    DrainAsyncEvents(handler);
  }
}

void Device::DrainAsyncEvents(
    const std::function<void(const AsyncEvent&)>& handler) {
  if (provider_->async_fd() < 0) return;
  for (;;) {
    absl::StatusOr<AsyncEvent> ev = provider_->GetAsyncEvent();
    if (!ev.ok()) return;  // NotFound: drained
    handler(*ev);
  }
}

}  // namespace coverbs::transport
