// The RPC wire format: one frame per connection message (see rpc/README.md).
//
// Pure functions, no dependency on the connection layer, so the decoder can be
// unit tested and fuzzed on its own. Every field read from the wire is
// validated here; the server and client act only on frames DecodeFrame
// accepted.
//
// Frame = 32-byte header (little endian) + payload:
//    0  u32 magic        kFrameMagic ("CVRP")
//    4  u8  version      kWireVersion
//    5  u8  type         FrameType
//    6  u16 flags        no flag is defined yet: must be 0
//    8  u64 call_id      chosen by the client, != 0 (0 = the connection)
//   16  u32 method_id    MethodId(name) in requests and cancels, the
//                        request's id echoed in responses and errors, 0 in
//                        a connection-level error
//   20  u32 status       absl::StatusCode (1..16) in errors, else 0
//   24  u32 payload_len  == message size - 32 exactly
//   28  u32 reserved     must be 0
#ifndef COVERBS_RPC_WIRE_H_
#define COVERBS_RPC_WIRE_H_

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace coverbs::rpc {

inline constexpr uint32_t kFrameMagic = 0x50525643;  // "CVRP"
inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kHeaderSize = 32;
// An error frame's message is truncated to this many bytes when encoded and
// rejected above it when decoded.
inline constexpr size_t kMaxErrorMessage = 4096;

enum class FrameType : uint8_t {
  kRequest = 1,   // client -> server: call `method_id` with the payload
  kResponse = 2,  // server -> client: the call succeeded, payload = result
  kError = 3,     // server -> client: the call (or, call_id 0, the
                  // connection) failed; payload = the status message
  kCancel = 4,    // client -> server: the caller gave up on call_id
};
const char* FrameTypeName(FrameType t);

// Which end decodes: a server accepts requests and cancels, a client accepts
// responses and errors. A frame of the other kind is a protocol error.
enum class Side : uint8_t { kServer, kClient };

struct FrameHeader {
  FrameType type = FrameType::kRequest;
  uint16_t flags = 0;
  uint64_t call_id = 0;
  uint32_t method_id = 0;
  uint32_t status = 0;  // absl::StatusCode as an integer
  uint32_t payload_len = 0;
};

struct Frame {
  FrameHeader header;
  // A view into the decoded message: valid while that message lives.
  std::span<const std::byte> payload;
};

struct DecodeLimits {
  // Largest request (server) / response (client) payload accepted.
  uint64_t max_payload = (64ull << 20) - kHeaderSize;
};

// The method id of `name`: 32-bit FNV-1a of the UTF-8 bytes, with 0 (which
// would mean "no method") mapped to 1. Both ends compute it; the server
// refuses to register two names with the same id.
uint32_t MethodId(std::string_view name);

namespace wire_internal {
// Little-endian fields at any alignment: the wire is little endian
// whatever the host. memcpy compiles to one move on a little-endian host
// (byte loops did not: a header cost ~80 instructions to encode and ~130
// to read).
template <typename T>
T LoadLE(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) {
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xff));
    }
    return r;
  }
  return v;
}
template <typename T>
void StoreLE(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::big) {
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xff));
    }
    v = r;
  }
  std::memcpy(p, &v, sizeof v);
}
}  // namespace wire_internal

using HeaderBytes = std::array<std::byte, kHeaderSize>;
// Encodes `h` (flags and reserved are written as 0 unless set in h.flags).
// Inline, as the builders below: a request and a response per call, each
// a call of its own otherwise.
inline HeaderBytes EncodeHeader(const FrameHeader& h) {
  using wire_internal::StoreLE;
  HeaderBytes b;
  StoreLE<uint32_t>(&b[0], kFrameMagic);
  b[4] = static_cast<std::byte>(kWireVersion);
  b[5] = static_cast<std::byte>(h.type);
  StoreLE<uint16_t>(&b[6], h.flags);
  StoreLE<uint64_t>(&b[8], h.call_id);
  StoreLE<uint32_t>(&b[16], h.method_id);
  StoreLE<uint32_t>(&b[20], h.status);
  StoreLE<uint32_t>(&b[24], h.payload_len);
  StoreLE<uint32_t>(&b[28], 0);
  return b;
}

