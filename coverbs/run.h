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
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "cm/worker.h"
#include "core/reactor.h"
#include "core/task.h"
#include "rpc/server.h"
#include "transport/provider.h"

namespace coverbs {

struct RunOptions {
  transport::ProviderOptions provider;
  ReactorOptions reactor;
  cm::WorkerOptions worker;
};

// Creates a reactor, opens the device, makes one cm::Worker and runs
// main(worker) to completion on that reactor (this thread). Everything
// main created on the worker must be gone when it returns.
int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main,
            const RunOptions& options);
int RunMain(absl::AnyInvocable<Task<absl::Status>(cm::Worker&)> main);

struct ServeOptions {
  size_t threads = 1;  // reactors (one cm::Worker each) serving connections
  transport::ProviderOptions provider;
  ReactorOptions reactor;
  cm::WorkerOptions worker;
};

// Opens the device, starts `server` (handlers registered) on a
// cm::WorkerPool of `threads` reactors listening on address:port (0: any
// free port; server.port() and the log say which), serves until the process
// gets SIGINT or SIGTERM, then shuts the server down. Blocks those signals
// in the calling thread (and so in the reactors it starts) while it runs.
int Serve(rpc::Server& server, const std::string& address, uint16_t port,
          const ServeOptions& options);
int Serve(rpc::Server& server, const std::string& address, uint16_t port);

}  // namespace coverbs

#endif  // COVERBS_COVERBS_RUN_H_
