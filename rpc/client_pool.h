// rpc::ClientPool: rpc::Clients to several servers from every reactor of a
// cm::WorkerPool, reconnected with back-off, with a default deadline.
//
//   auto pool = rpc::ClientPool::Create(workers, {.servers = {{"10.0.0.1",
//   7471},
//                                                             {"10.0.0.2",
//                                                             7471}}});
//   // in a coroutine on one of the WorkerPool's reactors:
//   absl::StatusOr<rpc::Response> r = co_await (*pool)->Call("Echo", bytes);
//   ...
//   (*pool)->Shutdown();  // before the WorkerPool goes
//
// Contract:
//  - Every reactor of the WorkerPool holds one connection to every server
//    (an rpc::Client on that reactor's Worker). A call uses the connections
//    of the reactor it runs on, round-robin over the live ones: no call
//    crosses threads.
//  - A lost connection (server stopped or killed, link down, protocol
//    error): the calls in flight on it fail with UNAVAILABLE naming the
//    connection and the cause (rpc::Client's contract); later calls go to
//    the reactor's other live connections. The first to see the loss (a
//    call or the connection's watcher) takes it out of rotation. The lost
//    one is reconnected in the background, whatever the callers do: at
//    once, then after reconnect_min, doubling up to reconnect_max (each
//    pause jittered by up to +-25%) while connecting fails.
//  - A call that finds no live connection on its reactor:
//    - fails fast (UNAVAILABLE naming each server's last connect error)
//      when every connection's last attempt failed, as gRPC does;
//    - otherwise (a connect is on its way, or wait_for_ready) sleeps until
//      a connection comes up or an attempt fails, then decides again; at
//      its deadline it fails with DEADLINE_EXCEEDED naming the last
//      connect failures. Nothing polls: a pool whose servers are all down
//      costs only its back-off timers.
//  - A server that drains (rpc::Server::Shutdown(drain)) refuses new calls
//    without running them: such a call is sent again on another connection
//    (as a new pick, under the same deadline), and the refusing connection
//    leaves rotation; its calls in flight finish, then the pool closes it
//    and reconnects with back-off.
//  - A call without a deadline (CallOptions::deadline infinite) gets
//    now + default_deadline.
//  - Threads: Call on one of the WorkerPool's reactor threads; Create,
//    stats and Shutdown from any thread outside the pool.
#ifndef COVERBS_RPC_CLIENT_POOL_H_
#define COVERBS_RPC_CLIENT_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/worker_pool.h"
#include "core/task.h"
#include "rpc/client.h"
#include "rpc/payload.h"
#include "rpc/typed.h"

namespace coverbs::rpc {

struct ServerAddress {
  std::string address;  // IPv4 / IPv6 literal or host name
  uint16_t port = 0;
};

struct ClientPoolOptions {
  std::vector<ServerAddress> servers;  // at least one
  ClientOptions client;                // for every connection
  // Deadline of a call whose CallOptions give none.
  absl::Duration default_deadline = absl::Seconds(30);
  // Pauses between failed connects of one connection.
  absl::Duration reconnect_min = absl::Milliseconds(20);
  absl::Duration reconnect_max = absl::Seconds(2);
  // How often an idle connection's state is checked (a loss seen by a call
  // is acted on at once).
  absl::Duration check_interval = absl::Milliseconds(100);
  // false (the default): a call fails at once with UNAVAILABLE when no
  // connection of its reactor is live and every last connect attempt
  // failed. true: it waits for a connection until its deadline.
  bool wait_for_ready = false;
};

namespace internal {
struct PoolReactor;  // rpc/client_pool.cc
struct PoolSlot;
}  // namespace internal

class ClientPool {
 public:
  // Starts connecting from every reactor of `workers` (which must outlive
  // Shutdown). InvalidArgument without servers or with reconnect_min >
  // reconnect_max.
  static absl::StatusOr<std::unique_ptr<ClientPool>> Create(
      cm::WorkerPool& workers, ClientPoolOptions options);
  // Shutdown().
  ~ClientPool();
  ClientPool(const ClientPool&) = delete;
  ClientPool& operator=(const ClientPool&) = delete;

  // As rpc::Client::Call, on a live connection of the calling reactor.
  // FailedPrecondition when not called on one of the pool's reactors;
  // UNAVAILABLE once the pool is shut down.
  // (Overloads, not default arguments: gcc 12 mis-copies default-argument
  // temporaries of coroutines inside co_await expressions.)
  Task<absl::StatusOr<Response>> Call(std::string_view method,
                                      std::span<const std::byte> payload,
                                      CallOptions options);
  Task<absl::StatusOr<Response>> Call(std::string_view method,
                                      std::span<const std::byte> payload);

