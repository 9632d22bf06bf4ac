// The two ways a program starts: a coroutine on one reactor (RunMain), or an
// RPC server on a pool of reactors until SIGINT/SIGTERM (Serve).
//
//   Task<absl::Status> Main(cm::Worker& worker) { ... }
//   int main() { return coverbs::RunMain(Main); }
//
//   int main() {
//     rpc::Server server;
//     ... server.Register("Echo", handler) ...
//     return coverbs::Serve(server, "127.0.0.1", 7471);
//   }
//
// Both open the device of ProviderOptions (a verbs RDMA device if present,
// else the soft provider; COVERBS_PROVIDER / COVERBS_DEVICE choose), and
// return the process exit code: 0 on success, 1 after logging what failed
// (through the library's log sink).
#ifndef COVERBS_COVERBS_RUN_H_
#define COVERBS_COVERBS_RUN_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "core/reactor.h"
#include "core/task.h"
#include "rpc/client_pool.h"
#include "rpc/server.h"
#include "transport/device.h"
#include "transport/provider.h"

namespace coverbs {

struct RunOptions {
  // The user's device (it must outlive RunMain); null: RunMain opens the
  // device `provider` names. The Worker's PD (worker.pd, or one the Worker
  // allocates) is main's worker.pd().
  transport::Device* device = nullptr;
  transport::ProviderOptions provider;
  ReactorOptions reactor;
  cm::WorkerOptions worker;
};

// Creates a reactor, opens the device, makes one cm::Worker and runs
// main(worker) to completion on that reactor (this thread). A non-OK status
// is logged and gives exit code 1.
//
// Teardown: main may return -- an error in the middle of its work, above
// all -- with connections open: an rpc::Client destroyed without Close,
// calls still in flight in tasks it spawned. RunMain then destroys the
// Worker (outside the loop), which fails them (UNAVAILABLE / CANCELLED for
// the calls), runs the loop until their tasks let go, and detaches what is
// still held (cm/worker.h); then the reactor, which destroys the tasks still
// suspended. No crash, exit code 1. Listeners main created must be gone
// when it returns.
int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main,
            const RunOptions& options);
int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main);

struct PoolRunOptions {
  size_t threads = 1;  // reactors (one cm::Worker each) the pool calls from
  // The user's device (it must outlive RunClientPool); null: it opens the
  // device `provider` names.
  transport::Device* device = nullptr;
  transport::ProviderOptions provider;
  ReactorOptions reactor;
  cm::WorkerOptions worker;
};

// A client program on an rpc::ClientPool: opens the device, starts a
// cm::WorkerPool of options.threads reactors and an rpc::ClientPool to
// pool_options.servers on it, runs main(pool) on the first reactor to
// completion, then shuts the pool down (calls main left in flight fail
// with UNAVAILABLE) and the reactors. main may spread work over the other
// reactors (pool calls run on the reactor they are made on). A non-OK
// status -- main's, or starting's -- is logged: exit code 1.
int RunClientPool(
    absl::AnyInvocable<Task<absl::Status>(rpc::ClientPool&)> main,
    rpc::ClientPoolOptions pool_options, const PoolRunOptions& options);
int RunClientPool(
    absl::AnyInvocable<Task<absl::Status>(rpc::ClientPool&)> main,
    rpc::ClientPoolOptions pool_options);

// What Serve built, handed to ServeOptions::setup before it listens.
struct ServeContext {
  transport::Device& device;
  // Shared by every Worker of the pool: a region registered here serves
  // the connections of every reactor (handlers reach it too, as
  // ctx.connection().worker().pd()).
  transport::ProtectionDomain& pd;
  cm::WorkerPool& pool;
  // Kept alive until the server has shut down, then released (newest
  // first) before the pool and the PD go: buffers, then their regions, a
  // metrics exporter.
  std::vector<std::shared_ptr<void>>& keep;
};

struct ServeOptions {
  size_t threads = 1;  // reactors (one cm::Worker each) serving connections
  // The user's device (it must outlive Serve); null: Serve opens the device
  // `provider` names.
  transport::Device* device = nullptr;
  transport::ProviderOptions provider;
  ReactorOptions reactor;
  // For every Worker. worker.pd: the user's PD (it must outlive Serve);
  // null: Serve allocates one PD that every Worker shares.
  cm::WorkerOptions worker;
  // Runs on the calling thread once the pool runs, before the server
  // listens: register memory, start side services (a metrics endpoint).
  // A non-OK status ends Serve (logged; exit code 1). What refers to the
  // pool or Serve's PD goes in ServeContext::keep (or is made in the user's
  // own device and PD: options.device, worker.pd).
  std::function<absl::Status(const ServeContext&)> setup;
  // On SIGINT/SIGTERM the server drains for at most this long
  // (rpc::Server::Shutdown(drain)): calls running finish, new ones are
  // refused as "server draining" (rpc::ClientPool sends them elsewhere);
  // then whatever still runs is cancelled. Zero: cancel at once.
  absl::Duration drain = absl::Seconds(10);
};

// Opens the device (or takes options.device), starts `server` (handlers
// registered) on a cm::WorkerPool of `threads` reactors sharing one PD,
// after options.setup, listening on address:port (0: any
// free port; server.port() and the log say which), serves until the process
// gets SIGINT or SIGTERM, then drains the server (options.drain) and shuts
// it down. Blocks those signals
// in the calling thread (and so in the reactors it starts) while it runs.
int Serve(rpc::Server& server, const std::string& address, uint16_t port,
          const ServeOptions& options);
int Serve(rpc::Server& server, const std::string& address, uint16_t port);

}  // namespace coverbs

#endif  // COVERBS_COVERBS_RUN_H_
