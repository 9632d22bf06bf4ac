// coro_rpc (yalantinglibs) echo server and client, the reference that
// compare_coro_rpc.sh runs side by side with coverbs' examples/echo_server
// and echo_client. Not built by Bazel: the script compiles it against a
// yalantinglibs checkout given on its command line (header-only).
//
//   coro_rpc_echo server PORT THREADS
//   coro_rpc_echo client PORT SIZE CALLS DEPTH [CONNECTIONS]
//
// The server's THREADS io threads take the accepted connections in turn,
// each serving all of its own. The client mirrors echo_client: CONNECTIONS
// connections (default 1), all on one io thread, DEPTH calls in flight on
// each (a connection sends its next request while its oldest DEPTH-1
// await their responses), the CALLS calls going to whichever connection
// is ready for one (as echo_client's callers share one counter), each
// request distinct (the call index in its first 8 bytes), every echoed
// byte compared with the request, every call timed (steady clock, from
// send_request to its response in hand). It prints one line:
//   size=S calls=N errors=E seconds=T calls_per_s=R p50_us=A p99_us=B p999_us=C
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ylt/coro_rpc/coro_rpc_client.hpp>
#include <ylt/coro_rpc/coro_rpc_server.hpp>

std::string_view echo(std::string_view s) { return s; }

namespace {

using async_simple::coro::Lazy;
using Clock = std::chrono::steady_clock;
using Pending = Lazy<coro_rpc::async_rpc_result<std::string_view>>;

// Shared by the connections' drivers, which all run on the one io thread.
struct Totals {
  int64_t calls = 0;  // to make in all
  int64_t next = 0;   // the next call's index
  int64_t ok = 0, errors = 0;
  std::vector<int64_t> latency_ns;  // one per response (reserved: `calls`)
};

// The p-quantile (0..1) of `sorted` (nearest rank, as echo_client's); 0
// when empty.
int64_t Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  size_t rank = static_cast<size_t>(std::ceil(p * sorted.size()));
  if (rank == 0) rank = 1;
  return sorted[std::min(rank, sorted.size()) - 1];
}

// One connection's calls: DEPTH in flight, until the shared counter has
// given out every call.
Lazy<void> Drive(coro_rpc::coro_rpc_client& client, size_t size, int depth,
                 int connection, Totals* t) {
  // One request buffer per slot of the window, as echo_client's callers.
  std::vector<std::string> req(depth, std::string(size, '\0'));
  for (int w = 0; w < depth; ++w) {
    const size_t tag = static_cast<size_t>(connection) * depth + w;
    for (size_t i = 0; i < size; ++i) req[w][i] = static_cast<char>(tag * 131 + i * 7);
  }
  struct InFlight {
    Pending result;
    int slot;
    Clock::time_point sent;
  };
  std::deque<InFlight> window;
  auto finish = [&](InFlight& p) -> Lazy<void> {
    auto r = co_await std::move(p.result);
    const auto now = Clock::now();
    if (!r.has_value()) {
      if (t->errors++ == 0) std::fprintf(stderr, "coro_rpc_echo: %s\n", std::string(r.error().msg).c_str());
      co_return;
    }
    t->latency_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(now - p.sent).count());
    std::string_view got = r.value().result();
    const std::string& sent = req[p.slot];
    if (got.size() != sent.size() || std::memcmp(got.data(), sent.data(), got.size()) != 0) {
      if (t->errors++ == 0) std::fprintf(stderr, "coro_rpc_echo: echoed payload differs\n");
      co_return;
    }
    ++t->ok;
  };
  for (int64_t k = 0;; ++k) {
    if (static_cast<int>(window.size()) == depth) {
      co_await finish(window.front());
      window.pop_front();
    }
    if (t->next >= t->calls) break;
    const int64_t i = t->next++;
    // The oldest call, the slot's last user, has just been finished.
    const int slot = static_cast<int>(k % depth);
    std::string& b = req[slot];
    if (!b.empty()) std::memcpy(b.data(), &i, std::min(sizeof(i), b.size()));
    const auto sent_at = Clock::now();
    auto sent = co_await client.send_request<echo>(std::string_view(b));
    window.push_back(InFlight{std::move(sent), slot, sent_at});
  }
  while (!window.empty()) {
    co_await finish(window.front());
    window.pop_front();
  }
}

Lazy<int> Client(std::string port, size_t size, int64_t calls, int depth, int connections) {
  // Every connection on the same io thread, as echo_client's on its one
  // reactor.
  auto* executor = coro_io::get_global_executor();
  std::vector<std::unique_ptr<coro_rpc::coro_rpc_client>> clients;
  for (int c = 0; c < connections; ++c) {
    clients.push_back(std::make_unique<coro_rpc::coro_rpc_client>(executor));
    for (int attempt = 0;; ++attempt) {
      auto ec = co_await clients.back()->connect("127.0.0.1", port);
      if (!ec) break;
      if (attempt == 50) {
        std::fprintf(stderr, "coro_rpc_echo: connect to port %s: %s\n", port.c_str(),
                     std::string(ec.message()).c_str());
        co_return 1;
      }
      usleep(100 * 1000);
    }
  }
  Totals t;
  t.calls = calls;
  t.latency_ns.reserve(calls);
  std::vector<Lazy<void>> drives;
  for (int c = 0; c < connections; ++c) drives.push_back(Drive(*clients[c], size, depth, c, &t));
  const auto t0 = Clock::now();
  // Not Para: each driver starts here and runs until it first waits, all
  // on this thread.
  co_await async_simple::coro::collectAll(std::move(drives));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t errors = calls - t.ok;  // failed, differing or unanswered
  std::sort(t.latency_ns.begin(), t.latency_ns.end());
  auto us = [&](double p) { return Percentile(t.latency_ns, p) / 1000.0; };
  std::printf(
      "size=%zu calls=%lld errors=%lld seconds=%.6f calls_per_s=%.1f p50_us=%.1f "
      "p99_us=%.1f p999_us=%.1f\n",
      size, static_cast<long long>(calls), static_cast<long long>(errors), seconds,
      t.ok / std::max(seconds, 1e-9), us(0.50), us(0.99), us(0.999));
  co_return errors == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "server") {
    coro_rpc::coro_rpc_server server(std::atoi(argv[3]), std::atoi(argv[2]));
    server.register_handler<echo>();
    auto ec = server.start();  // runs until the process is killed
    std::fprintf(stderr, "coro_rpc_echo: server: %s\n", std::string(ec.message()).c_str());
    return 1;
  }
  if ((argc == 6 || argc == 7) && std::string(argv[1]) == "client") {
    const int64_t calls = std::atoll(argv[4]);
    const int depth = std::atoi(argv[5]);
    const int connections = argc == 7 ? std::atoi(argv[6]) : 1;
    if (calls < 1 || calls > (int64_t{1} << 28) || depth < 1 || connections < 1 ||
        connections > 1024) {
      std::fprintf(stderr, "coro_rpc_echo: CALLS 1..2^28, DEPTH >= 1, CONNECTIONS 1..1024\n");
      return 2;
    }
    return async_simple::coro::syncAwait(
        Client(argv[2], std::strtoull(argv[3], nullptr, 10), calls, depth, connections));
  }
  std::fprintf(stderr,
               "usage: coro_rpc_echo server PORT THREADS\n"
               "       coro_rpc_echo client PORT SIZE CALLS DEPTH [CONNECTIONS]\n");
  return 2;
}
