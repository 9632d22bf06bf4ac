// tcp_echo: a plain TCP echo with the same framing and pipelining as
// coverbs' echo RPC, the always-available reference that
// compare_coro_rpc.sh runs side by side with examples/echo_server +
// echo_client (and coro_rpc when a yalantinglibs checkout is at hand). Same
// command line and output as coro_rpc/coro_rpc_echo.cpp:
//
//   tcp_echo server PORT THREADS   (PORT 0: any; prints "port=N")
//   tcp_echo client PORT SIZE CALLS DEPTH [CONNECTIONS]
//
// A frame is a 12-byte header (payload length, 4 bytes little-endian; call
// id, 8 bytes) and the payload. The server writes every complete frame back
// unchanged, its THREADS threads serving any number of connections. The
// client opens CONNECTIONS connections (default 1) and, from one thread,
// keeps DEPTH calls in flight on each (a connection's next request goes out
// once its oldest response is in; the calls go to whichever connection has
// room), puts the call index in the first 8 payload bytes, checks every
// echoed byte, times every call (steady clock, from the request queued for
// its writev to the read that completed its response) and prints one line:
//   size=S calls=N errors=E seconds=T calls_per_s=R p50_us=A p99_us=B p999_us=C
// Exit status: 0, 1 on errors, 2 for bad arguments.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kHeader = 12;
constexpr size_t kMaxPayload = size_t{256} << 20;
// Read granularity of both ends: large enough that one read takes a whole
// window of small frames, small enough to stay in cache.
constexpr size_t kChunk = 256 << 10;

// Little-endian on the wire whatever the host (the framing is the format).
void PutLe(char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= w;
  }
  return true;
}

// One connection of the server: its unanswered bytes are buf[begin, end),
// the frame at `begin` needs `need` bytes in all.
struct Peer {
  explicit Peer(int f) : fd(f) {}
  int fd;
  std::vector<char> buf = std::vector<char>(kChunk);
  size_t begin = 0, end = 0, need = kHeader;
};

// One read on a blocking socket, then every complete frame in what is
// unanswered written back with one write; the partial tail is kept. A
// blocking write stalls reading, which is TCP's own back-pressure; the
// client never stops reading. false: the connection is done (closed by the
// peer, an error, a bad frame). A read that times out (SO_RCVTIMEO) is
// not an error.
bool Echo(Peer& p) {
  // Make room for the pending frame (moving the tail only when the buffer
  // has no room left at its end, so a large frame is not moved per read).
  if (p.buf.size() - p.begin < p.need || p.end == p.buf.size()) {
    std::memmove(p.buf.data(), p.buf.data() + p.begin, p.end - p.begin);
    p.end -= p.begin;
    p.begin = 0;
    if (p.buf.size() < p.need) p.buf.resize(p.need);
  }
  ssize_t r = read(p.fd, p.buf.data() + p.end, p.buf.size() - p.end);
  if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
    return true;
  }
  if (r <= 0) return false;
  p.end += r;
  size_t done = p.begin;
  for (;;) {
    if (p.end - done < kHeader) {
      p.need = kHeader;
      break;
    }
    uint64_t len = GetLe(p.buf.data() + done, 4);
    if (len > kMaxPayload) {
      std::fprintf(stderr, "tcp_echo: frame of %llu bytes, closing\n",
                   static_cast<unsigned long long>(len));
      return false;
    }
    p.need = kHeader + len;
    if (p.end - done < p.need) break;
    done += p.need;
  }
  if (done > p.begin &&
      !WriteAll(p.fd, p.buf.data() + p.begin, done - p.begin)) {
    return false;
  }
  p.begin = done;
  if (p.begin == p.end) p.begin = p.end = 0;
  return true;
}

// A server thread and the connections the acceptor handed it.
struct Worker {
  std::mutex mu;
  std::vector<int> handed;  // accepted, not taken yet
  std::atomic<bool> pending{false};
  int wake[2] = {-1, -1};  // pipe: a byte per handed connection wakes poll
};

// How long a thread serving one connection blocks in read before it looks
// for another handed to it (while that connection is busy it looks after
// every read).
constexpr int kHandOffMs = 10;

