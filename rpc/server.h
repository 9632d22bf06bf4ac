// rpc::Server: methods registered by name, served over cm connections.
//
//   rpc::Server server;
//   server.Register("Echo", [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
//     co_return std::move(r.payload);  // zero-copy echo
//   });
//   server.Start(workers, "0.0.0.0", 7471);  // one cm::Worker per reactor
//   ...
//   server.Shutdown();
//
// Contract (wire format and sequences: rpc/README.md):
//  - Each request runs as its own coroutine on the reactor of its
//    connection; responses go back as handlers finish (out of order).
//  - A handler gets the request payload as a view of the connection's
//    receive (or rendezvous) buffer. It must honour its ambient stop token:
//    stop is requested when the client cancels the call (cancel frame, e.g.
//    on deadline expiry) and on Shutdown; the response of a cancelled call
//    is not sent.
//  - The request is also the call's rpc::Context (rpc/context.h): the
//    caller's connection (Expose to this caller only), its address and
//    handshake app_data, the stop token.
//  - Typed methods (rpc/typed.h) are byte methods whose payloads a codec
//    encodes; both kinds share one method table.
//  - A handler's error Status travels back to the caller with its code and
//    message; an unknown method gets NOT_FOUND.
//  - Per connection at most max_concurrent_calls handlers run; further
//    requests queue (max_queued_calls), and beyond that the server stops
//    reading the connection, so the connection's credits hold the client
//    back: back-pressure, not failure.
//  - A malformed, truncated or oversized frame is answered with an error
//    frame (the call's id when it can be read, else id 0 = the connection)
//    and closes that connection only.
//  - Threads: handlers may run on any of the server's reactors at once; the
//    handler object must be callable concurrently.
#ifndef COVERBS_RPC_SERVER_H_
#define COVERBS_RPC_SERVER_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"
#include "cm/listener.h"
#include "core/task.h"
#include "rpc/context.h"
#include "rpc/payload.h"
#include "rpc/typed.h"
#include "rpc/wire.h"

namespace coverbs::rpc {

// A handler takes the request by value (or by reference: the request
// then lives in the call's frame until the handler ends). The rvalue
// reference spares a move of the request per call, into std::function's
// own by-value parameter.
using Handler = std::function<Task<absl::StatusOr<Payload>>(Request&&)>;

// What a finished call reports to ServerOptions::call_observer.
struct CallRecord {
  std::string_view method;  // the registered name (lives with the server)
  uint32_t method_id = 0;
  // OK, the handler's error code, or kCancelled when the caller cancelled
  // (or the server shut down) before the response went out.
  absl::StatusCode code = absl::StatusCode::kOk;
  // From the request's arrival at the call (queueing for a handler slot
  // included) to its response posted.
  absl::Duration latency;
  uint64_t request_bytes = 0;
  uint64_t response_bytes = 0;  // 0 unless the response was sent
};
// Called once per call that reached a handler, on the call's reactor, right
// after its response was posted: it must be cheap and callable
// concurrently from every reactor of the server.
using CallObserver = std::function<void(const CallRecord&)>;

struct ServerOptions {
  // Handlers running at once on one connection.
  size_t max_concurrent_calls = 128;
  // Requests read and waiting for a handler slot, per connection. Beyond
  // running + queued the server stops reading that connection.
  size_t max_queued_calls = 128;
  // Largest request payload accepted (also bounded by the connection's
  // max_message_size minus the 32-byte frame header).
  uint64_t max_request_size = (64ull << 20) - kHeaderSize;
  // Largest response payload a handler may return; a larger one reaches
  // the caller as RESOURCE_EXHAUSTED.
  uint64_t max_response_size = (64ull << 20) - kHeaderSize;
  // For Start(): the listener and the connections it accepts.
  cm::ListenerOptions listener;
  // Admission: called on the accepting reactor for each connection request
  // (after the handshake decoded) with the peer's address and handshake,
  // app_data included (rpc::ClientOptions::connect.app_data). A non-OK
  // status refuses the connection: the client's Connect fails with
  // PERMISSION_DENIED carrying this status's message. When unset,
  // listener.admit (same contract) is used. Runs on one reactor at a time;
  // it must not block.
  std::function<absl::Status(const cm::PeerInfo&)> admit;
  // Optional (metrics, tracing): the server takes the clock per call only
  // when this is set.
  CallObserver call_observer;
  // Typed methods: what decoding an argument may cost in memory, and the
  // size above which it decodes off the reactor (rpc/codec.h; rpc/README.md,
  // "Decode budget"). Register's last argument overrides it per method.
  DecodeOptions decode;
};

class Server {
 public:
  Server();
  explicit Server(ServerOptions options);
  // Shutdown() (so with a single reactor, await ShutdownAsync() first).
  ~Server();
  Server(const Server&) = delete;

