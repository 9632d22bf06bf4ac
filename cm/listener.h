// Establishing connections: Listener / Accept and Connect, over rdma_cm
// (verbs provider) or the soft provider's TCP-based setup, which has the same
// steps, events and private-data semantics.
//
//   auto ln = cm::Listener::Create(ctx, "127.0.0.1", 0);
//   auto conn = co_await (*ln)->Accept();
//   ...
//   auto conn = co_await cm::Connect(ctx, "127.0.0.1", port);
//
// Every step has a timeout, and every rdma_cm failure event is a distinct
// Status: ADDR_ERROR / ROUTE_ERROR -> Unavailable "address|route resolution
// failed", resolve timeouts -> DeadlineExceeded, UNREACHABLE and a port with
// no listener -> Unavailable "unreachable", REJECTED -> PermissionDenied
// carrying the peer's reason, CONNECT_ERROR -> Unavailable, DEVICE_REMOVAL ->
// Aborted. Each message names the address, the port and the step.
#ifndef COVERBS_CM_LISTENER_H_
#define COVERBS_CM_LISTENER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/context.h"
#include "core/task.h"

namespace coverbs::cm {

struct ConnectOptions {
  ConnectionOptions connection;
  absl::Duration resolve_timeout = absl::Seconds(2);  // address, then route
  absl::Duration connect_timeout = absl::Seconds(5);  // until ESTABLISHED
  std::string app_data;  // <= kMaxAppData bytes, shown to the listener
  // Tests only: sent instead of the encoded handshake (garbage, other
  // protocol versions).
  std::string raw_private_data_for_test;
};

// Resolves, creates the QP on ctx's CQ, connects with the handshake in the
// private data, waits for ESTABLISHED. Cancellable (stop token).
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Context& ctx, const std::string& address, uint16_t port,
    const ConnectOptions& options);
// With default options. (An overload, not a default argument: gcc 12
// mis-copies default-argument temporaries inside co_await expressions.)
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Context& ctx, const std::string& address, uint16_t port);

class Listener;

// A connection request: inspect the peer, then Accept or Reject. Destroying
// it without either rejects it ("not accepted").
class ConnectRequest {
 public:
  ~ConnectRequest();
  const PeerInfo& peer() const;
  // Accepts on `ctx` -- the listener's or another reactor's Context (e.g. a
  // ReactorPool spreading connections); must be awaited on ctx's reactor
  // thread. Waits for ESTABLISHED (bounded by the listener's
  // accept_timeout).
  Task<absl::StatusOr<std::unique_ptr<Connection>>> Accept(Context& ctx);
  // Rejects with `reason` (the connecting side gets PermissionDenied with it).
  absl::Status Reject(std::string_view reason);

  struct State;  // internal

 private:
  friend class Listener;
  explicit ConnectRequest(std::unique_ptr<State> s);
  std::unique_ptr<State> state_;
};

struct ListenerOptions {
  ConnectionOptions connection;  // for connections accepted by Accept()
  int backlog = 128;
  absl::Duration accept_timeout = absl::Seconds(5);  // request -> ESTABLISHED
  // Accept() calls this for each request; a non-OK status rejects the
  // request with the status message as reason. A handshake that does not
  // decode (garbage, version mismatch) is rejected before, with the reason.
  std::function<absl::Status(const PeerInfo&)> admit;
};

class Listener {
 public:
  // Binds and listens; port 0 picks a free port (see port()).
  static absl::StatusOr<std::unique_ptr<Listener>> Create(
      Context& ctx, std::string address, uint16_t port,
      ListenerOptions options = {});
  ~Listener();

  uint16_t port() const;
  const std::string& address() const;

  // The next valid connection request (undecodable handshakes are rejected
  // here with their reason and not returned). Cancellable.
  Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Next();
  // Next(), options.admit, then Accept on the listener's Context.
  Task<absl::StatusOr<std::unique_ptr<Connection>>> Accept();

  // Stops listening; pending Next()/Accept() resume with Cancelled.
  void Close();

  // Requests refused (bad handshake, version mismatch, admit, Reject).
  struct Stats {
    uint64_t requests = 0;
    uint64_t accepted = 0;
    uint64_t rejected = 0;
    std::string last_reject_reason;
  };
  const Stats& stats() const;

  struct State;  // internal

 private:
  explicit Listener(std::unique_ptr<State> s);
  std::unique_ptr<State> state_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_LISTENER_H_