// A thread with one connection reads it directly, blocking: one read and
// one write per batch, no poll in between (the shape the comparison
// usually runs). With several it polls them all (and its wake pipe) and
// serves every readable one in turn.
void Work(Worker* w) {
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<pollfd> pfds;
  for (;;) {
    if (w->pending.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(w->mu);
      for (int fd : w->handed) peers.push_back(std::make_unique<Peer>(fd));
      w->handed.clear();
      w->pending.store(false, std::memory_order_relaxed);
    }
    if (peers.size() == 1) {
      if (!Echo(*peers[0])) {
        close(peers[0]->fd);
        peers.clear();
      }
      continue;
    }
    pfds.assign(1, pollfd{w->wake[0], POLLIN, 0});
    for (auto& p : peers) pfds.push_back(pollfd{p->fd, POLLIN, 0});
    if (poll(pfds.data(), pfds.size(), -1) <= 0) continue;
    if (pfds[0].revents != 0) {
      char b[64];
      while (read(w->wake[0], b, sizeof(b)) > 0) {
      }
    }
    // Back to front, so that erasing one keeps the indices of the rest.
    for (size_t i = peers.size(); i-- > 0;) {
      if (pfds[i + 1].revents == 0) continue;
      if (!Echo(*peers[i])) {
        close(peers[i]->fd);
        peers.erase(peers.begin() + static_cast<ptrdiff_t>(i));
      }
    }
  }
}

int Server(int port, int threads) {
  signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return
  // SIGTERM and SIGINT go to sigwait below, never to a worker thread.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(port);
  socklen_t sl = sizeof(sa);
  if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      listen(l, 128) != 0 ||
      getsockname(l, reinterpret_cast<sockaddr*>(&sa), &sl) != 0) {
    std::fprintf(stderr, "tcp_echo: listen on 127.0.0.1:%d: %s\n", port,
                 std::strerror(errno));
    return 1;
  }
  // THREADS threads, the accepted connections handed to them in turn (as
  // coro_rpc's io threads and coverbs' reactors take theirs); each thread
  // serves all of its connections. They live until the process ends.
  auto* workers = new std::vector<std::unique_ptr<Worker>>();
  for (int t = 0; t < threads; ++t) {
    auto w = std::make_unique<Worker>();
    if (pipe2(w->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      std::fprintf(stderr, "tcp_echo: pipe: %s\n", std::strerror(errno));
      return 1;
    }
    std::thread(Work, w.get()).detach();
    workers->push_back(std::move(w));
  }
  std::printf("port=%d\n", ntohs(sa.sin_port));
  std::fflush(stdout);
  std::thread([l, workers] {
    for (size_t next = 0;;) {
      int c = accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) {  // e.g. out of descriptors: retry, but do not spin
        usleep(1000);
        continue;
      }
      NoDelay(c);
      timeval tv{0, kHandOffMs * 1000};
      setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      Worker& w = *(*workers)[next++ % workers->size()];
      {
        std::lock_guard<std::mutex> g(w.mu);
        w.handed.push_back(c);
        w.pending.store(true, std::memory_order_release);
      }
      char b = 0;
      (void)!write(w.wake[1], &b, 1);
    }
  }).detach();
  int sig = 0;
  sigwait(&stop, &sig);
  // The workers hold nothing that must be finished (an echo keeps no
  // state), so end the process without waking them.
  std::fflush(nullptr);
  std::_Exit(0);
}

// The p-quantile (0..1) of `sorted` (nearest rank, as echo_client's); 0
// when empty.
int64_t Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  size_t rank = static_cast<size_t>(std::ceil(p * sorted.size()));
  if (rank == 0) rank = 1;
  return sorted[std::min(rank, sorted.size()) - 1];
}

using Clock = std::chrono::steady_clock;

// One connection of the client. Its frames are numbered in the order it
// sends them: [received, sent) are written and unanswered, [sent, queued)
// have a call and a send time but are not (wholly) written yet; frame k
// uses slot k % DEPTH.
struct Line {
  int fd = -1;
  int64_t sent = 0, queued = 0, received = 0;
  size_t tx_off = 0, rx_off = 0;      // within frame `sent`, frame `received`
  bool rx_bad = false;                // frame `received` differs so far
  bool readable = false;              // the socket may have data to read
  std::vector<char> heads;            // per slot: header + first payload bytes
  std::vector<Clock::time_point> t0;  // per slot: when the call was queued
};

