// scope_server: the server of scope_test.sh (issue 27, point 4). Each
// connection that asks for a token gets a region of its own, filled with
// the pattern of its serial number and exposed to that connection alone
// (rpc::Context::Expose: a type-2 window bound to its QP). A victim and an
// attacker, separate scope_client processes, then call its methods
// (tests/hostile/scope.h) and attack each other's memory; the server
// checks on request that no region's bytes changed.
//
//   scope_server --provider=soft --address=127.0.0.1 --port=0 \
//     --port_file=/tmp/port
//
// One reactor, one cm::Worker: every connection is in one protection
// domain, as the attacks need (keys of another PD fail whatever the scope).
// SIGUSR1 prints the counters (connections, closes by cause); SIGTERM
// ends it. --expose_scope=pd hands out the region's PD-wide rkey instead:
// only to see that scope_test.sh fails when exposures are not scoped.
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "examples/common.h"
#include "rpc/server.h"
#include "tests/hostile/scope.h"

ABSL_FLAG(std::string, provider, "soft", "verbs or soft");
ABSL_FLAG(std::string, device, "", "verbs: the device; empty: the first");
ABSL_FLAG(std::string, address, "127.0.0.1", "address to listen on");
ABSL_FLAG(uint16_t, port, 0, "port; 0: any (written to --port_file)");
ABSL_FLAG(std::string, port_file, "", "where to write the port");
ABSL_FLAG(absl::Duration, accept_timeout, absl::Seconds(5),
          "a peer's handshake must finish within this long");
ABSL_FLAG(std::string, expose_scope, "connection",
          "connection (the default, what the test asserts) or pd (the "
          "region's own rkey: to see the test fail without scoping)");

namespace coverbs::scope_test {
namespace {

using ::scope::kRegionBytes;

// The regions ever made, for kCheck. std::mutex, not absl::Mutex: Debian's
// prebuilt absl is not instrumented for ThreadSanitizer (the handlers run
// on the reactor, SIGUSR1's report on the main thread).
struct Region {
  uint64_t tag;
  std::shared_ptr<std::vector<std::byte>> bytes;
};

class ScopeService {
 public:
  explicit ScopeService(bool pd_scope) : pd_scope_(pd_scope) {}

  absl::Status Register(rpc::Server& server) {
    absl::Status s = server.Register(
        ::scope::kToken,
        [this](rpc::Context& ctx, int32_t) { return Token(ctx); });
    if (s.ok()) {
      s = server.Register(::scope::kRevoke,
                          [](rpc::Context& ctx, RemoteRegion token)
                              -> Task<absl::StatusOr<int32_t>> {
                            absl::Status r = ctx.connection().Revoke(token);
                            std::printf("scope_server: Revoke(rkey 0x%x) from %s: %s\n",
                                        token.rkey, ctx.peer_address().c_str(),
                                        r.ToString().c_str());
                            std::fflush(stdout);
                            if (!r.ok()) co_return r;
                            co_return 0;
                          });
    }
    if (s.ok()) {
      s = server.Register(::scope::kCheck,
                          [this](int32_t) -> Task<absl::StatusOr<uint64_t>> {
                            co_return Check();
                          });
    }
    if (s.ok()) {
      s = server.Register(::scope::kPing,
                          [](int32_t x) -> Task<absl::StatusOr<int32_t>> {
                            co_return x;
                          });
    }
    if (s.ok()) {
      s = server.Register(::scope::kLarge,
                          [](std::span<const std::byte> in)
                              -> Task<absl::StatusOr<uint64_t>> {
                            co_return ::scope::LargeMismatches(in);
                          });
    }
    return s;
  }

 private:
  // The connection's region (made on its first call), exposed anew.
  Task<absl::StatusOr<RemoteRegion>> Token(rpc::Context& ctx) {
    cm::Connection* conn = &ctx.connection();
    std::shared_ptr<transport::MemoryRegion> mr;
    uint64_t tag = 0;
    {
      std::lock_guard lock(mu_);
      auto it = by_conn_.find(conn);
      if (it != by_conn_.end()) {
        mr = it->second.mr;
        tag = it->second.tag;
      }
    }
    if (mr == nullptr) {
      auto bytes = std::make_shared<std::vector<std::byte>>(kRegionBytes);
      tag = ++serial_;
      ::scope::Fill(*bytes, tag);
      // Local access only (cm::Connection::Expose): a region registered
      // with remote access would have a PD-wide rkey of its own besides
      // the window. --expose_scope=pd needs that rkey.
      int access = IBV_ACCESS_LOCAL_WRITE;
      if (pd_scope_) access |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
      auto reg = ctx.connection().worker().pd().Register(bytes->data(),
                                                         bytes->size(), access);
      if (!reg.ok()) co_return reg.status();
      mr = std::make_shared<transport::MemoryRegion>(*std::move(reg));
      {
        std::lock_guard lock(mu_);
        by_conn_[conn] = {tag, mr};
        regions_.push_back({tag, bytes});
      }
      // Released when the connection has closed, newest first: the
      // registration, then (the memory stays in regions_ for kCheck) the
      // entry of this connection, whose address a later one may reuse.
      ctx.KeepUntilClose(std::shared_ptr<void>(
          new int, [this, conn](int* p) {
            delete p;
            std::lock_guard lock(mu_);
            by_conn_.erase(conn);
          }));
      ctx.KeepUntilClose(mr);
    }
    absl::StatusOr<RemoteRegion> token =
        pd_scope_ ? ctx.connection().Expose(
                        *mr, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, 0,
                        transport::MemoryRegion::npos,
                        cm::ExposeScope::kProtectionDomain)
                  : ctx.Expose(*mr, transport::Access::kRemoteRead |
                                        transport::Access::kRemoteWrite);
    if (token.ok()) {
      std::printf("scope_server: region %llu exposed to %s: addr 0x%llx rkey 0x%x\n",
                  static_cast<unsigned long long>(tag), ctx.peer_address().c_str(),
                  static_cast<unsigned long long>(token->addr), token->rkey);
    } else {
      std::printf("scope_server: region %llu: Expose refused: %s\n",
                  static_cast<unsigned long long>(tag),
                  token.status().ToString().c_str());
    }
    std::fflush(stdout);
    co_return token;
  }

