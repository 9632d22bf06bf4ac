// The server process that rpc_test's "server killed during calls" case and
// busy_handler_test fork, exec and kill:
//   rpc_server_peer <provider> <address> <fd>
// Serves on one reactor, on a port it writes, as decimal text, to file
// descriptor <fd>, then waits to be killed (at most 120 s):
//   "Echo":  the request back.
//   "Hang":  never answers; honours cancellation.
//   "Block": blocks its reactor thread for the milliseconds the request
//            names (decimal text), then answers "done" -- a careless service.
//   "Burn":  copies 64 MiB back and forth (memcpy) for the milliseconds the
//            request names, on its reactor, then answers "done".
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cm/worker.h"
#include "core/reactor.h"
#include "rpc/server.h"
#include "transport/device.h"

namespace {

int Millis(const coverbs::rpc::Request& req) {
  std::string text(reinterpret_cast<const char*>(req.payload.data().data()),
                   req.payload.data().size());
  return std::atoi(text.c_str());
}

coverbs::rpc::Payload Done() {
  return coverbs::rpc::Payload::Copy(std::string_view("done"));
}

coverbs::Task<int> Main(coverbs::rpc::Server* server, coverbs::cm::Worker* ctx,
                        std::string addr, int fd) {
  absl::Status s = server->Start({ctx}, addr, 0);
  if (!s.ok()) {
    std::fprintf(stderr, "rpc_server_peer: %s\n", s.ToString().c_str());
    co_return 1;
  }
  std::string port = std::to_string(server->port()) + "\n";
  if (write(fd, port.data(), port.size()) != static_cast<ssize_t>(port.size())) {
    co_return 2;
  }
  close(fd);
  (void)co_await coverbs::Reactor::Current()->Sleep(absl::Seconds(120));
  co_await server->ShutdownAsync();
  co_return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: rpc_server_peer <provider> <address> <fd>\n");
    return 2;
  }
  auto r = coverbs::Reactor::Create();
  if (!r.ok()) return 3;
  coverbs::transport::ProviderOptions o;
  auto kind = coverbs::transport::ParseProviderKind(argv[1]);
  if (!kind.ok()) return 2;
  o.kind = *kind;
  if (const char* dev = std::getenv("COVERBS_VM_DEV");
      dev && o.kind == coverbs::transport::ProviderKind::kVerbs) {
    o.device = dev;
  }
  auto d = coverbs::transport::Device::Open(o);
  if (!d.ok()) return 4;
  auto ctx = coverbs::cm::Worker::Create(**r, **d);
  if (!ctx.ok()) return 5;
  coverbs::rpc::Server server;
  absl::Status reg = server.Register(
      "Echo", [](coverbs::rpc::Request req)
                  -> coverbs::Task<absl::StatusOr<coverbs::rpc::Payload>> {
        co_return std::move(req.payload);
      });
  if (!reg.ok()) return 6;
  reg = server.Register(
      "Hang", [](coverbs::rpc::Request)
                  -> coverbs::Task<absl::StatusOr<coverbs::rpc::Payload>> {
        absl::Status s =
            co_await coverbs::Reactor::Current()->Sleep(absl::Seconds(120));
        if (!s.ok()) co_return s;
        co_return coverbs::rpc::Payload();
      });
  if (!reg.ok()) return 6;
  reg = server.Register(
      "Block", [](coverbs::rpc::Request req)
                   -> coverbs::Task<absl::StatusOr<coverbs::rpc::Payload>> {
        std::this_thread::sleep_for(std::chrono::milliseconds(Millis(req)));
        co_return Done();
      });
  if (!reg.ok()) return 6;
  reg = server.Register(
      "Burn", [](coverbs::rpc::Request req)
                  -> coverbs::Task<absl::StatusOr<coverbs::rpc::Payload>> {
        constexpr size_t kSize = size_t{64} << 20;
        std::vector<char> a(kSize, 'a');
        std::vector<char> b(kSize);
        auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(Millis(req));
        while (std::chrono::steady_clock::now() < until) {
          std::memcpy(b.data(), a.data(), kSize);
          std::memcpy(a.data(), b.data(), kSize);
        }
        co_return Done();
      });
  if (!reg.ok()) return 6;
  return (*r)->BlockOn(
      Main(&server, ctx->get(), argv[2], std::atoi(argv[3])));
}
