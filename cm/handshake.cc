#include "cm/handshake.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cm/wire.h"

namespace coverbs::cm {
namespace {

template <typename T>
void Put(std::string& out, size_t off, T v) {
  std::memcpy(out.data() + off, &v, sizeof(T));
}
template <typename T>
T Get(std::span<const std::byte> d, size_t off) {
  T v;
  std::memcpy(&v, d.data() + off, sizeof(T));
  return v;
}

}  // namespace

absl::StatusOr<std::string> EncodeHandshake(const Handshake& h) {
  if (h.app_data.size() > kMaxAppData) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: %d bytes of application data exceed the %d that fit in "
        "the connection's private data",
        h.app_data.size(), kMaxAppData));
  }
  std::string out(kHandshakeSize + h.app_data.size(), '\0');
  Put<uint32_t>(out, 0, kHandshakeMagic);
  Put<uint16_t>(out, 4, h.version);
  Put<uint16_t>(out, 6, static_cast<uint16_t>(h.app_data.size()));
  Put<uint32_t>(out, 8, h.caps);
  Put<uint32_t>(out, 12, h.credits);
  Put<uint32_t>(out, 16, h.recv_buffer_size);
  Put<uint32_t>(out, 20, h.max_credits != 0 ? h.max_credits : h.credits);
  Put<uint64_t>(out, 24, h.max_message_size);
  std::memcpy(out.data() + kHandshakeSize, h.app_data.data(),
              h.app_data.size());
  return out;
}

absl::StatusOr<Handshake> DecodeHandshake(std::span<const std::byte> d) {
  if (d.size() < 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: %d bytes of private data, not a coverbs peer", d.size()));
  }
  uint32_t magic = Get<uint32_t>(d, 0);
  if (magic != kHandshakeMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: bad magic 0x%08x (expected 0x%08x), not a coverbs peer",
        magic, kHandshakeMagic));
  }
  Handshake h;
  h.version = Get<uint16_t>(d, 4);
  if (h.version != kProtocolVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("protocol version mismatch: peer speaks %d, local %d",
                        h.version, kProtocolVersion));
  }
  if (d.size() < kHandshakeSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: truncated (%d bytes, need %d)", d.size(), kHandshakeSize));
  }
  uint16_t app_len = Get<uint16_t>(d, 6);
  // Transports may pad private data (IB rounds it up): extra bytes are
  // allowed, missing ones are not.
  if (app_len > kMaxAppData || d.size() < kHandshakeSize + app_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: application data length %d does not fit (%d bytes)",
        app_len, d.size()));
  }
  h.caps = Get<uint32_t>(d, 8);
  h.credits = Get<uint32_t>(d, 12);
  h.recv_buffer_size = Get<uint32_t>(d, 16);
  h.max_credits = Get<uint32_t>(d, 20);
  h.max_message_size = Get<uint64_t>(d, 24);
  if (h.credits == 0 || h.credits > kMaxHandshakeCredits) {
    return absl::InvalidArgumentError(
        absl::StrFormat("handshake: %d receive credits, outside [1, %d]",
                        h.credits, kMaxHandshakeCredits));
  }
  if (h.max_credits < h.credits || h.max_credits > kMaxHandshakeCredits) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: at most %d credits, but %d granted (max_credits must be "
        "in [credits, %d])",
        h.max_credits, h.credits, kMaxHandshakeCredits));
  }
  if (h.recv_buffer_size <= internal::kHeaderSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "handshake: receive buffers of %d bytes do not hold the %d-byte "
        "message header",
        h.recv_buffer_size, internal::kHeaderSize));
  }
  h.recv_buffer_size = std::min(h.recv_buffer_size, kMaxUsedRecvBufferSize);
  if (h.max_message_size == 0 ||
      h.max_message_size > kMaxHandshakeMessageSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("handshake: max message size %d, outside [1, %d]",
                        h.max_message_size, kMaxHandshakeMessageSize));
  }
  if ((h.caps & ~kKnownCaps) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("handshake: unknown capability bits 0x%x (known: 0x%x)",
                        h.caps & ~kKnownCaps, kKnownCaps));
  }
  h.app_data.assign(reinterpret_cast<const char*>(d.data()) + kHandshakeSize,
                    app_len);
  return h;
}

}  // namespace coverbs::cm