// Builders for the fixed-shape frames.
inline HeaderBytes RequestHeader(uint64_t call_id, uint32_t method_id,
                                 uint32_t payload_len) {
  return EncodeHeader(
      {FrameType::kRequest, 0, call_id, method_id, 0, payload_len});
}
inline HeaderBytes ResponseHeader(uint64_t call_id, uint32_t method_id,
                                  uint32_t payload_len) {
  return EncodeHeader(
      {FrameType::kResponse, 0, call_id, method_id, 0, payload_len});
}
inline HeaderBytes CancelHeader(uint64_t call_id, uint32_t method_id) {
  return EncodeHeader({FrameType::kCancel, 0, call_id, method_id, 0, 0});
}
// A whole error frame (header + message, truncated to kMaxErrorMessage).
// `status` must not be OK (an OK status is sent as UNKNOWN: a handler error
// must never read as success).
std::string EncodeError(uint64_t call_id, uint32_t method_id,
                        const absl::Status& status);

// The fields of a header without validating anything but its length; for
// answering a frame that failed validation with the call id it carried.
// Fails if `data` is shorter than a header or the magic is wrong.
absl::StatusOr<FrameHeader> PeekHeader(std::span<const std::byte> data);

// DecodeFrame's first step, inline: the frames every call brings (a
// request or a cancel on the server, a response on the client) are read
// once and accepted by a few comparisons, with no StatusOr built and no
// call made (~15 instructions less per message). True: `out` is that
// frame. False: the frame is not one of those, or is bad -- DecodeFrame
// says which.
inline bool DecodeUsualFrame(std::span<const std::byte> data, Side side,
                             const DecodeLimits& limits, Frame& out) {
  using wire_internal::LoadLE;
  if (data.size() < kHeaderSize) return false;
  const std::byte* d = data.data();
  FrameHeader& h = out.header;
  h.type = static_cast<FrameType>(d[5]);
  h.flags = LoadLE<uint16_t>(d + 6);
  h.call_id = LoadLE<uint64_t>(d + 8);
  h.method_id = LoadLE<uint32_t>(d + 16);
  h.status = LoadLE<uint32_t>(d + 20);
  h.payload_len = LoadLE<uint32_t>(d + 24);
  const size_t payload = data.size() - kHeaderSize;
  bool ok = LoadLE<uint32_t>(d) == kFrameMagic &&
            static_cast<uint8_t>(d[4]) == kWireVersion && h.flags == 0 &&
            LoadLE<uint32_t>(d + 28) == 0 && h.call_id != 0 && h.status == 0 &&
            h.payload_len == payload && h.payload_len <= limits.max_payload;
  if (ok && side == Side::kServer) {
    ok = h.method_id != 0 &&
         (h.type == FrameType::kRequest ||
          (h.type == FrameType::kCancel && h.payload_len == 0));
  } else if (ok) {
    ok = h.type == FrameType::kResponse;
  }
  if (ok) out.payload = data.subspan(kHeaderSize);
  return ok;
}

// Decodes and validates one frame as received by `side`. Errors:
//  - InvalidArgument: truncated (shorter than a header), bad magic, unknown
//    version/type/flags, reserved bits set, payload_len not matching the
//    message size, a frame type `side` must not receive, call_id 0 outside a
//    connection-level error, method_id 0 in a request/cancel, a status in a
//    non-error frame, an error frame with status OK or out of range, a cancel
//    with a payload, an error message longer than kMaxErrorMessage;
//  - ResourceExhausted: payload_len above limits.max_payload.
// Every message names the offending field and its value.
absl::StatusOr<Frame> DecodeFrame(std::span<const std::byte> data, Side side,
                                  const DecodeLimits& limits = {});

// The status an error frame carries (code + message).
absl::Status StatusFromErrorFrame(const Frame& f);

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_WIRE_H_
