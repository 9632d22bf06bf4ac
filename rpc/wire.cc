#include "rpc/wire.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace coverbs::rpc {
namespace {

using wire_internal::LoadLE;
uint16_t Get16(const std::byte* p) { return LoadLE<uint16_t>(p); }
uint32_t Get32(const std::byte* p) { return LoadLE<uint32_t>(p); }
uint64_t Get64(const std::byte* p) { return LoadLE<uint64_t>(p); }

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
