// Internal: the framing of messages on a connection (see README.md,
// "Messaging"). Little endian; every field is validated on receipt.
#ifndef COVERBS_CM_WIRE_H_
#define COVERBS_CM_WIRE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace coverbs::cm::internal {

enum MsgType : uint8_t {
  kData = 1,     // eager payload follows the header
  kCredit = 2,   // credits only; uses the reserve receives, never a credit
  kRts = 3,      // rendezvous request: length = message size, cookie = id
  kCts = 4,      // rendezvous grant: CtsPayload, cookie echoed
  kDone = 5,     // rendezvous data written (or aborted: kFlagAborted)
  kHello = 6,    // the active side's first message (protocol 4)
  kGoodbye = 7,  // orderly close: no more messages follow
  // A medium message written by RDMA WRITE into a landing buffer the
  // receiver granted ahead of time (protocol 5): length = message size,
  // cookie = the grant's sequence number; since protocol 7 the message's
  // last length % 4096 bytes may follow the header instead (one packet
  // fewer). Posted right after its WRITE, so RC ordering places the data
  // first; spends a credit like kData.
  kLanded = 8,
};
inline constexpr uint8_t kMaxMsgType = kLanded;

inline constexpr uint8_t kFlagRefused = 1;  // kCts: no buffer for this size
inline constexpr uint8_t kFlagAborted = 2;  // kDone: the sender gave up
// Any credit-spending message: it spent the sender's last credit (protocol
// version 3). A receiver lending credits from a shared receive queue grows
// that sender's window; one without an SRQ ignores it.
inline constexpr uint8_t kFlagCreditLow = 4;
// kCredit: a keepalive probe (ConnectionOptions::keepalive_interval); the
// receiver answers with a kCredit at once (protocol version 4).
inline constexpr uint8_t kFlagPing = 8;
inline constexpr uint8_t kKnownFlags =
    kFlagRefused | kFlagAborted | kFlagCreditLow | kFlagPing;

struct WireHeader {
  uint8_t type;
  uint8_t flags;
  uint16_t credits;      // receives reposted since the last header
  uint32_t length;       // payload (kData) or message size (kRts)
  uint32_t credit_acks;  // kCredit messages received so far (wrapping)
  uint32_t cookie;       // rendezvous id
};
inline constexpr size_t kHeaderSize = 16;
static_assert(sizeof(WireHeader) == kHeaderSize);

struct CtsPayload {
  uint64_t addr;
  uint32_t rkey;
  uint32_t reserved;
};
inline constexpr size_t kCtsSize = 16;
static_assert(sizeof(CtsPayload) == kCtsSize);

// Landing grants (protocol 5) travel as the payload of kCredit messages:
// a buffer of `size` bytes at `addr`, writable with `rkey` for one message
// only (its registration ends when the kLanded naming it arrives). The
// sender uses grants in the order they came; the i-th grant ever sent on a
// connection has sequence number i (wrapping).
struct GrantPayload {
  uint64_t addr;
  uint32_t rkey;
  uint32_t size;  // bytes, and kGrantInvalidate
};
// The grant's rkey is a memory window bound for this message: the kLanded
// header must travel as SEND_WITH_INV naming it, which ends the window
// before the receiver sees the header (protocol version 6).
inline constexpr uint32_t kGrantInvalidate = 1u << 31;
inline uint32_t GrantBytes(const GrantPayload& g) {
  return g.size & ~kGrantInvalidate;
}
inline constexpr size_t kGrantSize = 16;
static_assert(sizeof(GrantPayload) == kGrantSize);
// Grants in one credit message, and grants a sender keeps unused: a peer
// that sends more breaks the protocol (bounded memory for hostile peers).
inline constexpr uint32_t kMaxGrantsPerMessage = 32;
inline constexpr uint32_t kMaxGrantsHeld = 256;

// Receives posted beyond the credits, for credit messages.
inline constexpr uint32_t kCreditReserve = 2;
// Receives posted beyond the credits for the CTS answers to our own RTS
// messages; a side never has more than kCtsReserve RTS waiting for their
// CTS, so the peer sends CTS without credits (protocol version 2). A CTS
// that needed a credit could deadlock when every credit is held by eager
// messages the application has not read yet, on both sides at once.
inline constexpr uint32_t kCtsReserve = 4;
inline constexpr uint64_t kMaxWireLength = 0xffffffffull;

// A data message's announced length against what it carries and the
// receive buffer.
inline bool DataLengthOk(const WireHeader& h, uint32_t payload,
                         size_t slot_size) {
  return h.length == payload && h.length <= slot_size - kHeaderSize;
}

// ValidateHeader's verdict for a data message, as a bool: what the receive
// path checks first (nearly every message is one, and a Status per message
// cost ~40 instructions); anything it refuses goes through ValidateHeader,
// which accepts or says what is wrong.
inline bool IsValidDataHeader(const WireHeader& h, uint32_t byte_len,
                              size_t slot_size) {
  return h.type == kData &&
         DataLengthOk(h, byte_len - static_cast<uint32_t>(kHeaderSize),
                      slot_size) &&
         (h.flags & ~kKnownFlags) == 0;
}

// Checks a received header against the completion's byte count and the
// receive buffer size. The message names what is wrong.
inline absl::Status ValidateHeader(const WireHeader& h, uint32_t byte_len,
                                   size_t slot_size) {
  if (h.type == 0 || h.type > kMaxMsgType) {
    return absl::DataLossError(
        absl::StrFormat("unknown message type %d", h.type));
  }
  uint32_t payload = byte_len - static_cast<uint32_t>(kHeaderSize);
  switch (h.type) {
    case kData:
      if (!DataLengthOk(h, payload, slot_size)) {
        return absl::DataLossError(
            absl::StrFormat("data message announces %d bytes but carries %d",
                            h.length, payload));
      }
      break;
    case kRts:
      if (payload != 0 || h.length == 0) {
        return absl::DataLossError(absl::StrFormat(
            "malformed rendezvous request (size %d, %d extra bytes)", h.length,
            payload));
      }
      break;
    case kCts:
      if (payload != kCtsSize || h.length != kCtsSize) {
        return absl::DataLossError(
            absl::StrFormat("malformed rendezvous grant (%d bytes)", payload));
      }
      break;
    case kCredit:
      if (h.length != payload || payload % kGrantSize != 0 ||
          payload / kGrantSize > kMaxGrantsPerMessage) {
        return absl::DataLossError(absl::StrFormat(
            "malformed credit message (%d bytes, %d announced)", payload,
            h.length));
      }
      break;
    case kLanded:
      // Protocol 7: the message's last bytes may follow the header.
      if (payload >= h.length) {
        return absl::DataLossError(absl::StrFormat(
            "malformed landed message (size %d, %d extra bytes)", h.length,
            payload));
      }
      break;
    default:
      if (payload != 0 || h.length != 0) {
        return absl::DataLossError(absl::StrFormat(
            "control message type %d carries %d unexpected bytes", h.type,
            payload));
      }
  }
  if (h.flags & ~kKnownFlags) {
    return absl::DataLossError(absl::StrFormat("unknown flags 0x%x", h.flags));
  }
  return absl::OkStatus();
}

}  // namespace coverbs::cm::internal

#endif  // COVERBS_CM_WIRE_H_
