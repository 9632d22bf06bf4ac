// coro_rpc (yalantinglibs) echo server and client, the reference that
// compare_coro_rpc.sh runs side by side with coverbs' examples/echo_server
// and echo_client. Not built by Bazel: the script compiles it against a
// yalantinglibs checkout given on its command line (header-only).
//
//   coro_rpc_echo server PORT THREADS
//   coro_rpc_echo client PORT SIZE CALLS DEPTH
//
// The client mirrors echo_client: one connection, DEPTH calls in flight
// (send the next request while the oldest DEPTH-1 await their responses),
// each request distinct (the call index in its first 8 bytes), every echoed
// byte compared with the request. It prints one line:
//   size=S calls=N errors=E seconds=T calls_per_s=R
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ylt/coro_rpc/coro_rpc_client.hpp>
#include <ylt/coro_rpc/coro_rpc_server.hpp>

std::string_view echo(std::string_view s) { return s; }

namespace {

using async_simple::coro::Lazy;
using Pending = Lazy<coro_rpc::async_rpc_result<std::string_view>>;

struct Totals {
  int64_t ok = 0, errors = 0;
  double seconds = 0;
};

Lazy<void> Drive(coro_rpc::coro_rpc_client& client, size_t size, int64_t calls,
                 int depth, Totals* t) {
  // One request buffer per slot of the window, as echo_client's callers.
  std::vector<std::string> req(depth, std::string(size, '\0'));
  for (int w = 0; w < depth; ++w) {
    for (size_t i = 0; i < size; ++i) req[w][i] = static_cast<char>(w * 131 + i * 7);
  }
  std::deque<std::pair<Pending, int>> window;
  auto finish = [&](std::pair<Pending, int>& p) -> Lazy<void> {
    auto r = co_await std::move(p.first);
    if (!r.has_value()) {
      if (t->errors++ == 0) std::fprintf(stderr, "coro_rpc_echo: %s\n", std::string(r.error().msg).c_str());
      co_return;
    }
    std::string_view got = r.value().result();
    const std::string& sent = req[p.second];
    if (got.size() != sent.size() || std::memcmp(got.data(), sent.data(), got.size()) != 0) {
      if (t->errors++ == 0) std::fprintf(stderr, "coro_rpc_echo: echoed payload differs\n");
      co_return;
    }
    ++t->ok;
  };
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    if (static_cast<int>(window.size()) == depth) {
      co_await finish(window.front());
      window.pop_front();
    }
    const int slot = static_cast<int>(i % depth);
    std::string& b = req[slot];
    if (!b.empty()) std::memcpy(b.data(), &i, std::min(sizeof(i), b.size()));
    auto sent = co_await client.send_request<echo>(std::string_view(b));
    window.emplace_back(std::move(sent), slot);
  }
  while (!window.empty()) {
    co_await finish(window.front());
    window.pop_front();
  }
  t->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Lazy<int> Client(std::string port, size_t size, int64_t calls, int depth) {
  coro_rpc::coro_rpc_client client;
  for (int attempt = 0;; ++attempt) {
    auto ec = co_await client.connect("127.0.0.1", port);
    if (!ec) break;
    if (attempt == 50) {
      std::fprintf(stderr, "coro_rpc_echo: connect to port %s: %s\n", port.c_str(),
                   std::string(ec.message()).c_str());
      co_return 1;
    }
    usleep(100 * 1000);
  }
  Totals t;
  co_await Drive(client, size, calls, depth, &t);
  std::printf("size=%zu calls=%lld errors=%lld seconds=%.6f calls_per_s=%.1f\n", size,
              static_cast<long long>(calls), static_cast<long long>(t.errors), t.seconds,
              t.ok / std::max(t.seconds, 1e-9));
  co_return t.errors == 0 ? 0 : 1;
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
  if (argc == 6 && std::string(argv[1]) == "client") {
    return async_simple::coro::syncAwait(
        Client(argv[2], std::strtoull(argv[3], nullptr, 10), std::atoll(argv[4]),
               std::atoi(argv[5])));
  }
  std::fprintf(stderr,
               "usage: coro_rpc_echo server PORT THREADS\n"
               "       coro_rpc_echo client PORT SIZE CALLS DEPTH\n");
  return 2;
}
