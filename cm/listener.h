// Accepting connections: a Listener binds and listens; each valid request
// (its handshake decoded) can be inspected, then accepted on any reactor's
// Context or rejected with a reason the connecting side receives.
//
//   auto ln = cm::Listener::Create(ctx, "127.0.0.1", 0);
//   auto conn = co_await (*ln)->Accept();
//
// Requests with a handshake that does not decode (garbage, another protocol
// version) are rejected with the reason and never returned. Each step is
// bounded by ListenerOptions::accept_timeout. Connecting: cm/connect.h.
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
// Connect used to be declared here; callers that still include only this
// header for it keep building until they include cm/connect.h.
#include "cm/connect.h"  // IWYU pragma: export

namespace coverbs::cm {

namespace internal {
struct ConnectRequestState;  // listener.cc
struct ListenerState;
}  // namespace internal

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

 private:
  friend class Listener;
  explicit ConnectRequest(std::unique_ptr<internal::ConnectRequestState> s);
  std::unique_ptr<internal::ConnectRequestState> state_;
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

 private:
  explicit Listener(std::unique_ptr<internal::ListenerState> s);
  std::unique_ptr<internal::ListenerState> state_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_LISTENER_H_
