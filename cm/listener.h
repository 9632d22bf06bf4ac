// Accepting connections: a Listener binds and listens; each valid request
// (its handshake decoded) can be inspected, then accepted on any reactor's
// Worker or rejected with a reason the connecting side receives.
//
//   auto ln = cm::Listener::Create(worker, "127.0.0.1", 0);
//   auto conn = co_await (*ln)->Accept();
//
// Requests with a handshake that does not decode (garbage, another protocol
// version) are rejected with the reason and never returned. Connecting:
// cm/connect.h.
//
// Lock-out: the listener reads every new request's handshake concurrently,
// each bounded by accept_timeout, in the background from Create on (not
// only while Next() waits), so a peer that connects and says nothing --
// or half a handshake -- delays nobody. At most max_pending_handshakes are
// read at once (the oldest is dropped for a new one), and never so many
// that they could take the descriptors real work needs: the cap is also
// below the process's descriptor limit (RLIMIT_NOFILE) by fd_reserve, see
// ListenerOptions. At most max_queued_requests decoded requests wait for
// Next() (later ones are rejected as busy). Errors accepting a socket
// (EMFILE, ENFILE, ENOMEM...) never end the listener: it logs once per
// burst, backs off (10 ms up to 1 s) and accepts again; out of descriptors
// (EMFILE, ENFILE) with handshakes pending it instead drops the oldest of
// them and accepts again as soon as its socket is closed. Accept()
// completes only once the peer's first message arrives, so a peer that
// connects and then says nothing is dropped at accept_timeout too.
//
// Every request refused, connection accepted and listener error is one
// log line (component "cm"; rejects at most one per second, with a count of
// the rest).
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
#include "cm/worker.h"
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
  // Accepts on `worker` -- the listener's or another reactor's Worker (e.g. a
  // ReactorPool spreading connections); must be awaited on worker's reactor
  // thread. Waits for ESTABLISHED (bounded by the listener's
  // accept_timeout).
  Task<absl::StatusOr<std::unique_ptr<Connection>>> Accept(Worker& worker);
  // Rejects with `reason` (the connecting side gets PermissionDenied with it).
  absl::Status Reject(std::string_view reason);

 private:
  friend class Listener;
  explicit ConnectRequest(std::unique_ptr<internal::ConnectRequestState> s);
  std::unique_ptr<internal::ConnectRequestState> state_;
};

struct ListenerOptions {
  ConnectionOptions connection;  // for connections accepted by Accept()
  int backlog = 1024;
  // TCP/rdma_cm request -> the peer's first message on the connection.
  absl::Duration accept_timeout = absl::Seconds(5);
  // Handshakes being read at once; above it the oldest are dropped (a
  // sixteenth of the cap at once, at most 32, so that a flood's backlog
  // drains at more than one accept per reactor turn). On the
  // soft provider each holds a descriptor (its socket), so the listener
  // also keeps below the process's descriptor limit: the cap in force is
  //   min(max_pending_handshakes, L - min(fd_reserve, L / 2))
  // where L is the soft RLIMIT_NOFILE when Create runs (no term when it is
  // unlimited), at least 1: 768 at the common default L = 1024. See
  // Listener::max_pending_handshakes().
  size_t max_pending_handshakes = 1024;
  // Descriptors the pending handshakes leave to everything else: the
  // connections accepted (a socket each on soft), their completion queues
  // (two per CQ on soft, one CQ per ~28 connections), the metrics server
  // (rpc::ServerMetrics: at most its http_threads + 20 sockets), files.
  size_t fd_reserve = 256;
  // Decoded requests waiting for Next(); above it new ones are rejected.
  size_t max_queued_requests = 1024;
  // Accept() calls this for each request; a non-OK status rejects the
  // request with the status message as reason. A handshake that does not
  // decode (garbage, version mismatch) is rejected before, with the reason.
  std::function<absl::Status(const PeerInfo&)> admit;
};

class Listener {
 public:
  // Binds and listens; port 0 picks a free port (see port()).
  static absl::StatusOr<std::unique_ptr<Listener>> Create(
      Worker& worker, std::string address, uint16_t port,
      ListenerOptions options = {});
  ~Listener();

  uint16_t port() const;
  const std::string& address() const;
  // The cap on pending handshakes in force: ListenerOptions::
  // max_pending_handshakes, lowered to fit the descriptor limit.
  size_t max_pending_handshakes() const;

  // The next valid connection request (undecodable handshakes are rejected
  // here with their reason and not returned). Cancellable.
  Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Next();
  // Next(), options.admit, then Accept on the listener's Worker.
  Task<absl::StatusOr<std::unique_ptr<Connection>>> Accept();

  // Stops listening; pending Next()/Accept() resume with Cancelled. So does
  // destroying the Listener: a Next()/Accept() started before may still be
  // awaited (they hold the listener's state, not the Listener).
  void Close();

  struct Stats {
    uint64_t requests = 0;  // handshakes read (or given up on)
    uint64_t accepted = 0;
    // Refused: bad handshake, version mismatch, admit, Reject, busy, a
    // handshake not finished by accept_timeout.
    uint64_t rejected = 0;
    // Pending handshakes dropped: for newer ones (above the cap), or to
    // free a descriptor when accepting failed with EMFILE/ENFILE.
    uint64_t evicted = 0;
    uint64_t evicted_for_fds = 0;  // of `evicted`, for a descriptor
    uint64_t accept_errors = 0;  // failed accepts of a socket (EMFILE...)
    size_t pending = 0;          // handshakes being read now
    size_t queued = 0;           // decoded requests waiting for Next()
    std::string last_reject_reason;
    std::string last_accept_error;
  };
  // Callable from any thread.
  Stats stats() const;

 private:
  explicit Listener(std::shared_ptr<internal::ListenerState> s);
  // Next() and Accept(): coroutines on the state alone, so that a Listener
  // destroyed while they wait is never touched when they resume.
  static Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> NextOn(
      std::shared_ptr<internal::ListenerState> st);
  static Task<absl::StatusOr<std::unique_ptr<Connection>>> AcceptOn(
      std::shared_ptr<internal::ListenerState> st);
  // Shared with the background tasks reading handshakes.
  std::shared_ptr<internal::ListenerState> state_;
};

}  // namespace coverbs::cm

#endif  // COVERBS_CM_LISTENER_H_
