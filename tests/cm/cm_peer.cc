// A peer process for cm_test's cases with a peer that dies or freezes:
//   cm_peer <provider> <address> <port> [idle]
// Connects, sends "ready", then starts a 64 MiB message and waits to be
// killed while the rendezvous is in flight; with "idle", sends nothing more
// and waits (to be stopped with SIGSTOP, then killed).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "transport/device.h"

namespace {

coverbs::Task<int> Main(coverbs::cm::Worker* ctx, std::string addr,
                        uint16_t port, bool idle) {
  auto c = co_await coverbs::cm::Connect(*ctx, addr, port);
  if (!c.ok()) {
    std::fprintf(stderr, "cm_peer: %s\n", c.status().ToString().c_str());
    co_return 1;
  }
  std::string ready = "ready";
  auto s = co_await (*c)->Send(std::as_bytes(std::span(ready.data(), 5)));
  if (!s.ok()) co_return 2;
  if (idle) {
    co_await coverbs::Reactor::Current()->Sleep(absl::Seconds(60));
    co_return 0;
  }
  std::vector<std::byte> big(64 << 20, std::byte{0x42});
  s = co_await (*c)->Send(big);
  // Normally killed before getting here.
  co_await coverbs::Reactor::Current()->Sleep(absl::Seconds(60));
  co_return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && !(argc == 5 && std::string(argv[4]) == "idle")) {
    std::fprintf(stderr, "usage: cm_peer <provider> <address> <port> [idle]\n");
    return 2;
  }
  auto r = coverbs::Reactor::Create();
  if (!r.ok()) return 3;
  coverbs::transport::ProviderOptions o;
  auto kind = coverbs::transport::ParseProviderKind(argv[1]);
  if (!kind.ok()) return 2;
  o.kind = *kind;
  auto d = coverbs::transport::Device::Open(o);
  if (!d.ok()) return 4;
  auto ctx = coverbs::cm::Worker::Create(**r, **d);
  if (!ctx.ok()) return 5;
  return (*r)->BlockOn(
      Main(ctx->get(), argv[2], static_cast<uint16_t>(std::atoi(argv[3])),
           argc == 5));
}
