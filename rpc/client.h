// rpc::Client: calls over one cm connection, many in flight at once.
//
//   auto client = co_await rpc::Client::Connect(worker, "10.0.0.1", 7471);
//   rpc::CallOptions o;
//   o.deadline = absl::Now() + absl::Milliseconds(50);
//   absl::StatusOr<rpc::Response> r = co_await (*client)->Call("Echo", bytes, o);
//
// Contract (wire format and sequences: rpc/README.md):
//  - Calls are pipelined: each gets a call id, responses are matched by id
//    and may come back in any order.
//  - Deadline / cancellation (CallOptions, and the caller's ambient stop
//    token): the call returns DEADLINE_EXCEEDED / CANCELLED at once, a
//    cancel frame tells the server to stop the handler, and a response that
//    arrives later is dropped (counted in stats().late_responses).
//  - The server's error travels back as the Status it returned (code and
//    message); an unknown method is NOT_FOUND.
//  - When the connection goes down (peer closed or died, a protocol error,
//    Close, its Worker destroyed) every pending call fails with UNAVAILABLE
//    naming the connection and the cause, and later calls fail at once.
//  - What the server sends is checked, never trusted: a frame that does
//    not decode (bad header, a length that is not the message's, a payload
//    above max_response_size, a request frame), a response for a call id
//    never issued, or a message after the server's GOODBYE (cm: nothing
//    may follow it) ends the connection as a protocol violation, with that
//    cause. A response for a call that gave up is dropped (late_responses).
//  - Deadlines: CallOptions::deadline per call, or ClientOptions::
//    call_timeout for every call that sets none. Without either a call
//    waits as long as the connection lives: a server that accepts and
//    never answers holds it forever.
//  - Shutdown, in any order (cm/worker.h): Close() then destroy is the
//    graceful one. Destroying the Client without Close fails its calls
//    (CANCELLED) and drops the connection (the peer sees it end). The
//    Worker may go first, with calls in flight: they fail UNAVAILABLE
//    ("the cm::Worker was destroyed"), and the Client stays a valid, down
//    object (calls fail at once, Close returns at once) that may be
//    destroyed later, after the Reactor too.
//  - Single reactor: use a Client on its connection's reactor thread.
#ifndef COVERBS_RPC_CLIENT_H_
#define COVERBS_RPC_CLIENT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connect.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "core/task.h"
#include "rpc/payload.h"
#include "rpc/typed.h"
#include "rpc/wire.h"

namespace coverbs::rpc {

struct ClientOptions {
  // The server's admission hook (rpc::ServerOptions::admit) sees
  // connect.app_data (at most cm::kMaxAppData bytes): who this client is.
  // Largest response payload accepted (also bounded by the connection's
  // max_message_size minus the 32-byte frame header).
  uint64_t max_response_size = (64ull << 20) - kHeaderSize;
  // For Client::Connect.
  cm::ConnectOptions connect;
  // The deadline of every call that sets none (CallOptions::deadline left
  // at InfiniteFuture, and the plain Call overloads): absl::Now() +
  // call_timeout when Call is invoked. A server that never answers then
  // costs a call DEADLINE_EXCEEDED, not a hang. InfiniteDuration: none.
  absl::Duration call_timeout = absl::InfiniteDuration();
};

struct CallOptions {
  absl::Time deadline = absl::InfiniteFuture();
  std::stop_token cancel;  // in addition to the caller's ambient token
};

namespace internal {
struct ClientState;  // rpc/client.cc
}  // namespace internal

class Client {
 public:
  // Connects and starts the client on worker's reactor (call it there).
  static Task<absl::StatusOr<std::unique_ptr<Client>>> Connect(
      cm::Worker& worker, std::string address, uint16_t port,
      ClientOptions options);
  static Task<absl::StatusOr<std::unique_ptr<Client>>> Connect(
      cm::Worker& worker, std::string address, uint16_t port);
  // Takes an established connection (on its reactor thread).
  static std::unique_ptr<Client> Create(std::unique_ptr<cm::Connection> conn,
                                        const ClientOptions& options);
  // Fails pending calls (CANCELLED) and drops the connection abruptly if
  // Close() was not awaited. What still runs of the client (its receive
  // loop, cancel frames under way) ends on the reactor -- or when the
  // Worker is destroyed, which ends and waits for it (cm/worker.h).
  ~Client();
  Client(const Client&) = delete;

  // `method` and `payload` must stay valid until the call completes (the
  // call is lazy: it reads them when awaited). Small responses are
  // copied out of the receive buffer (so holding many responses never
  // starves the connection of receive buffers); large ones (rendezvous)
  // are handed over zero-copy.
  // (Overloads, not default arguments: gcc 12 mis-copies default-argument
  // temporaries of coroutines inside co_await expressions.)
  Task<absl::StatusOr<Response>> Call(std::string_view method,
                                      std::span<const std::byte> payload,
                                      CallOptions options);
  Task<absl::StatusOr<Response>> Call(std::string_view method,
                                      std::span<const std::byte> payload);

  // Typed calls (rpc/typed.h): `args` encoded by rpc::Codec<Args> (sent
  // from the object itself where the codec allows), the response decoded
  // as R (INTERNAL naming the method when it does not decode). `method`
  // and `args` must stay valid until the call completes.
  template <typename R, typename Args>
  Task<absl::StatusOr<R>> Call(std::string_view method, const Args& args,
                               CallOptions options) {
    internal::EncodedArg<Args> enc(args);
    absl::StatusOr<Response> r =
        co_await Call(method, enc.view(), std::move(options));
    if (!r.ok()) co_return r.status();
    co_return internal::FromResponse<R>(method, *std::move(r));
  }
  template <typename R, typename Args>
  Task<absl::StatusOr<R>> Call(std::string_view method, const Args& args) {
    return Call<R, Args>(method, args, CallOptions());
  }
  template <typename Args, typename R>
  Task<absl::StatusOr<R>> Call(const Method<Args, R>& method,
                               const std::type_identity_t<Args>& args,
                               CallOptions options) {
    return Call<R, Args>(method.name, args, std::move(options));
  }
  template <typename Args, typename R>
  Task<absl::StatusOr<R>> Call(const Method<Args, R>& method,
                               const std::type_identity_t<Args>& args) {
    return Call<R, Args>(method.name, args, CallOptions());
  }
  // By a Method<R(A...)> (none, one or several arguments): the method's
  // arguments, then optionally CallOptions; a wrong count or type fails to
  // compile. None or several are encoded here (msgpack), so they need not
  // outlive this call; one is sent as the two-type form sends it (in
  // place, valid until the call completes, when of the method's own type
  // and its codec allows). rpc/typed.h has the wire form.
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

  // Fails pending calls with UNAVAILABLE, stops the receive loop and closes
  // the connection gracefully; returns once nothing of the client runs on
  // the Worker any more. Idempotent; at once when the connection's Worker
  // is gone.
  Task<absl::Status> Close();

  // OK while usable; else why not.
  absl::Status status() const;
  size_t in_flight() const;
  // Valid as long as the Client (down, not usable, once its Worker is gone:
  // status, cause and name remain; worker() and qp() must not be used).
  cm::Connection& connection() const;

  struct Stats {
    uint64_t calls = 0;
    uint64_t late_responses = 0;  // for calls that were no longer waiting
    uint64_t cancels_sent = 0;
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

  using State = internal::ClientState;
  explicit Client(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_CLIENT_H_
