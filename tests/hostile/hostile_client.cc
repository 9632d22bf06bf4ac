// hostile_client: a misbehaving peer for coverbs servers, for tests only.
//
//   hostile_client --mode=<mode> --address=127.0.0.1 --port=7471
//                  [--count=N] [--hold=2s] [--seed=1]
//
// It plays an attacker (or a very unlucky network) against a listener and
// reports what the server did; the test scripts assert that the server
// stays up and keeps serving good clients meanwhile. Bounded in count and
// time, loopback (or VM-internal) addresses only. It speaks the wire by
// hand, as an attacker would, and links nothing of coverbs.
//
// Soft provider (TCP setup) modes:
//   garbage          N sockets each send 4 KiB of random bytes, then hold
//   truncated        N sockets send 5 bytes of a valid setup frame, hold
//   absurd           N sockets send frames with absurd lengths/kinds/handshakes
//   slow             N sockets drip a valid request one byte per 200 ms
//   silent           N sockets connect and send nothing, hold
//   accepted_silent  N sockets send a valid request, read the accept, then
//                    never speak the queue-pair protocol, hold
//   flood            N connections opened and closed one after another, each
//                    sending garbage (a burst of short-lived bad peers)
//   silent_reopen    N sockets connect and send nothing for the hold, each
//                    re-opened as soon as the server closes it: N
//                    descriptors pinned in the server for as long as it
//                    lets them (issue #36: 1,100 of them against a server
//                    at ulimit -n 1024). Raises its own descriptor limit.
//   http_slowloris   for an HTTP port (the metrics endpoint): N sockets,
//                    the even ones silent, the odd ones dripping a request
//                    line and then header bytes, one byte per 100 ms, never
//                    ending the headers; each re-opened as soon as the
//                    server closes it, for the hold
//   remote           N rounds of one connection per bad request after a
//                    valid handshake (bad keys, ranges, access, SENDs the
//                    server cannot take; hostile_remote.cc); exits 3 unless
//                    each got the refusal expected and ended its connection
//   rts_flood        one connection asks for N rendezvous of 64 MiB and
//                    finishes none (issue 36; hostile_rts_flood.cc), then
//                    holds it --hold; rts_flood_touch also writes every
//                    page of each buffer granted
// rdma_cm (verbs provider) modes, hostile_rdmacm.cc:
//   cm_random        N connects with random private data
//   cm_silent        N connects with a valid handshake that reach
//                    ESTABLISHED and then say nothing, hold
//   cm_disconnect    N connects that disconnect right after ESTABLISHED
//   cm_many_exit     N valid connects in flight, then the process exits
//                    without disconnecting any
// Exit status: 0 when the sockets were opened and the actions done (what
// the server answered is printed, one line per outcome kind, with counts);
// 1 on a local failure (socket, flags); 2 on bad usage.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cm/handshake.h"
#include "tests/hostile/hostile.h"

namespace hostile {
namespace {

// The soft provider's setup frame (cm): u32 magic "CVBS", u8 kind
// (1 request, 2 accept, 3 reject), u8 pad, u16 length, body.
constexpr uint32_t kFrameMagic = 0x53425643;
constexpr uint8_t kRequest = 1, kAccept = 2, kReject = 3;

std::string Frame(uint8_t kind, const std::string& body, uint16_t len) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &kFrameMagic, 4);
  out[4] = static_cast<char>(kind);
  std::memcpy(out.data() + 6, &len, 2);
  return out + body;
}

std::string Frame(uint8_t kind, const std::string& body) {
  return Frame(kind, body, static_cast<uint16_t>(body.size()));
}

int Dial(const Options& o) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(o.port);
  if (inet_pton(AF_INET, o.address.c_str(), &sa.sin_addr) != 1) {
    close(fd);
    return -EINVAL;
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool SendAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// What the server did with a socket, as one word: "closed" (EOF/reset),
// "rejected: <reason>", "accepted", "open" (nothing within `wait`), or
// "bytes" (something else arrived).
std::string Observe(int fd, int wait_ms) {
  pollfd p{fd, POLLIN, 0};
  int r = poll(&p, 1, wait_ms);
  if (r == 0) return "open";
  char buf[600];
  ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n <= 0) return "closed";
  if (n >= 8) {
    uint32_t magic;
    std::memcpy(&magic, buf, 4);
    if (magic == kFrameMagic && buf[4] == kReject) {
      // Reject body: u32 "CVBR", u16 length, reason.
      uint16_t len = 0;
      if (n >= 14) std::memcpy(&len, buf + 12, 2);
      size_t avail = static_cast<size_t>(n) > 14 ? n - 14 : 0;
      return "rejected: " + std::string(buf + 14, std::min<size_t>(len, avail));
    }
    if (magic == kFrameMagic && buf[4] == kAccept) return "accepted";
  }
  return "bytes";
}

