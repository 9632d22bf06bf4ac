// rpc::Context: what a handler knows about its call and its caller, and
// what it can do on the caller's connection. rpc::Request is a Context with
// the request's payload.
//
//   server.Register(kSnapshot, [](rpc::Context& ctx)
//                                   -> Task<absl::StatusOr<RemoteRegion>> {
//     if (ctx.app_data() != "tenant-a") co_return absl::PermissionDeniedError("..");
//     // The bytes outlive the response until the caller's Release
//     // (ctx.Revoke) or its connection's end; the key is this caller's only.
//     co_return ctx.ExposeBytes(std::string(...));
//   });
//
// Contract:
//  - Valid while the handler runs (the server owns what it points to).
//    Everything but stop_token() is for the connection's reactor thread,
//    where the handler starts.
//  - connection() is the caller's cm::Connection: Expose on it gives a key
//    that this connection alone may use where the device scopes keys per
//    connection (cm::Connection::Expose says what each device does).
//  - stop_token() is the handler's ambient token (the same one the
//    handler's co_awaits honour): stop is requested when the caller
//    cancels (cancel frame, its deadline) or the server shuts down.
#ifndef COVERBS_RPC_CONTEXT_H_
#define COVERBS_RPC_CONTEXT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cm/connection.h"
#include "rpc/payload.h"
#include "transport/device.h"

namespace coverbs::rpc {

class Server;

class Context {
 public:
  std::string_view method;  // the registered name (lives with the server)
  uint32_t method_id = 0;
  uint64_t call_id = 0;
  const cm::PeerInfo* peer = nullptr;  // the caller's address and handshake

  // The caller's numeric address and the app_data its handshake carried
  // (rpc::ClientOptions::connect.app_data; what the admission hook saw).
  const std::string& peer_address() const { return peer->address; }
  const std::string& app_data() const { return peer->handshake.app_data; }

  // The connection the call came on.
  cm::Connection& connection() const { return *conn_; }

  // Stop requested: the caller gave up or the server shuts down.
  std::stop_token stop_token() const {
    return stop_ != nullptr ? stop_->get_token() : std::stop_token();
  }
  bool cancelled() const { return stop_ != nullptr && stop_->stop_requested(); }

  // connection().Expose: a token for `mr` (registered in the connection's
  // PD, connection().worker().pd()) that this caller's connection uses.
  absl::StatusOr<transport::RemoteRegion> Expose(
      const transport::MemoryRegion& mr) const {
    return conn_->Expose(mr);
  }
  absl::StatusOr<transport::RemoteRegion> Expose(
      const transport::MemoryRegion& mr, transport::Access access,
      size_t offset = 0, size_t length = transport::MemoryRegion::npos) const {
    return conn_->Expose(mr, access, offset, length);
  }

  // Moves `bytes` (a std::string or std::vector<std::byte>, say) into an
  // exposure for this caller's connection only, read-only: the token
  // reaches them until Revoke(token) -- e.g. from a "release" method the
  // caller invokes once it read them -- or the connection's end, and the
  // bytes are freed right after the exposure ended. Counts against the
  // connection's ConnectionOptions::max_exposures and max_exposed_bytes
  // (ResourceExhausted past them: a caller that never releases is refused,
  // its memory stays bounded). Errors as Connection::Expose's.
  template <typename Bytes>
  absl::StatusOr<transport::RemoteRegion> ExposeBytes(Bytes bytes) const {
    struct Owned {
      Bytes bytes;
      transport::MemoryRegion mr;
    };
    auto owned = std::make_shared<Owned>(Owned{std::move(bytes), {}});
    auto span = std::as_writable_bytes(std::span(owned->bytes));
    auto mr = conn_->worker().pd().Register(span, transport::Access::kNone);
    if (!mr.ok()) return mr.status();
    owned->mr = *std::move(mr);
    const transport::MemoryRegion& region = owned->mr;
    return conn_->ExposeOwned(std::move(owned), region,
                              transport::Access::kRemoteRead);
  }
  // connection().Revoke: ends an exposure of this caller's connection (and
  // frees what ExposeBytes kept for it). NotFound for a token this
  // connection does not hold.
  absl::Status Revoke(const transport::RemoteRegion& token) const {
    return conn_->Revoke(token);
  }

  // Keeps `owner` alive until the connection has closed (then releases
  // what it kept on the connection's reactor, newest first: keep a buffer,
  // then its MemoryRegion): for memory exposed to this caller that
  // must outlive the response, such as a region the caller reads after the
  // call. Closing the connection before the release means the peer's QP is
  // gone before the memory is deregistered.
  void KeepUntilClose(std::shared_ptr<void> owner) const {
    keep_->push_back(std::move(owner));
  }
  // The same for a value (a buffer, a MemoryRegion), moved into the
  // connection's keeping: returns it where it stays until the release.
  template <typename T>
    requires(!std::is_convertible_v<T, std::shared_ptr<void>>)
  T& KeepUntilClose(T value) const {
    auto owner = std::make_shared<T>(std::move(value));
    T& kept = *owner;
    keep_->push_back(std::move(owner));
    return kept;
  }

 private:
  friend class Server;
  cm::Connection* conn_ = nullptr;
  const std::stop_source* stop_ = nullptr;
  std::vector<std::shared_ptr<void>>* keep_ = nullptr;
};

// A request: its context and its payload (a view of the connection's
// receive or rendezvous buffer, or a copy; see rpc/server.h).
struct Request : Context {
  Payload payload;
  std::span<const std::byte> data() const { return payload.data(); }
};

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_CONTEXT_H_