  uint64_t Check() {
    std::lock_guard lock(mu_);
    uint64_t bad = 0;
    for (const Region& r : regions_) {
      const uint64_t n = ::scope::Mismatches(*r.bytes, r.tag);
      if (n != 0) {
        std::printf("scope_server: region %llu: %llu byte(s) changed\n",
                    static_cast<unsigned long long>(r.tag),
                    static_cast<unsigned long long>(n));
      }
      bad += n;
    }
    std::printf("scope_server: check: %zu region(s), %llu mismatch(es)\n",
                regions_.size(), static_cast<unsigned long long>(bad));
    std::fflush(stdout);
    return bad;
  }

  struct ConnRegion {
    uint64_t tag;
    std::shared_ptr<transport::MemoryRegion> mr;
  };
  const bool pd_scope_;
  std::mutex mu_;
  uint64_t serial_ = 0;  // the reactor's only
  std::map<const cm::Connection*, ConnRegion> by_conn_;  // mu_
  std::vector<Region> regions_;                          // mu_
};

void PrintStats(const rpc::Server& server) {
  rpc::Server::Stats st = server.stats();
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::string closes;
  for (size_t i = 1; i < cm::kCloseCauses; ++i) {
    if (st.closed_by_cause[i] == 0) continue;
    absl::StrAppend(&closes, closes.empty() ? "" : ", ", st.closed_by_cause[i],
                    " ", cm::CloseCauseName(static_cast<cm::CloseCause>(i)));
  }
  std::printf("scope_server: served %llu call(s) on %llu connection(s) (%llu "
              "open, %llu refused); %llu failed; connections ended: %s\n",
              u(st.calls), u(st.connections), u(st.open_connections),
              u(st.rejected_connections), u(st.failed_calls),
              closes.empty() ? "none" : closes.c_str());
  std::fflush(stdout);
}

int Run() {
  const std::string scope = absl::GetFlag(FLAGS_expose_scope);
  if (scope != "connection" && scope != "pd") {
    std::fprintf(stderr, "scope_server: --expose_scope must be connection or pd\n");
    return 2;
  }
  if (!examples::CheckProviderFlag("scope_server", absl::GetFlag(FLAGS_provider)) ||
      !examples::CheckOutputFileFlag("scope_server", "port_file",
                                     absl::GetFlag(FLAGS_port_file))) {
    return 2;
  }
  auto device = examples::OpenDevice(absl::GetFlag(FLAGS_provider),
                                     absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "scope_server: %s\n", device.status().ToString().c_str());
    return 1;
  }
  auto workers = cm::WorkerPool::Create(**device);  // one reactor, one PD
  if (!workers.ok()) {
    std::fprintf(stderr, "scope_server: %s\n", workers.status().ToString().c_str());
    return 1;
  }
  rpc::ServerOptions options;
  options.listener.accept_timeout = absl::GetFlag(FLAGS_accept_timeout);
  auto server = std::make_unique<rpc::Server>(options);
  ScopeService service(scope == "pd");
  absl::Status s = service.Register(*server);
  if (s.ok()) {
    s = server->Start(**workers, absl::GetFlag(FLAGS_address), absl::GetFlag(FLAGS_port));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "scope_server: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("scope_server: listening on %s:%u, provider %s, expose scope %s\n",
              absl::GetFlag(FLAGS_address).c_str(), server->port(),
              (*device)->Describe().c_str(), scope.c_str());
  std::fflush(stdout);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    // Write then rename: a script polling for the file never reads half.
    const std::string tmp = f + ".tmp";
    std::ofstream out(tmp);
    out << server->port() << "\n";
    out.close();
    if (out.fail() || std::rename(tmp.c_str(), f.c_str()) != 0) {
      std::fprintf(stderr, "scope_server: cannot write %s: %s\n", f.c_str(),
                   std::strerror(errno));
      server->Shutdown();
      return 1;
    }
  }
  for (;;) {
    const int sig = examples::WaitForSignal(absl::InfiniteDuration(),
                                            /*stats_signal=*/true);
    if (sig == SIGUSR1) {
      PrintStats(*server);
      continue;
    }
    if (sig != 0) break;
  }
  server->Shutdown();
  PrintStats(*server);
  server.reset();
  workers->reset();
  return 0;
}

}  // namespace
}  // namespace coverbs::scope_test

int main(int argc, char** argv) {
  // Before any thread exists, so that the reactor inherits the mask.
  coverbs::examples::BlockTerminationSignals();
  absl::SetProgramUsageMessage(
      "The server of tests/hostile/scope_test.sh: a region per connection, "
      "exposed to it alone.");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::scope_test::Run();
}
