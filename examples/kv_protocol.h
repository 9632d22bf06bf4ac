// The kv example's formats, shared by kv_server and kv_client.
//
// Values live in one registered region of the server, exposed for RDMA READ
// (never for WRITE: clients cannot modify it). The region is an array of
// slots; a slot is
//   [0, 8)            version: a seqlock, odd while a Put is writing
//   [8, 12)           value length
//   [12, 16)          reserved
//   [16, 16 + L8)     value (L8: length rounded up to 8)
//   [16 + L8, +8)     version again, written last
// A reader fetches header, value and trailing version with ONE RDMA READ and
// accepts the value only when both versions are equal and even (a Put was
// not in progress while the bytes were read).
#ifndef COVERBS_EXAMPLES_KV_PROTOCOL_H_
#define COVERBS_EXAMPLES_KV_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace coverbs::examples::kv {

constexpr size_t kSlotHeader = 16;
constexpr size_t kSlotTrailer = 8;
inline size_t Round8(size_t n) { return (n + 7) & ~size_t{7}; }
// Bytes one READ must fetch for a value of `length`.
inline size_t ReadBytes(size_t length) { return kSlotHeader + Round8(length) + kSlotTrailer; }

// "Get" response: where the value is and what it was when served.
struct Location {
  uint64_t addr = 0;   // of the slot
  uint32_t rkey = 0;
  uint32_t length = 0;
  uint64_t version = 0;
};

// "Put" request: u16 key length, key, value.
inline std::string EncodePut(std::string_view key, std::span<const std::byte> value) {
  std::string out(2 + key.size() + value.size(), '\0');
  uint16_t n = static_cast<uint16_t>(key.size());
  std::memcpy(out.data(), &n, 2);
  std::memcpy(out.data() + 2, key.data(), key.size());
  if (!value.empty()) std::memcpy(out.data() + 2 + key.size(), value.data(), value.size());
  return out;
}

}  // namespace coverbs::examples::kv

#endif  // COVERBS_EXAMPLES_KV_PROTOCOL_H_
