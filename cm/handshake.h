// The connection handshake carried in rdma_cm private data (verbs) or in the
// soft provider's TCP connection setup (soft): both sides announce what they
// can receive before the first message flows.
//
// Wire layout (little endian), kHandshakeSize bytes, then up to
// kMaxAppData bytes of application data:
//   0  u32 magic            kHandshakeMagic ("CVB1")
//   4  u16 version          kProtocolVersion
//   6  u16 app_data_len
//   8  u32 caps             Capability bits
//  12  u32 credits          credits granted at the start (receives posted for
//                           this connection, or reserved for it in an SRQ)
//  16  u32 recv_buffer_size bytes per posted receive (header included)
//  20  u32 max_credits      most credits the peer may ever hold at once
//                           (>= credits; above credits only with an SRQ,
//                           whose receiver lends more to a busy sender)
//  24  u64 max_message_size largest message the sender accepts
//  32  app data
// IB limits connect private data to 56 bytes, hence kMaxAppData = 24.
//
// A reject carries a reason (transport::EncodeReject, transport/connector.h).
#ifndef COVERBS_CM_HANDSHAKE_H_
#define COVERBS_CM_HANDSHAKE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace coverbs::cm {

inline constexpr uint32_t kHandshakeMagic = 0x31425643;  // "CVB1"
// 2: CTS travels in reserved receives, without credits (cm/wire.h).
// 3: max_credits (credits may grow past the initial grant) and the
//    kFlagCreditLow header flag, for receivers with a shared receive queue.
// 4: the active side always sends kHello first (every provider), so the
//    passive side's accept completes only once the peer spoke: a peer that
//    connects and then stays silent is dropped at the accept deadline.
// 5: landing grants in credit messages and kLanded (cm/wire.h): medium
//    messages go by RDMA WRITE into buffers granted ahead of time, without
//    the RTS/CTS round trip.
// 6: a landing grant may be a memory window the kLanded header invalidates
//    (SEND_WITH_INV; kGrantInvalidate in cm/wire.h).
// 7: a kLanded header may carry the message's last bytes (cm/landing.cc).
inline constexpr uint16_t kProtocolVersion = 7;
inline constexpr size_t kHandshakeSize = 32;
inline constexpr size_t kMaxAppData = 24;

enum Capability : uint32_t {
  kCapWriteWithImm = 1u << 0,  // the sender may complete rendezvous by imm
  kCapAtomics = 1u << 1,
};
// Every bit above. Peers speak the same protocol version, so a bit outside
// it is not a newer feature but garbage: refused.
inline constexpr uint32_t kKnownCaps = kCapWriteWithImm | kCapAtomics;

// Bounds on what a peer may announce (DecodeHandshake). Nothing a peer
// announces sizes an allocation here; the bounds are those of a correctly
// configured coverbs peer, so that garbage is refused by name.
// credits and max_credits: ConnectionOptions::recv_credits is at most this.
inline constexpr uint32_t kMaxHandshakeCredits = 16384;
// recv_buffer_size is clamped to this: our eager messages are at most
// rendezvous_threshold (<= 1 MiB) plus the 16-byte header, so a larger
// receive buffer is never used (an SRQ peer may announce one).
inline constexpr uint32_t kMaxUsedRecvBufferSize = (1u << 20) + 64;
// max_message_size: a message length travels in 32 bits (cm/wire.h), and
// ConnectionOptions::max_message_size is at most this.
inline constexpr uint64_t kMaxHandshakeMessageSize = 0xffffffffull;

struct Handshake {
  uint16_t version = kProtocolVersion;
  uint32_t caps = 0;
  uint32_t credits = 0;
  uint32_t max_credits = 0;  // 0 when encoding: = credits
  uint32_t recv_buffer_size = 0;
  uint64_t max_message_size = 0;
  std::string app_data;  // <= kMaxAppData bytes
};

// Fails with InvalidArgument if app_data is too long.
absl::StatusOr<std::string> EncodeHandshake(const Handshake& h);
// Validates every field: short/garbage data and a bad magic give
// InvalidArgument; another protocol version gives FailedPrecondition naming
// both versions. InvalidArgument, naming the value and its bound, for:
// credits outside [1, kMaxHandshakeCredits], max_credits outside [credits,
// kMaxHandshakeCredits], a receive buffer that does not hold a message
// header, max_message_size outside [1, kMaxHandshakeMessageSize], caps bits
// outside kKnownCaps. recv_buffer_size above kMaxUsedRecvBufferSize is
// clamped to it.
absl::StatusOr<Handshake> DecodeHandshake(std::span<const std::byte> data);

}  // namespace coverbs::cm

#endif  // COVERBS_CM_HANDSHAKE_H_
