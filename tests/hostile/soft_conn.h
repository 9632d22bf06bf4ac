// A soft-provider connection played by hand, for hostile_client's attacks
// after a valid handshake (hostile_remote.cc, hostile_rts_flood.cc): the
// soft provider's frames (transport/soft/wire.h) and cm's message header
// (cm/wire.h), written out by hand as an attacker would.
#ifndef COVERBS_TESTS_HOSTILE_SOFT_CONN_H_
#define COVERBS_TESTS_HOSTILE_SOFT_CONN_H_

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace hostile {

using Clock = std::chrono::steady_clock;

// transport/soft/wire.h, by hand: a 40-byte little-endian header.
enum : uint8_t {
  kHello = 1,
  kSend = 2,
  kSendImm = 3,
  kWrite = 4,
  kWriteImm = 5,
  kReadReq = 6,
  kCmpSwap = 7,
  kFetchAdd = 8,
  kAck = 16,
  kNak = 17,
  kRnrNak = 18,
  kDisconnect = 21,
};
constexpr uint64_t kSoftMagic = 0x54464f5342564f43ULL;  // "COVBSOFT"
constexpr size_t kSoftHeader = 40;

struct Soft {
  uint8_t op = 0;
  uint8_t syndrome = 0;
  uint32_t payload_len = 0;
  uint64_t seq = 0;
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t dma_len = 0;
};

inline std::string Encode(const Soft& h, const std::string& payload) {
  std::string out(kSoftHeader, '\0');
  out[0] = static_cast<char>(h.op);
  out[2] = static_cast<char>(h.syndrome);
  uint32_t len = static_cast<uint32_t>(payload.size());
  std::memcpy(&out[4], &len, 4);
  std::memcpy(&out[8], &h.seq, 8);
  std::memcpy(&out[16], &h.addr, 8);
  std::memcpy(&out[24], &h.rkey, 4);
  std::memcpy(&out[32], &h.dma_len, 4);
  return out + payload;
}

inline Soft Decode(const char* b) {
  Soft h;
  h.op = static_cast<uint8_t>(b[0]);
  h.syndrome = static_cast<uint8_t>(b[2]);
  std::memcpy(&h.payload_len, b + 4, 4);
  std::memcpy(&h.seq, b + 8, 8);
  std::memcpy(&h.addr, b + 16, 8);
  std::memcpy(&h.rkey, b + 24, 4);
  std::memcpy(&h.dma_len, b + 32, 4);
  return h;
}

// cm/wire.h: the 16-byte message header (type, flags, credits, length,
// credit_acks, cookie).
inline std::string CmHeader(uint8_t type, uint32_t length, uint32_t cookie) {
  std::string h(16, '\0');
  h[0] = static_cast<char>(type);
  std::memcpy(&h[4], &length, 4);
  std::memcpy(&h[12], &cookie, 4);
  return h;
}
constexpr uint8_t kCmRts = 3, kCmCts = 4, kCmDone = 5, kCmHello = 6;

struct Key {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
};

// One connection played by hand.
class Conn {
 public:
  // Every read is bounded by `limit` from now (the whole connection's
  // life).
  explicit Conn(int fd,
                std::chrono::milliseconds limit = std::chrono::seconds(5))
      : fd_(fd), deadline_(Clock::now() + limit) {}
  ~Conn() { close(fd_); }

  // Setup frame with a valid handshake, the accept, both HELLOs.
  bool Start(const std::string& request) {
    if (!SendAll(request)) return false;
    char h[8];
    if (!ReadExactly(h, 8)) return false;
    uint16_t len;
    std::memcpy(&len, h + 6, 2);
    std::string body(len, '\0');
    if (h[4] != 2 || !ReadExactly(body.data(), len)) return false;  // accept
    Soft hello;
    hello.op = kHello;
    hello.addr = kSoftMagic;
    hello.dma_len = 1;
    if (!SendAll(Encode(hello, ""))) return false;
    return Post(kSend, CmHeader(kCmHello, 0, 0));
  }

  // A request of ours with the next sequence number.
  bool Post(uint8_t op, const std::string& payload, uint64_t addr = 0,
            uint32_t rkey = 0, uint32_t dma_len = 0) {
    Soft h;
    h.op = op;
    h.seq = next_seq_++;
    h.addr = addr;
    h.rkey = rkey;
    h.dma_len = dma_len;
    return SendAll(Encode(h, payload));
  }

  // A request with sequence number `seq` whatever the next one is.
  bool PostAt(uint64_t seq, uint8_t op, const std::string& payload) {
    Soft h;
    h.op = op;
    h.seq = seq;
    return SendAll(Encode(h, payload));
  }

  // Asks for a rendezvous of `size` bytes and returns the CTS's buffer.
  std::optional<Key> RendezvousKey(uint32_t size) {
    if (!Post(kSend, CmHeader(kCmRts, size, 77))) return std::nullopt;
    for (;;) {
      std::optional<Soft> f = Next();
      if (!f) return std::nullopt;
      if (f->op == kNak || f->op == kDisconnect) return std::nullopt;
      if ((f->op == kSend || f->op == kSendImm) && last_payload_.size() >= 32 &&
          last_payload_[0] == static_cast<char>(kCmCts)) {
        Key k;
        std::memcpy(&k.addr, last_payload_.data() + 16, 8);
        std::memcpy(&k.rkey, last_payload_.data() + 24, 4);
        k.length = size;
        return k;
      }
    }
  }

  // What the server answers: "NAK <status>", "closed" or "ACK", or
  // "no answer" after the deadline. Its own requests are ACKed meanwhile.
  std::string Outcome() {
    for (;;) {
      std::optional<Soft> f = Next();
      if (!f) return timed_out_ ? "no answer" : "closed";
      if (f->op == kNak) return "NAK " + std::to_string(f->syndrome);
      if (f->op == kDisconnect) return "closed";
      if (f->op == kAck && f->seq + 1 == next_seq_) return "ACK";
      if (f->op == kRnrNak) return "RNR NAK";
    }
  }

  // Whether a frame of the server starts arriving within `ms`.
  bool Readable(int ms) {
    pollfd pf{fd_, POLLIN, 0};
    return poll(&pf, 1, ms) > 0;
  }
  // The server's next frame (its payload in last_payload()); its requests
  // are ACKed so that its transport timer never fires. None once the
  // stream ended or the deadline passed (timed_out()).
  std::optional<Soft> Next() {
    char b[kSoftHeader];
    if (!ReadExactly(b, kSoftHeader)) return std::nullopt;
    Soft h = Decode(b);
    if (h.payload_len > (1u << 20)) return std::nullopt;
    last_payload_.assign(h.payload_len, '\0');
    if (!ReadExactly(last_payload_.data(), h.payload_len)) return std::nullopt;
    if (h.op >= kSend && h.op <= kFetchAdd) {
      Soft ack;
      ack.op = kAck;
      ack.seq = h.seq;
      SendAll(Encode(ack, ""));
    }
    return h;
  }
  const std::string& last_payload() const { return last_payload_; }
  bool timed_out() const { return timed_out_; }
  uint64_t next_seq() const { return next_seq_; }

 private:
  bool SendAll(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  bool ReadExactly(char* p, size_t n) {
    while (n > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline_ - Clock::now());
      if (left.count() <= 0) {
        timed_out_ = true;
        return false;
      }
      pollfd pf{fd_, POLLIN, 0};
      if (poll(&pf, 1, static_cast<int>(left.count())) <= 0) continue;
      ssize_t r = recv(fd_, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  const int fd_;
  uint64_t next_seq_ = 0;
  std::string last_payload_;
  bool timed_out_ = false;
  const Clock::time_point deadline_;
};

}  // namespace hostile

#endif  // COVERBS_TESTS_HOSTILE_SOFT_CONN_H_
