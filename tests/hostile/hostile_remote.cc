// hostile_client --mode=remote: after a valid handshake, the soft HELLO and
// cm's HELLO, each connection sends one request a correct peer never sends
// -- every one-sided opcode with rkey 0, a random key, a stale key (one the
// server handed out on an earlier connection, deregistered since), a valid
// key out of bounds, at a wrapping address or without the access, and
// SENDs the server cannot take -- and reads what the server's QP answers.
// A valid key comes from the server itself: a rendezvous request (cm RTS)
// is answered with a CTS naming the buffer (addr, rkey) the server
// registered for the message.
//
// Each case must end only its own connection: a NAK with the expected
// status (REM_ACCESS_ERR for keys and ranges, REM_INV_REQ_ERR for a SEND
// longer than the receive) followed by the close, or the close alone (a
// protocol error; or the NAK lost because the server destroyed the QP
// first); never an ACK, never silence. Prints one line per case of the
// first round and the count of each answer; exits 3 if any case got
// another answer.
//
// Not covered here: a key of another live connection, and keys guessed
// from the ones a peer sees; scope_client attacks those (scope_test.sh).
#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tests/hostile/hostile.h"

namespace hostile {
namespace {

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

std::string Encode(const Soft& h, const std::string& payload) {
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

Soft Decode(const char* b) {
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
std::string CmHeader(uint8_t type, uint32_t length, uint32_t cookie) {
  std::string h(16, '\0');
  h[0] = static_cast<char>(type);
  std::memcpy(&h[4], &length, 4);
  std::memcpy(&h[12], &cookie, 4);
  return h;
}
constexpr uint8_t kCmRts = 3, kCmCts = 4, kCmHello = 6;

struct Key {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
};

// One connection played by hand. Every read is bounded by `deadline`.
class Conn {
 public:
  explicit Conn(int fd) : fd_(fd) {}
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
  // The server's next frame (its payload in last_payload_); its requests
  // are ACKed so that its transport timer never fires.
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

  const int fd_;
  uint64_t next_seq_ = 0;
  std::string last_payload_;
  bool timed_out_ = false;
  const Clock::time_point deadline_ = Clock::now() + std::chrono::seconds(5);
};

struct Case {
  const char* name;
  // "NAK 10" (IBV_WC_REM_ACCESS_ERR), "NAK 9" (IBV_WC_REM_INV_REQ_ERR) or
  // "closed" (a protocol error: the server's DISCONNECT or end of stream).
  const char* expect;
};

}  // namespace

int RunRemote(const Options& o, int (*dial)(const Options&),
              const std::string& request) {
  std::mt19937_64 rng(o.seed);
  // A key from an earlier connection, deregistered once it closed.
  std::optional<Key> stale;
  {
    int fd = dial(o);
    if (fd < 0) return 1;
    Conn c(fd);
    if (c.Start(request)) stale = c.RendezvousKey(65536);
  }
  const std::string data16(16, 'x');
  const std::string atomic(16, '\0');
  const Case cases[] = {
      {"WRITE rkey 0", "NAK 10"},
      {"WRITE_WITH_IMM rkey 0", "NAK 10"},
      {"READ rkey 0", "NAK 10"},
      {"CMP_SWAP rkey 0", "NAK 10"},
      {"FETCH_ADD rkey 0", "NAK 10"},
      {"WRITE random key", "NAK 10"},
      {"READ random key", "NAK 10"},
      {"FETCH_ADD random key", "NAK 10"},
      {"WRITE stale key", "NAK 10"},
      {"READ stale key", "NAK 10"},
      {"WRITE past the end", "NAK 10"},
      {"WRITE before the start", "NAK 10"},
      {"WRITE wrapping address", "NAK 10"},
      {"READ wrapping length", "NAK 10"},
      {"READ without REMOTE_READ", "NAK 10"},
      {"CMP_SWAP without REMOTE_ATOMIC", "NAK 10"},
      {"SEND longer than the receive", "NAK 9"},
      {"SEND out of sequence", "closed"},
      {"unknown opcode", "closed"},
  };
  int unexpected = 0, done = 0;
  std::map<std::string, int> outcomes;
  const int rounds = std::max(1, o.count);
  for (int round = 0; round < rounds; ++round) {
    for (const Case& k : cases) {
      int fd = dial(o);
      if (fd < 0) {
        std::printf("  %-32s connect failed\n", k.name);
        ++unexpected;
        continue;
      }
      Conn c(fd);
      if (!c.Start(request)) {
        std::printf("  %-32s handshake failed\n", k.name);
        ++unexpected;
        continue;
      }
      std::optional<Key> key = c.RendezvousKey(65536);
      if (!key || !stale) {
        std::printf("  %-32s no rendezvous key from the server\n", k.name);
        ++unexpected;
        continue;
      }
      const std::string n = k.name;
      const uint32_t random_key = static_cast<uint32_t>(rng()) | 1;
      bool sent = false;
      if (n == "WRITE rkey 0") {
        sent = c.Post(kWrite, data16, key->addr, 0);
      } else if (n == "WRITE_WITH_IMM rkey 0") {
        sent = c.Post(kWriteImm, data16, key->addr, 0);
      } else if (n == "READ rkey 0") {
        sent = c.Post(kReadReq, "", key->addr, 0, 16);
      } else if (n == "CMP_SWAP rkey 0") {
        sent = c.Post(kCmpSwap, atomic, key->addr, 0);
      } else if (n == "FETCH_ADD rkey 0") {
        sent = c.Post(kFetchAdd, atomic, key->addr, 0);
      } else if (n == "WRITE random key") {
        sent = c.Post(kWrite, data16, key->addr, random_key);
      } else if (n == "READ random key") {
        sent = c.Post(kReadReq, "", key->addr, random_key, 16);
      } else if (n == "FETCH_ADD random key") {
        sent = c.Post(kFetchAdd, atomic, key->addr, random_key);
      } else if (n == "WRITE stale key") {
        sent = c.Post(kWrite, data16, stale->addr, stale->rkey);
      } else if (n == "READ stale key") {
        sent = c.Post(kReadReq, "", stale->addr, stale->rkey, 16);
      } else if (n == "WRITE past the end") {
        sent = c.Post(kWrite, data16, key->addr + key->length - 8, key->rkey);
      } else if (n == "WRITE before the start") {
        sent = c.Post(kWrite, data16, key->addr - 8, key->rkey);
      } else if (n == "WRITE wrapping address") {
        sent = c.Post(kWrite, std::string(32, 'w'), ~0ULL - 7, key->rkey);
      } else if (n == "READ wrapping length") {
        sent = c.Post(kReadReq, "", key->addr + 8, key->rkey, 0xffffffffu);
      } else if (n == "READ without REMOTE_READ") {
        sent = c.Post(kReadReq, "", key->addr, key->rkey, 16);
      } else if (n == "CMP_SWAP without REMOTE_ATOMIC") {
        sent = c.Post(kCmpSwap, atomic, key->addr, key->rkey);
      } else if (n == "SEND longer than the receive") {
        sent = c.Post(kSend, std::string(64 * 1024, 's'));
      } else if (n == "SEND out of sequence") {
        sent = c.PostAt(1000, kSend, CmHeader(1, 0, 0));
      } else if (n == "unknown opcode") {
        sent = c.Post(9, "");
      }
      // The server may also close before its NAK left: the cm layer
      // destroys the QP as soon as its receives flush, and a soft QP
      // destroyed in the error state drops the frames it still owed. The
      // connection ended either way; only an ACK or silence is wrong.
      std::string got = sent ? c.Outcome() : "closed";
      bool ok = got == k.expect || got == "closed";
      // A NAK is followed by the close: the connection ends.
      if (ok && got != "closed") ok = c.Outcome() == "closed";
      if (!ok) ++unexpected;
      ++outcomes[got];
      ++done;
      if (round == 0 || !ok) {
        std::printf(
            "  %-32s %s%s\n", k.name, got.c_str(),
            ok ? "" : (std::string(" (expected ") + k.expect + ")").c_str());
      }
    }
  }
  for (const auto& [what, n] : outcomes) {
    std::printf("  %5d  %s\n", n, what.c_str());
  }
  std::printf(
      "hostile_client: mode remote, %d attacks, %d unexpected answers\n", done,
      unexpected);
  return unexpected == 0 ? 0 : 3;
}

}  // namespace hostile