int Client(int port, size_t size, int64_t calls, int depth, int connections) {
  signal(SIGPIPE, SIG_IGN);
  const size_t frame = kHeader + size;
  const size_t head = kHeader + std::min<size_t>(8, size);  // varies per call
  // The payload after its first 8 bytes is the same in every call, so one
  // copy serves all sends and checks: memory does not grow with DEPTH. The
  // head of a call in flight stays in its slot until the response is in,
  // so each response is checked against the very request it answers.
  std::vector<char> pattern(size);
  for (size_t i = 0; i < size; ++i) pattern[i] = static_cast<char>(i * 7 + 131);
  auto make_head = [&](int64_t k, char* h) {
    PutLe(h, size, 4);
    PutLe(h + 4, k, 8);
    PutLe(h + kHeader, k, static_cast<int>(head - kHeader));
  };

  std::vector<Line> lines(connections);
  for (Line& c : lines) {
    c.heads.resize(static_cast<size_t>(depth) * head);
    c.t0.resize(depth);
    c.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(port);
    if (c.fd < 0 ||
        connect(c.fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      std::fprintf(stderr, "tcp_echo: connect to port %d: %s\n", port,
                   std::strerror(errno));
      return 1;
    }
    NoDelay(c.fd);
    // Non-blocking: with DEPTH large frames in flight neither socket buffer
    // holds a window, so the client must read while its writes are pending.
    fcntl(c.fd, F_SETFL, fcntl(c.fd, F_GETFL) | O_NONBLOCK);
  }

  // Calls go to whichever connection has room in its window (as
  // echo_client's callers share one counter), all from this one thread.
  int64_t next = 0, received = 0, bad = 0;  // bad: echoes that differ
  std::vector<int64_t> latency_ns;  // one per response, from queued to read
  latency_ns.reserve(calls);
  std::vector<char> rbuf(kChunk);
  std::vector<iovec> iov;
  std::vector<pollfd> pfds(connections);
  bool lost = false;
  auto t0 = Clock::now();
  while (received < calls && !lost) {
    bool readable = false;
    for (Line& c : lines) {
      if (c.readable) {
        ssize_t r = read(c.fd, rbuf.data(), rbuf.size());
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
          std::fprintf(stderr,
                       "tcp_echo: connection lost after %lld responses\n",
                       static_cast<long long>(received));
          lost = true;
          break;
        }
        // A short read drained the socket: poll before reading again.
        c.readable = r == static_cast<ssize_t>(rbuf.size());
        const Clock::time_point now =
            r > 0 ? Clock::now() : Clock::time_point{};
        // Compare what arrived with the request it answers, piece by piece:
        // the call-specific head (in its slot), then the shared pattern.
        for (size_t at = 0; r > 0 && at < static_cast<size_t>(r);) {
          size_t n = std::min<size_t>(r - at, frame - c.rx_off);
          const char* p = rbuf.data() + at;  // p[0] is frame byte rx_off
          const size_t slot = static_cast<size_t>(c.received % depth);
          const char* h = c.heads.data() + slot * head;
          for (size_t o = c.rx_off; o < c.rx_off + n;) {
            const char* want =
                o < head ? h + o : pattern.data() + (o - kHeader);
            size_t m = std::min(c.rx_off + n, o < head ? head : frame) - o;
            c.rx_bad |= std::memcmp(p + (o - c.rx_off), want, m) != 0;
            o += m;
          }
          at += n;
          c.rx_off += n;
          if (c.rx_off < frame) continue;
          if (c.rx_bad && bad++ == 0) {
            std::fprintf(stderr,
                         "tcp_echo: response %lld differs from its request\n",
                         static_cast<long long>(received));
          }
          latency_ns.push_back(
              std::chrono::duration_cast<std::chrono::nanoseconds>(now -
                                                                   c.t0[slot])
                  .count());
          ++c.received;
          ++received;
          c.rx_off = 0;
          c.rx_bad = false;
        }
      }
      // Give the window's free slots their calls, then send everything
      // unsent in one writev.
      if (c.queued < c.received + depth && next < calls) {
        const Clock::time_point now = Clock::now();
        for (; c.queued < c.received + depth && next < calls; ++c.queued) {
          const size_t slot = static_cast<size_t>(c.queued % depth);
          make_head(next++, c.heads.data() + slot * head);
          c.t0[slot] = now;
        }
      }
      iov.clear();
      for (int64_t k = c.sent; k < c.queued && iov.size() + 2 <= IOV_MAX; ++k) {
        char* h = c.heads.data() + (k % depth) * head;
        size_t skip = k == c.sent ? c.tx_off : 0;
        if (skip < head) iov.push_back({h + skip, head - skip});
        skip = std::max(skip, head) - kHeader;
        if (skip < size) iov.push_back({pattern.data() + skip, size - skip});
      }
      if (!iov.empty()) {
        ssize_t w = writev(c.fd, iov.data(), static_cast<int>(iov.size()));
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
          std::fprintf(stderr, "tcp_echo: write: %s\n", std::strerror(errno));
          lost = true;
          break;
        }
        for (size_t left = w > 0 ? w : 0; left > 0;) {
          size_t n = std::min(left, frame - c.tx_off);
          left -= n;
          c.tx_off += n;
          if (c.tx_off == frame) ++c.sent, c.tx_off = 0;
        }
      }
      readable |= c.readable;
    }
    if (readable || lost) continue;
    if (received == calls) break;  // the last response is in
    // Wait to read, and to write too where the window has unsent bytes.
    for (int i = 0; i < connections; ++i) {
      const bool unsent = lines[i].sent < lines[i].queued;
      pfds[i] = pollfd{lines[i].fd,
                       static_cast<short>(POLLIN | (unsent ? POLLOUT : 0)), 0};
    }
    int ready = poll(pfds.data(), pfds.size(), 30000);
    if (ready == 0) {
      std::fprintf(stderr, "tcp_echo: no progress in 30 s\n");
      break;
    }
    for (int i = 0; i < connections; ++i) {
      lines[i].readable =
          ready > 0 && (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    }
  }
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t errors = bad + (calls - received);  // unanswered calls count
  std::sort(latency_ns.begin(), latency_ns.end());
  auto us = [&](double p) { return Percentile(latency_ns, p) / 1000.0; };
  std::printf(
      "size=%zu calls=%lld errors=%lld seconds=%.6f calls_per_s=%.1f "
      "p50_us=%.1f p99_us=%.1f p999_us=%.1f\n",
      size, static_cast<long long>(calls), static_cast<long long>(errors),
      seconds, (received - bad) / std::max(seconds, 1e-9), us(0.50), us(0.99),
      us(0.999));
  for (Line& c : lines) close(c.fd);
  return errors == 0 ? 0 : 1;
}

