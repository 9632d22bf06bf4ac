#include "rpc/wire.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace coverbs::rpc {
namespace {

// Little-endian stores/loads: the wire is little endian whatever the host,
// and the bytes need not be aligned. memcpy compiles to one move on a
// little-endian host (byte loops did not: a header cost ~80 instructions
// to encode and ~130 to read).
template <typename T>
T ToWire(T v) {
  if constexpr (std::endian::native == std::endian::big) {
    T r = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xff));
    }
    return r;
  } else {
    return v;
  }
}
template <typename T>
void Put(std::byte* p, T v) {
  v = ToWire(v);
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
T Get(const std::byte* p) {
  return wire_internal::LoadLE<T>(p);
}
void Put16(std::byte* p, uint16_t v) { Put(p, v); }
void Put32(std::byte* p, uint32_t v) { Put(p, v); }
void Put64(std::byte* p, uint64_t v) { Put(p, v); }
uint16_t Get16(const std::byte* p) { return Get<uint16_t>(p); }
uint32_t Get32(const std::byte* p) { return Get<uint32_t>(p); }
uint64_t Get64(const std::byte* p) { return Get<uint64_t>(p); }

constexpr uint32_t kMaxStatusCode = 16;  // absl::StatusCode::kUnauthenticated

bool KnownType(uint8_t t) { return t >= 1 && t <= 4; }

}  // namespace

const char* FrameTypeName(FrameType t) {
  switch (t) {
    case FrameType::kRequest:
      return "request";
    case FrameType::kResponse:
      return "response";
    case FrameType::kError:
      return "error";
    case FrameType::kCancel:
      return "cancel";
  }
  return "unknown";
}

uint32_t MethodId(std::string_view name) {
  uint32_t h = 2166136261u;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;
  }
  return h == 0 ? 1 : h;
}

HeaderBytes EncodeHeader(const FrameHeader& h) {
  HeaderBytes b{};
  Put32(&b[0], kFrameMagic);
  b[4] = static_cast<std::byte>(kWireVersion);
  b[5] = static_cast<std::byte>(h.type);
  Put16(&b[6], h.flags);
  Put64(&b[8], h.call_id);
  Put32(&b[16], h.method_id);
  Put32(&b[20], h.status);
  Put32(&b[24], h.payload_len);
  Put32(&b[28], 0);
  return b;
}

HeaderBytes RequestHeader(uint64_t call_id, uint32_t method_id,
                          uint32_t payload_len) {
  return EncodeHeader({FrameType::kRequest, 0, call_id, method_id, 0,
                       payload_len});
}

HeaderBytes ResponseHeader(uint64_t call_id, uint32_t method_id,
                           uint32_t payload_len) {
  return EncodeHeader({FrameType::kResponse, 0, call_id, method_id, 0,
                       payload_len});
}

HeaderBytes CancelHeader(uint64_t call_id, uint32_t method_id) {
  return EncodeHeader({FrameType::kCancel, 0, call_id, method_id, 0, 0});
}

std::string EncodeError(uint64_t call_id, uint32_t method_id,
                        const absl::Status& status) {
  uint32_t code = static_cast<uint32_t>(status.code());
  if (code == 0 || code > kMaxStatusCode) {
    code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
  }
  absl::string_view msg = status.message();
  if (msg.size() > kMaxErrorMessage) msg = msg.substr(0, kMaxErrorMessage);
  HeaderBytes h = EncodeHeader({FrameType::kError, 0, call_id, method_id, code,
                                static_cast<uint32_t>(msg.size())});
  std::string out(reinterpret_cast<const char*>(h.data()), h.size());
  out.append(msg.data(), msg.size());
  return out;
}

namespace {

// The header's fields, unchecked; `data` holds at least kHeaderSize bytes.
FrameHeader ReadHeader(const std::byte* data) {
  FrameHeader h;
  h.type = static_cast<FrameType>(data[5]);
  h.flags = Get16(&data[6]);
  h.call_id = Get64(&data[8]);
  h.method_id = Get32(&data[16]);
  h.status = Get32(&data[20]);
  h.payload_len = Get32(&data[24]);
  return h;
}

absl::StatusOr<Frame> DecodeFrameSlow(std::span<const std::byte> data,
                                      Side side, const DecodeLimits& limits);

}  // namespace