// Holds every fd open for `hold`, then reports how each ended up: closed
// by the server before the end of the hold, or still open.
void HoldAndReport(std::vector<int>& fds, const Options& o,
                   std::map<std::string, int>& outcome) {
  auto until = std::chrono::steady_clock::now() + o.hold;
  std::vector<bool> closed(fds.size(), false);
  while (std::chrono::steady_clock::now() < until) {
    std::vector<pollfd> ps;
    for (int fd : fds) ps.push_back({fd, POLLIN, 0});
    int r = poll(ps.data(), ps.size(), 50);
    if (r <= 0) continue;
    for (size_t i = 0; i < ps.size(); ++i) {
      if (closed[i] || !(ps[i].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      char buf[4096];
      ssize_t n = recv(fds[i], buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0 && !(n < 0 && errno == EAGAIN)) closed[i] = true;
    }
  }
  int n_closed = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (closed[i]) ++n_closed;
    close(fds[i]);
  }
  outcome["closed by the server during the hold"] += n_closed;
  outcome["still open at the end of the hold"] +=
      static_cast<int>(fds.size()) - n_closed;
  fds.clear();
}

// A non-blocking connect started (or done) to o.address:o.port, or -errno.
int DialAsync(const Options& o) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -errno;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(o.port);
  if (inet_pton(AF_INET, o.address.c_str(), &sa.sin_addr) != 1) {
    close(fd);
    return -EINVAL;
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 &&
      errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

// silent_reopen and http_slowloris: o.count sockets kept open for o.hold,
// each re-opened once the server closes it (or its connect fails).
int RunHeldOpen(const Options& o) {
  const bool http = o.mode == "http_slowloris";
  // The sockets, plus a few: raise the soft limit as far as the hard one.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 &&
      rl.rlim_cur < static_cast<rlim_t>(o.count) + 64) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, o.count + 64);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  // Never ends its headers: the request line, then one header line after
  // another.
  const std::string drip =
      "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
      std::string(8000, 'x');
  struct Slot {
    int fd = -1;
    size_t sent = 0;  // drip bytes sent on this socket
  };
  std::vector<Slot> slots(o.count);
  int opened = 0, closed_by_server = 0, dial_errors = 0;
  std::string last_error;
  auto open_slot = [&](Slot& s) {
    s.sent = 0;
    s.fd = DialAsync(o);
    if (s.fd < 0) {
      ++dial_errors;
      last_error = std::strerror(-s.fd);
      s.fd = -1;
    } else {
      ++opened;
    }
  };
  for (Slot& s : slots) open_slot(s);
  std::printf("hostile_client: mode %s, %d sockets opened, %d connects failed\n",
              o.mode.c_str(), opened, dial_errors);
  std::fflush(stdout);
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + o.hold;
  auto next_drip = Clock::now();
  int max_open = 0;
  std::vector<pollfd> ps;
  std::vector<size_t> idx;
  while (Clock::now() < until) {
    ps.clear();
    idx.clear();
    int open_now = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].fd < 0) continue;
      ++open_now;
      ps.push_back({slots[i].fd, POLLIN, 0});
      idx.push_back(i);
    }
    max_open = std::max(max_open, open_now);
    const int r = poll(ps.data(), ps.size(), 20);
    for (size_t k = 0; r > 0 && k < ps.size(); ++k) {
      if (!(ps[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Slot& s = slots[idx[k]];
      char buf[4096];
      ssize_t n = recv(s.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) {
        continue;  // an answer (or nothing yet): keep holding
      }
      close(s.fd);
      s.fd = -1;
      ++closed_by_server;
    }
    if (http && Clock::now() >= next_drip) {
      next_drip = Clock::now() + std::chrono::milliseconds(100);
      for (size_t i = 1; i < slots.size(); i += 2) {
        Slot& s = slots[i];
        if (s.fd < 0 || s.sent >= drip.size()) continue;
        if (send(s.fd, drip.data() + s.sent, 1, MSG_NOSIGNAL) == 1) ++s.sent;
      }
    }
    // Re-open what the server closed (or what failed to connect).
    for (Slot& s : slots) {
      if (s.fd < 0) open_slot(s);
    }
  }
  for (Slot& s : slots) {
    if (s.fd >= 0) close(s.fd);
  }
  std::printf("  %5d  sockets opened in all (re-opened ones included)\n",
              opened);
  std::printf("  %5d  closed by the server during the hold\n",
              closed_by_server);
  std::printf("  %5d  most open at once\n", max_open);
  if (dial_errors > 0) {
    std::printf("  %5d  connects failed (last: %s)\n", dial_errors,
                last_error.c_str());
  }
  return opened == 0 && o.count > 0 ? 1 : 0;
}

}  // namespace