bool ParseInt(const char* s, long long lo, long long hi, long long* v) {
  char* e = nullptr;
  errno = 0;
  *v = std::strtoll(s, &e, 10);
  return errno == 0 && e != s && *e == '\0' && *v >= lo && *v <= hi;
}

}  // namespace

int main(int argc, char** argv) {
  long long port = 0, a = 0, b = 0, c = 0, d = 1;
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "server" && argc == 4 && ParseInt(argv[2], 0, 65535, &port) &&
      ParseInt(argv[3], 1, 1024, &a)) {
    return Server(static_cast<int>(port), static_cast<int>(a));
  }
  // CALLS is bounded so that one latency sample per call (8 bytes each,
  // allocated up front) fits in memory.
  if (mode == "client" && (argc == 6 || argc == 7) &&
      ParseInt(argv[2], 1, 65535, &port) &&
      ParseInt(argv[3], 0, INT64_MAX, &a) &&
      ParseInt(argv[4], 1, int64_t{1} << 28, &b) &&
      ParseInt(argv[5], 1, 1 << 20, &c) &&
      (argc == 6 || ParseInt(argv[6], 1, 1024, &d))) {
    if (static_cast<unsigned long long>(a) > kMaxPayload) {
      std::fprintf(stderr, "tcp_echo: SIZE %lld is over the 256 MiB limit\n",
                   a);
      return 2;
    }
    return Client(static_cast<int>(port), a, b, static_cast<int>(c),
                  static_cast<int>(d));
  }
  std::fprintf(stderr,
               "usage: tcp_echo server PORT THREADS\n"
               "       tcp_echo client PORT SIZE CALLS DEPTH [CONNECTIONS]\n");
  return 2;
}