absl::StatusOr<FrameHeader> PeekHeader(std::span<const std::byte> data) {
  if (data.size() < kHeaderSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated rpc frame: ", data.size(),
                     " bytes, a header needs ", kHeaderSize));
  }
  uint32_t magic = Get32(&data[0]);
  if (magic != kFrameMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "not an rpc frame: magic 0x%08x, expected 0x%08x", magic,
        kFrameMagic));
  }
  return ReadHeader(data.data());
}

absl::StatusOr<Frame> DecodeFrame(std::span<const std::byte> data, Side side,
                                  const DecodeLimits& limits) {
  // The usual frames pass DecodeUsualFrame. Anything else -- error frames,
  // and every malformed frame -- goes through the rules one by one, which
  // also name what is wrong.
  Frame f;
  if (DecodeUsualFrame(data, side, limits, f)) return f;
  return DecodeFrameSlow(data, side, limits);
}

namespace {

absl::StatusOr<Frame> DecodeFrameSlow(std::span<const std::byte> data,
                                      Side side, const DecodeLimits& limits) {
  absl::StatusOr<FrameHeader> peek = PeekHeader(data);
  if (!peek.ok()) return peek.status();
  const FrameHeader& h = *peek;
  uint8_t version = static_cast<uint8_t>(data[4]);
  if (version != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc wire version ", version, " not supported (this end "
                     "speaks version ", kWireVersion, ")"));
  }
  uint8_t type = static_cast<uint8_t>(data[5]);
  if (!KnownType(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown rpc frame type ", type));
  }
  if (h.flags != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rpc frame flags 0x%04x: no flag is defined", h.flags));
  }
  uint32_t reserved = Get32(&data[28]);
  if (reserved != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rpc frame reserved field is 0x%08x, must be 0",
                        reserved));
  }
  const bool server_bound =
      h.type == FrameType::kRequest || h.type == FrameType::kCancel;
  if (server_bound != (side == Side::kServer)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", side == Side::kServer ? "server" : "client",
        " does not accept rpc ", FrameTypeName(h.type), " frames"));
  }
  if (h.payload_len > limits.max_payload) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "rpc ", FrameTypeName(h.type), " for call ", h.call_id, " carries ",
        h.payload_len, " bytes, the limit is ", limits.max_payload));
  }
  if (h.payload_len != data.size() - kHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc ", FrameTypeName(h.type), " for call ", h.call_id,
        ": payload_len ", h.payload_len, " but the message holds ",
        data.size() - kHeaderSize, " payload bytes"));
  }
  const bool connection_error = h.type == FrameType::kError && h.call_id == 0;
  if (h.call_id == 0 && !connection_error) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc ", FrameTypeName(h.type), " with call id 0 (reserved)"));
  }
  if (connection_error && h.method_id != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "connection-level rpc error names method 0x%08x", h.method_id));
  }
  if (server_bound && h.method_id == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc ", FrameTypeName(h.type), " for call ", h.call_id,
        " with method id 0 (reserved)"));
  }
  if (h.type == FrameType::kError) {
    if (h.status == 0 || h.status > kMaxStatusCode) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rpc error for call ", h.call_id, " has status code ", h.status,
          ", expected 1..", kMaxStatusCode));
    }
    if (h.payload_len > kMaxErrorMessage) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rpc error for call ", h.call_id, " has a ", h.payload_len,
          "-byte message, the limit is ", kMaxErrorMessage));
    }
  } else if (h.status != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc ", FrameTypeName(h.type), " for call ", h.call_id,
        " has status code ", h.status, ", must be 0"));
  }
  if (h.type == FrameType::kCancel && h.payload_len != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rpc cancel for call ", h.call_id, " carries ", h.payload_len,
        " payload bytes, must be 0"));
  }
  return Frame{h, data.subspan(kHeaderSize)};
}

}  // namespace

absl::Status StatusFromErrorFrame(const Frame& f) {
  std::string msg(reinterpret_cast<const char*>(f.payload.data()),
                  f.payload.size());
  return absl::Status(static_cast<absl::StatusCode>(f.header.status), msg);
}

}  // namespace coverbs::rpc