int RunTcp(const Options& o) {
  std::mt19937_64 rng(o.seed);
  auto random_bytes = [&rng](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  const std::string request = Frame(kRequest, ValidHandshake());
  if (o.mode == "remote") return RunRemote(o, Dial, request);
  if (o.mode == "silent_reopen" || o.mode == "http_slowloris") {
    return RunHeldOpen(o);
  }
  if (o.mode == "rts_flood" || o.mode == "rts_flood_touch") {
    return RunRtsFlood(o, Dial, request);
  }
  std::map<std::string, int> outcome;
  std::vector<int> fds;
  int dial_errors = 0;
  for (int i = 0; i < o.count; ++i) {
    int fd = Dial(o);
    if (fd < 0) {
      ++dial_errors;
      if (o.mode != "flood") {
        std::fprintf(stderr, "hostile_client: connect %d: %s\n", i,
                     std::strerror(-fd));
      }
      continue;
    }
    if (o.mode == "garbage") {
      SendAll(fd, random_bytes(4096));
    } else if (o.mode == "truncated") {
      SendAll(fd, request.substr(0, 5));
    } else if (o.mode == "absurd") {
      switch (i % 5) {
        case 0:  // a length far beyond any setup frame
          SendAll(fd, Frame(kRequest, random_bytes(32), 65535));
          break;
        case 1:  // an accept sent to a listener
          SendAll(fd, Frame(kAccept, ValidHandshake()));
          break;
        case 2:  // a handshake claiming 4 G credits and 16 EiB messages
          SendAll(fd, Frame(kRequest, AbsurdHandshake()));
          break;
        case 3:  // an unknown frame kind
          SendAll(fd, Frame(200, random_bytes(16)));
          break;
        case 4:  // a valid frame header announcing more than it sends
          SendAll(fd, Frame(kRequest, random_bytes(10), 400));
          break;
      }
      outcome["first answer: " + Observe(fd, 2000)]++;
    } else if (o.mode == "slow") {
      // Each socket gets one byte in turn below.
    } else if (o.mode == "silent") {
      // Nothing.
    } else if (o.mode == "accepted_silent") {
      SendAll(fd, request);
      outcome["first answer: " + Observe(fd, 5000)]++;
    } else if (o.mode == "flood") {
      SendAll(fd, random_bytes(64 + rng() % 256));
      close(fd);
      continue;
    } else {
      std::fprintf(stderr, "hostile_client: unknown --mode=%s\n",
                   o.mode.c_str());
      close(fd);
      return 2;
    }
    fds.push_back(fd);
  }
  if (o.mode == "slow") {
    // One byte per socket every 200 ms: a valid request that takes far
    // longer than any handshake deadline to arrive.
    auto until = std::chrono::steady_clock::now() + o.hold;
    size_t pos = 0;
    while (std::chrono::steady_clock::now() < until && pos < request.size()) {
      for (int fd : fds) send(fd, request.data() + pos, 1, MSG_NOSIGNAL);
      ++pos;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  std::printf(
      "hostile_client: mode %s, %d sockets opened, %d connects failed\n",
      o.mode.c_str(), o.count - dial_errors, dial_errors);
  std::fflush(stdout);
  if (!fds.empty()) HoldAndReport(fds, o, outcome);
  for (const auto& [what, n] : outcome) {
    std::printf("  %5d  %s\n", n, what.c_str());
  }
  return (dial_errors == o.count && o.count > 0) ? 1 : 0;
}

std::string ValidHandshake() {
  // cm/handshake.h: magic "CVB1", the current kProtocolVersion (a stale
  // one is refused before the peer could stay silent), app_data_len 0,
  // caps 0, credits 4, recv_buffer_size 8208, max_credits 4,
  // max_message_size 1 MiB.
  std::string h(32, '\0');
  auto put32 = [&h](size_t off, uint32_t v) {
    std::memcpy(h.data() + off, &v, 4);
  };
  auto put16 = [&h](size_t off, uint16_t v) {
    std::memcpy(h.data() + off, &v, 2);
  };
  put32(0, 0x31425643);
  put16(4, coverbs::cm::kProtocolVersion);
  put16(6, 0);
  put32(8, 0);
  put32(12, 4);
  put32(16, 8208);
  put32(20, 4);
  uint64_t max = 1 << 20;
  std::memcpy(h.data() + 24, &max, 8);
  return h;
}

std::string AbsurdHandshake() {
  std::string h = ValidHandshake();
  uint32_t credits = 0xffffffffu;
  std::memcpy(h.data() + 12, &credits, 4);
  std::memcpy(h.data() + 20, &credits, 4);
  uint64_t max = ~0ull;
  std::memcpy(h.data() + 24, &max, 8);
  return h;
}

}  // namespace hostile

int main(int argc, char** argv) {
  hostile::Options o;
  std::string err = hostile::ParseOptions(argc, argv, &o);
  if (!err.empty()) {
    std::fprintf(stderr, "hostile_client: %s\n%s", err.c_str(),
                 hostile::kUsage);
    return 2;
  }
  if (o.mode.rfind("cm_", 0) == 0) return hostile::RunRdmaCm(o);
  return hostile::RunTcp(o);
}
