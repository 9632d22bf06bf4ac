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
#include "tests/hostile/soft_conn.h"

namespace hostile {
namespace {

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