  // Before Start/Serve only: serving reads the method table without a
  // lock, so a registration once the server started fails with
  // FAILED_PRECONDITION. Callable from several threads at once (a mutex
  // guards the table until then). AlreadyExists for a name registered
  // twice or whose method id (rpc::MethodId) collides with another name's.
  absl::Status Register(std::string_view name, Handler handler);
  // Typed methods (rpc/typed.h): `fn` is a function or lambda taking
  // (rpc::Context&, Args) or (Args) and returning Task<absl::StatusOr<R>>;
  // Args and R go through rpc::Codec (rpc/codec.h).
  // `decode` (optional): this method's decode bound, instead of
  // ServerOptions::decode.
  template <typename F>
    requires internal::kIsTypedHandler<F>
  absl::Status Register(std::string_view name, F fn) {
    return Register(name, internal::WrapTyped(std::move(fn), options_.decode));
  }
  template <typename F>
    requires internal::kIsTypedHandler<F>
  absl::Status Register(std::string_view name, F fn,
                        const DecodeOptions& decode) {
    return Register(name, internal::WrapTyped(std::move(fn), decode));
  }
  // The same, typed by a method descriptor (rpc::Method<Args, R>).
  template <typename Args, typename R, typename F>
  absl::Status Register(const Method<Args, R>& method, F fn) {
    return Register(method, std::move(fn), options_.decode);
  }
  template <typename Args, typename R, typename F>
  absl::Status Register(const Method<Args, R>& method, F fn,
                        const DecodeOptions& decode) {
    static_assert(
        std::is_same_v<typename internal::TypedTraits<F>::Args, Args> &&
            std::is_same_v<typename internal::TypedTraits<F>::Result, R>,
        "the handler's argument and result types must be the method's");
    return Register(method.name, internal::WrapTyped(std::move(fn), decode));
  }
  // By a Method<R(A...)> (none, one or several arguments): `fn` takes
  // (rpc::Context&, A...) or (A...); a mismatch fails to compile.
  template <typename R, typename... A, typename F>
  absl::Status Register(const Method<R(A...)>& method, F fn) {
    return Register(method, std::move(fn), options_.decode);
  }
  template <typename R, typename... A, typename F>
  absl::Status Register(const Method<R(A...)>& method, F fn,
                        const DecodeOptions& decode) {
    using H =
        internal::MethodHandler<R, typename rpc::Method<R(A...)>::ArgTypes>;
    return Register(method.name, H::Wrap(std::move(fn), decode));
  }

  // Listens on workers[0]'s reactor; accepted connections are spread
  // round-robin over `workers` (one per reactor of a ReactorPool, say) and
  // served there. Callable from any thread (blocks until listening). The
  // workers must outlive Shutdown().
  absl::Status Start(std::vector<cm::Worker*> workers,
                     const std::string& address, uint16_t port);
  // The same over every worker of `pool`.
  absl::Status Start(cm::WorkerPool& pool, const std::string& address,
                     uint16_t port) {
    return Start(pool.workers(), address, port);
  }
  uint16_t port() const { return port_; }

  // Serves one established connection on its reactor until it closes (peer
  // close, connection loss, protocol error or Shutdown), then closes it.
  Task<void> Serve(std::unique_ptr<cm::Connection> conn);

  // Stops listening, cancels every running handler, closes every
  // connection and waits until all of them ended. Idempotent. Must not be
  // called on one of the server's reactor threads (it waits for them), and
  // before those reactors stop.
  void Shutdown();
  // Drains first, for at most `drain`: stops listening; calls running go
  // on to their responses; every new request is refused with UNAVAILABLE
  // "server draining ..." (rpc/drain.h: the handler never ran, so the
  // caller may go elsewhere; rpc::ClientPool does); a connection whose
  // calls have ended and on which no request came for `quiet` is closed
  // (a pool closes its own side once refused). Then, at the latest when
  // `drain` ran out, Shutdown(). Same threads as Shutdown().
  void Shutdown(absl::Duration drain,
                absl::Duration quiet = absl::Milliseconds(100));
  // The same from a coroutine, e.g. on the server's only reactor; polls
  // (1 ms) until every connection ended.
  Task<void> ShutdownAsync();

