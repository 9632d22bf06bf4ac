// The soft provider's wire protocol: framed messages between the two TCP
// endpoints of a connected soft RC QP. See transport/soft/README.md.
//
// Every frame is a fixed 40-byte header followed by `payload_len` bytes.
// All integers are little-endian on the wire, except `imm`, which carries the
// four bytes of ibv_send_wr::imm_data unchanged (already network order, as
// verbs hands them to the receiver in ibv_wc::imm_data).
#ifndef COVERBS_TRANSPORT_SOFT_WIRE_H_
#define COVERBS_TRANSPORT_SOFT_WIRE_H_

#include <endian.h>

#include <cstdint>
#include <cstring>

namespace coverbs::transport::soft::wire {

inline constexpr uint64_t kHelloMagic = 0x5446'4f53'4256'4f43ULL;  // "COVBSOFT"
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kHeaderSize = 40;
inline constexpr size_t kAtomicReqSize = 16;   // compare_add, swap
inline constexpr size_t kAtomicRespSize = 8;   // original value

enum Opcode : uint8_t {
  // Sent once by each side, first on the stream.
  kHello = 1,
  // Requests (requester -> responder); `seq` numbers them 0, 1, 2, ...
  kSend = 2,
  kSendImm = 3,
  kWrite = 4,
  kWriteImm = 5,
  kReadReq = 6,
  kCmpSwap = 7,
  kFetchAdd = 8,
  // Responses (responder -> requester); `seq` names the request answered.
  kAck = 16,         // requests up to and including `seq` are done
  kNak = 17,         // request `seq` failed: `syndrome` is the ibv_wc_status
  kRnrNak = 18,      // no receive posted for `seq`: retry; `syndrome` = timer
  kReadResp = 19,    // data of READ `seq`
  kAtomicResp = 20,  // original value of atomic `seq`
  // Either direction: the sender's QP left RTS on purpose (SetError,
  // destruction); the receiver moves its QP to the error state.
  kDisconnect = 21,
};

inline constexpr uint8_t kFlagSolicited = 1;
// A SEND that invalidates the responder's memory window `rkey`
// (IBV_WR_SEND_WITH_INV).
inline constexpr uint8_t kFlagInvalidate = 2;

struct Header {
  uint8_t opcode = 0;
  uint8_t flags = 0;
  uint8_t syndrome = 0;
  uint8_t reserved = 0;
  uint32_t payload_len = 0;  // bytes following this header
  uint64_t seq = 0;
  uint64_t addr = 0;     // requests: remote virtual address; HELLO: magic
  uint32_t rkey = 0;
  uint32_t imm = 0;      // raw bytes of imm_data
  uint32_t dma_len = 0;  // READ_REQ: bytes requested; HELLO: version
  uint32_t qpn = 0;      // HELLO: sender's qp_num
};

inline void Encode(const Header& h, char* out) {
  out[0] = static_cast<char>(h.opcode);
  out[1] = static_cast<char>(h.flags);
  out[2] = static_cast<char>(h.syndrome);
  out[3] = 0;
  uint32_t u32 = htole32(h.payload_len);
  std::memcpy(out + 4, &u32, 4);
  uint64_t u64 = htole64(h.seq);
  std::memcpy(out + 8, &u64, 8);
  u64 = htole64(h.addr);
  std::memcpy(out + 16, &u64, 8);
  u32 = htole32(h.rkey);
  std::memcpy(out + 24, &u32, 4);
  std::memcpy(out + 28, &h.imm, 4);
  u32 = htole32(h.dma_len);
  std::memcpy(out + 32, &u32, 4);
  u32 = htole32(h.qpn);
  std::memcpy(out + 36, &u32, 4);
}

inline Header Decode(const char* in) {
  Header h;
  h.opcode = static_cast<uint8_t>(in[0]);
  h.flags = static_cast<uint8_t>(in[1]);
  h.syndrome = static_cast<uint8_t>(in[2]);
  uint32_t u32;
  uint64_t u64;
  std::memcpy(&u32, in + 4, 4);
  h.payload_len = le32toh(u32);
  std::memcpy(&u64, in + 8, 8);
  h.seq = le64toh(u64);
  std::memcpy(&u64, in + 16, 8);
  h.addr = le64toh(u64);
  std::memcpy(&u32, in + 24, 4);
  h.rkey = le32toh(u32);
  std::memcpy(&h.imm, in + 28, 4);
  std::memcpy(&u32, in + 32, 4);
  h.dma_len = le32toh(u32);
  std::memcpy(&u32, in + 36, 4);
  h.qpn = le32toh(u32);
  return h;
}

inline void PutLe64(uint64_t v, char* out) {
  v = htole64(v);
  std::memcpy(out, &v, 8);
}
inline uint64_t GetLe64(const char* in) {
  uint64_t v;
  std::memcpy(&v, in, 8);
  return le64toh(v);
}

}  // namespace coverbs::transport::soft::wire

#endif  // COVERBS_TRANSPORT_SOFT_WIRE_H_
