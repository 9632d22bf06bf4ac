#include "transport/connector.h"

#include <bit>
#include <cstring>

namespace coverbs::transport {

static_assert(std::endian::native == std::endian::little,
              "the reject payload is little endian; add byte swaps");

std::string EncodeReject(std::string_view reason) {
  if (reason.size() > kMaxRejectReason) {
    reason = reason.substr(0, kMaxRejectReason);
  }
  std::string out(6 + reason.size(), '\0');
  const uint32_t magic = kRejectMagic;
  const uint16_t len = static_cast<uint16_t>(reason.size());
  std::memcpy(out.data(), &magic, 4);
  std::memcpy(out.data() + 4, &len, 2);
  std::memcpy(out.data() + 6, reason.data(), reason.size());
  return out;
}

std::string DecodeReject(std::span<const std::byte> d) {
  uint32_t magic = 0;
  uint16_t n = 0;
  if (d.size() < 6) return "";
  std::memcpy(&magic, d.data(), 4);
  std::memcpy(&n, d.data() + 4, 2);
  if (magic != kRejectMagic || n > kMaxRejectReason || d.size() < 6u + n) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(d.data()) + 6, n);
}

}  // namespace coverbs::transport