  // Callable from any thread.
  struct Stats {
    uint64_t connections = 0;       // accepted (or given to Serve) in all
    uint64_t open_connections = 0;  // being served now
    // Connection requests refused (bad handshake, admit, the peer said
    // nothing by accept_timeout, no resources) and failed accepts of a
    // socket (EMFILE...): the listener's counts.
    uint64_t rejected_connections = 0;
    uint64_t accept_errors = 0;
    uint64_t pending_handshakes = 0;  // being read now
    // Pending handshakes dropped for newer connections or to free a
    // descriptor (cm::ListenerOptions::max_pending_handshakes).
    uint64_t evicted_handshakes = 0;
    uint64_t calls = 0;            // handlers started
    uint64_t failed_calls = 0;     // handlers that returned an error
    uint64_t request_bytes = 0;    // request payloads received
    uint64_t response_bytes = 0;   // response payloads sent
    // Of connections that ended: sends that waited for a credit, and
    // messages that went by rendezvous (either way).
    uint64_t credit_stalls = 0;
    uint64_t rendezvous = 0;
    uint64_t cancels_received = 0;
    uint64_t cancelled_calls = 0;  // handlers stopped before responding
    uint64_t unknown_method = 0;
    uint64_t drain_refused = 0;  // requests refused while draining
    // Connections closed for a bad frame, or for breaking the connection
    // layer's protocol (cm::CloseCause::kProtocolViolation).
    uint64_t protocol_errors = 0;
    uint64_t copied_requests = 0;  // payloads copied to free receive buffers
    // Stall reports of the server's reactors (ReactorOptions::
    // stall_threshold): a task, usually a handler, that ran without
    // yielding past the threshold while every other call waited.
    uint64_t reactor_stalls = 0;
    // The rendezvous budgets over the server's Workers
    // (cm::Worker::rendezvous_usage): bytes held now against
    // cm::WorkerOptions::rendezvous_budget; requests whose CTS was deferred
    // (a peer beyond a budget waited); connections ended for breaking the
    // budget or for withholding a DONE.
    uint64_t rendezvous_held_bytes = 0;
    uint64_t rendezvous_deferred = 0;
    uint64_t rendezvous_budget_violations = 0;
    uint64_t rendezvous_done_timeouts = 0;
    // Expose calls refused by a connection's exposure bounds
    // (cm::ConnectionOptions::max_exposures, max_exposed_bytes).
    uint64_t exposures_refused = 0;
    // Connections that ended, by why (indexed by cm::CloseCause; a bad
    // RPC frame counts as kProtocolViolation).
    std::array<uint64_t, cm::kCloseCauses> closed_by_cause{};
  };
  Stats stats() const;

 private:
  struct Conn;  // per connection, rpc/server.cc
  struct Method {
    std::string name;
    Handler handler;
  };
  Task<void> AcceptLoop(std::unique_ptr<cm::Listener> listener);
  Task<void> AcceptAndServe(std::shared_ptr<Conn> c,
                            std::unique_ptr<cm::ConnectRequest> req);
  Task<void> ServeLoop(std::shared_ptr<Conn> c);
  // While draining: closes `c` once its calls ended and it was quiet.
  Task<void> DrainConn(std::shared_ptr<Conn> c, absl::Duration quiet);
  // One call's coroutine (rpc/server.cc): ServeLoop runs it at once, and
  // it frees its own frame when it ends.
  struct CallCoro;
  CallCoro RunCall(Conn* c, uint64_t call_id, const Method* method,
                   Request req);
  Task<void> SendError(Conn* c, uint64_t call_id, uint32_t method_id,
                       absl::Status status);
  std::shared_ptr<Conn> NewConn(cm::Worker* worker);
  bool BeginShutdown();
  void ConnGone();
  uint64_t StallsLocked() const;  // the Workers' reactors' stalls; mu_ held

  ServerOptions options_;
  absl::flat_hash_map<uint32_t, std::unique_ptr<Method>> methods_;
  std::vector<cm::Worker*> workers_;
  uint16_t port_ = 0;
  size_t next_ctx_ = 0;  // acceptor's reactor only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool started_ = false;
  bool shutting_down_ = false;
  bool shut_down_ = false;
  size_t live_ = 0;  // connections + the accept loop
  std::vector<std::weak_ptr<Conn>> conns_;
  std::stop_source accept_stop_;  // Shutdown: ends the accept loop
  // Shutdown(drain): new requests are refused (read once per request).
  std::atomic<bool> draining_{false};

  struct AtomicStats {
    std::atomic<uint64_t> connections{0}, open_connections{0}, calls{0},
        failed_calls{0}, request_bytes{0}, response_bytes{0},
        credit_stalls{0}, rendezvous{0}, cancels_received{0},
        cancelled_calls{0}, unknown_method{0}, protocol_errors{0},
        copied_requests{0}, drain_refused{0};
    std::array<std::atomic<uint64_t>, cm::kCloseCauses> closed{};
  };
  cm::Listener* listener_ = nullptr;  // under mu_; the accept loop's
  cm::Listener::Stats final_listener_;  // under mu_; once it is gone
  uint64_t final_stalls_ = 0;  // under mu_; StallsLocked() at shutdown
  AtomicStats stats_;
};

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_SERVER_H_
