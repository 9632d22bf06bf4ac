// The connect path: the Worker's transport::Connector makes the connection
// (rdma_cm or the soft provider's TCP setup), ConnectionSetup puts the
// Connection on its QP, and the peer's handshake starts it.
#include "cm/connect.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cm/connect_for_test.h"
#include "cm/connection_setup.h"
#include "cm/worker_shared.h"
#include "cm/handshake.h"

namespace coverbs::cm {
namespace {

struct ConnectArgs {
  std::string address;
  uint16_t port = 0;
  ConnectOptions options;
  std::string raw_private_data;  // tests: sent instead of the handshake
};

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectWith(
    Worker& ctx, std::unique_ptr<ConnectArgs> args) {
  const ConnectOptions& o = args->options;
  std::string where =
      absl::StrCat("connect to ", args->address, ":", args->port);
  auto setup = internal::ConnectionSetup::Create(ctx, o.connection,
                                                 /*active_side=*/true);
  if (!setup.ok()) co_return Annotate(setup.status(), where);
  (*setup)->set_app_data(o.app_data);
  (*setup)->set_raw_private_data(args->raw_private_data);
  transport::ConnectParams params;
  params.address = args->address;
  params.port = args->port;
  params.resolve_timeout = o.resolve_timeout;
  params.connect_timeout = o.connect_timeout;
  auto est = co_await internal::ConnectorOf(ctx).Connect(params, **setup);
  if (!est.ok()) {
    // No CQ had room: say which options bound it, not only that one is full.
    const absl::Status& why = (*setup)->cq_error();
    if (!why.ok()) {
      co_return Annotate(why, where);
    }
    co_return est.status();
  }
  auto peer_h = DecodeHandshake(std::as_bytes(std::span(est->private_data)));
  if (!peer_h.ok()) {
    co_return Annotate(peer_h.status(),
                       absl::StrCat(where, ": the peer's handshake"));
  }
  PeerInfo peer;
  peer.address = args->address;
  peer.port = args->port;
  peer.handshake = *std::move(peer_h);
  co_return (*setup)->Start(std::move(peer), std::move(est->link));
}

}  // namespace

// Not a coroutine and taking no class by value, so callers never create
// by-value temporaries inside their co_await expressions (gcc 12 handles
// some of those wrongly); the arguments reach the coroutine frame in one
// heap object.
Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Worker& ctx, const std::string& address, uint16_t port,
    const ConnectOptions& options) {
  auto args = std::make_unique<ConnectArgs>();
  args->address = address;
  args->port = port;
  args->options = options;
  return ConnectWith(ctx, std::move(args));
}

namespace internal {

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectWithPrivateData(
    Worker& ctx, const std::string& address, uint16_t port,
    const ConnectOptions& options, const std::string& private_data) {
  auto args = std::make_unique<ConnectArgs>();
  args->address = address;
  args->port = port;
  args->options = options;
  args->raw_private_data = private_data;
  return ConnectWith(ctx, std::move(args));
}

}  // namespace internal

Task<absl::StatusOr<std::unique_ptr<Connection>>> Connect(
    Worker& ctx, const std::string& address, uint16_t port) {
  static const ConnectOptions kDefaults;
  return Connect(ctx, address, port, kDefaults);
}

}  // namespace coverbs::cm
