// Shared by scope_server and scope_client (issue 27, point 4): the methods a
// real victim and a real attacker call, and the patterns both ends check.
// The compiler checks that both ends agree on each method's types.
#ifndef COVERBS_TESTS_HOSTILE_SCOPE_H_
#define COVERBS_TESTS_HOSTILE_SCOPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "coverbs/coverbs.h"

namespace scope {

// The first call on a connection registers a region of kRegionBytes for
// that connection (filled with the pattern of its tag, the connection's
// serial number on the server) with local access only; every call exposes
// it anew to the calling connection alone (ctx.Expose, remote read and
// write) and returns the token. On a device without memory windows the
// server's Expose refuses (FailedPrecondition naming the device): that
// status comes back as the call's.
inline constexpr coverbs::rpc::Method<int32_t, coverbs::RemoteRegion> kToken{
    "Token"};
// Ends an exposure of the calling connection (cm::Connection::Revoke):
// NOT_FOUND for a token that connection did not expose.
inline constexpr coverbs::rpc::Method<coverbs::RemoteRegion, int32_t> kRevoke{
    "Revoke"};
// The bytes that differ from their pattern over every region the server
// ever made (those of closed connections too: their memory stays).
inline constexpr coverbs::rpc::Method<int32_t, uint64_t> kCheck{"Check"};
// A request of kLargeBytes (above the eager limit, within a landing
// buffer): [u64 tag][pattern of tag]. Returns the bytes that differ. Once
// the server has seen one, it grants the caller landing buffers.
inline constexpr coverbs::rpc::Method<std::span<const std::byte>, uint64_t>
    kLarge{"Large"};

// Answers its argument: what a client calls first, so that the server has
// accepted its connection (the first message completes the handshake)
// before it attacks.
inline constexpr coverbs::rpc::Method<int32_t, int32_t> kPing{"Ping"};

inline constexpr size_t kRegionBytes = 16384;
inline constexpr size_t kLargeBytes = 80 * 1024;  // >= 64 KiB, < 128 KiB

// The byte at `index` of a region or payload tagged `tag`.
inline std::byte PatternByte(uint64_t tag, size_t index) {
  return static_cast<std::byte>(
      ((tag + 1) * 0x9E3779B1u + index * 131 + (index >> 9)) & 0xff);
}
inline void Fill(std::span<std::byte> out, uint64_t tag) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(tag, i);
}
inline uint64_t Mismatches(std::span<const std::byte> in, uint64_t tag) {
  uint64_t n = 0;
  for (size_t i = 0; i < in.size(); ++i) n += in[i] != PatternByte(tag, i);
  return n;
}
// A kLarge request: the tag, then the pattern.
inline void FillLarge(std::span<std::byte> out, uint64_t tag) {
  std::memcpy(out.data(), &tag, sizeof(tag));
  Fill(out.subspan(sizeof(tag)), tag);
}
inline uint64_t LargeMismatches(std::span<const std::byte> in) {
  if (in.size() < sizeof(uint64_t)) return in.size() + 1;
  uint64_t tag;
  std::memcpy(&tag, in.data(), sizeof(tag));
  return Mismatches(in.subspan(sizeof(tag)), tag);
}

}  // namespace scope

#endif  // COVERBS_TESTS_HOSTILE_SCOPE_H_
