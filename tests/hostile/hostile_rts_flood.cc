// hostile_client --mode=rts_flood | rts_flood_touch (soft provider): issue
// 36's attack on rendezvous memory. After a valid handshake one connection
// asks for rendezvous of 64 MiB (cm RTS) --count times and never finishes
// any (no WRITE ... DONE). Before the receiver had a budget every request
// was granted at once -- a buffer of the announced size mapped and
// registered per RTS, freed only when the connection closed: 200 requests
// took an echo_server to 13 GiB of address space. rts_flood_touch also
// writes 64 bytes into every 4 KiB page of each buffer granted, so that
// the granted memory becomes resident.
//
// It waits up to 300 ms for each request's CTS (a receiver with a budget
// defers it; a conforming sender would wait, this one asks again), then
// holds the connection --hold_ms, answering the server's requests, to see
// whether the server ends it. Prints what happened, one line each:
//   rts_flood: requests sent N, granted G, unanswered U
//   rts_flood: closed by the server after N requests, T ms after the last
//   rts_flood: still open after the hold
// Exits 0 when the connection was set up (whatever the server did), 1 if
// not.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <string>

#include "tests/hostile/hostile.h"
#include "tests/hostile/soft_conn.h"

namespace hostile {

int RunRtsFlood(const Options& o, int (*dial)(const Options&),
                const std::string& request) {
  const bool touch = o.mode == "rts_flood_touch";
  constexpr uint32_t kSize = 64u << 20;
  constexpr uint32_t kPage = 4096;
  int fd = dial(o);
  if (fd < 0) {
    std::fprintf(stderr, "hostile_client: connect failed\n");
    return 1;
  }
  // Reads are bounded by the whole run: the requests, their waits, the
  // hold, and a margin.
  Conn c(fd, std::chrono::milliseconds(o.count * 400) + o.hold +
                 std::chrono::seconds(30));
  if (!c.Start(request)) {
    std::fprintf(stderr, "hostile_client: handshake failed\n");
    return 1;
  }
  int sent = 0, granted = 0;
  bool closed = false;
  Clock::time_point last_sent{};
  std::deque<Key> to_touch;
  // Reads one frame of the server: a CTS counts (its buffer queues for
  // touching; true), a DISCONNECT or the stream's end is the close.
  auto read_one = [&]() {
    std::optional<Soft> f = c.Next();
    if (!f || f->op == kDisconnect) {
      closed = true;
      return false;
    }
    const std::string& p = c.last_payload();
    if ((f->op == kSend || f->op == kSendImm) && p.size() >= 32 &&
        p[0] == static_cast<char>(kCmCts)) {
      uint8_t flags = static_cast<uint8_t>(p[1]);
      if (flags & 1) return false;  // refused: no buffer
      ++granted;
      Key k;
      std::memcpy(&k.addr, p.data() + 16, 8);
      std::memcpy(&k.rkey, p.data() + 24, 4);
      k.length = kSize;
      to_touch.push_back(k);
      return true;
    }
    return false;
  };
  // Reads frames for up to `ms`, until a CTS came.
  auto read_for = [&](int ms) {
    const Clock::time_point until =
        Clock::now() + std::chrono::milliseconds(ms);
    while (!closed) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - Clock::now());
      if (left.count() <= 0 || !c.Readable(static_cast<int>(left.count()))) {
        return;
      }
      if (read_one()) return;
    }
  };
  const std::string bytes64(64, 'T');
  for (int i = 1; i <= o.count && !closed; ++i) {
    if (!c.Post(kSend, CmHeader(kCmRts, kSize, static_cast<uint32_t>(i)))) {
      closed = true;
      break;
    }
    ++sent;
    last_sent = Clock::now();
    read_for(300);
    while (touch && !closed && !to_touch.empty()) {
      Key k = to_touch.front();
      to_touch.pop_front();
      for (uint64_t off = 0; off < k.length && !closed; off += kPage) {
        if (!c.Post(kWrite, bytes64, k.addr + off, k.rkey)) closed = true;
        // Drain the ACKs now and then, so that neither side's socket
        // buffer fills.
        if ((off / kPage) % 256 == 255) {
          while (!closed && c.Readable(0)) read_one();
        }
      }
    }
  }
  std::printf("rts_flood: requests sent %d, granted %d, unanswered %d\n",
              sent, granted, sent - granted);
  // Hold: the server may end the connection (a DONE that never came).
  const Clock::time_point hold_end = Clock::now() + o.hold;
  while (!closed && Clock::now() < hold_end) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        hold_end - Clock::now());
    read_for(static_cast<int>(left.count()));
  }
  if (closed) {
    std::printf(
        "rts_flood: closed by the server after %d requests, %lld ms after "
        "the last\n",
        sent,
        static_cast<long long>(
            std::chrono::duration_cast<std::chrono::milliseconds>(
                Clock::now() - last_sent)
                .count()));
  } else {
    std::printf("rts_flood: still open after the hold\n");
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace hostile