  // Typed calls, as rpc::Client's (rpc/typed.h): `args` checked against the
  // Method descriptor at compile time, encoded by rpc::Codec<Args>, the
  // response decoded as R.
  template <typename Args, typename R>
  Task<absl::StatusOr<R>> Call(const Method<Args, R>& method,
                               const std::type_identity_t<Args>& args,
                               CallOptions options) {
    internal::EncodedArg<Args> enc(args);
    absl::StatusOr<Response> r =
        co_await Call(method.name, enc.view(), std::move(options));
    if (!r.ok()) co_return r.status();
    co_return internal::FromResponse<R>(method.name, *std::move(r));
  }
  template <typename Args, typename R>
  Task<absl::StatusOr<R>> Call(const Method<Args, R>& method,
                               const std::type_identity_t<Args>& args) {
    return Call<Args, R>(method, args, CallOptions());
  }
  // By a Method<R(A...)>, as rpc::Client's: the method's arguments, then
  // optionally CallOptions.
  template <typename R, typename... A, typename... U>
  Task<absl::StatusOr<R>> Call(const Method<R(A...)>& method, U&&... args) {
    using C = internal::CallArgs<CallOptions,
                                 typename Method<R(A...)>::ArgTypes, U...>;
    if constexpr (C::kValid) {
      CallOptions options = C::Options(args...);
      return CallWith<R>(method.name, C::Encode(std::forward<U>(args)...),
                         std::move(options));
    } else {
      return {};  // C's static_assert said why
    }
  }

  // A live connection of the calling reactor, held for operations that
  // belong together: a call, then the one-sided operations
  // (lease->connection().Read ...) on the token it returned, which only
  // that connection may use. Picked as a call's connection is (fail fast,
  // or wait for ready until options.deadline). While held, the Client stays
  // valid even if the pool drops the connection (its operations then fail
  // with UNAVAILABLE); drop the lease when done. Same threads as Call.
  Task<absl::StatusOr<std::shared_ptr<Client>>> Lease(CallOptions options);
  Task<absl::StatusOr<std::shared_ptr<Client>>> Lease();

  // Stops reconnecting, closes every connection (calls in flight fail with
  // UNAVAILABLE, waiting ones too) and waits until nothing of the pool runs
  // on its reactors. Idempotent. Not on one of the pool's reactor threads.
  void Shutdown();

  struct Stats {
    uint64_t connects = 0;          // connections established in all
    uint64_t connect_failures = 0;  // failed attempts
    uint64_t losses = 0;            // established connections that went down
    uint64_t calls = 0;             // calls given to a connection
    uint64_t live = 0;              // connections usable now
    uint64_t reconnects = 0;     // connects of a connection that was up before
    uint64_t fail_fast = 0;      // calls (or leases) failed at once: no
                                 // server reachable
    uint64_t leases = 0;         // connections leased
    uint64_t drained = 0;        // connections closed after a server drained
    uint64_t drain_retries = 0;  // calls a draining server refused, sent on
  };
  Stats stats() const;

 private:
  template <typename R>
  Task<absl::StatusOr<R>> CallWith(std::string_view method,
                                   internal::CallPayload payload,
                                   CallOptions options) {
    absl::StatusOr<Response> r =
        co_await Call(method, payload.bytes(), std::move(options));
    if (!r.ok()) co_return r.status();
    co_return internal::FromResponse<R>(method, *std::move(r));
  }

  struct Counters {
    std::atomic<uint64_t> connects{0}, connect_failures{0}, losses{0}, calls{0},
        live{0}, reconnects{0}, fail_fast{0}, leases{0}, drained{0},
        drain_retries{0};
  };
  // A live slot of the calling reactor.
  struct Picked {
    std::shared_ptr<internal::PoolReactor> reactor;
    std::shared_ptr<internal::PoolSlot> slot;
  };
  // The calling reactor's next live connection, or why none: fail fast, or
  // wait until `deadline` (infinite: default_deadline). Errors name the
  // call's `method` (valid until Pick returns), or a lease when empty.
  Task<absl::StatusOr<Picked>> Pick(std::string_view method,
                                    absl::Time deadline);
  ClientPool(ClientPoolOptions options) : options_(std::move(options)) {}
  Task<void> Maintain(std::shared_ptr<internal::PoolReactor> r, size_t slot);
  void LoopEnded();

  ClientPoolOptions options_;
  std::vector<std::shared_ptr<internal::PoolReactor>> reactors_;
  Counters counters_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t loops_ = 0;        // under mu_: Maintain coroutines still running
  bool shut_down_ = false;  // under mu_
};

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_CLIENT_POOL_H_
