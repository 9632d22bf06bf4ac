// The listen and accept path: the Context's transport::Connector listens
// (rdma_cm or the soft provider's TCP setup); each request's handshake is
// decoded here, then accepted (ConnectionSetup puts the Connection on the
// QP the connector creates) or rejected with a reason.
#include "cm/listener.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cm/connection_setup.h"
#include "cm/context_shared.h"
#include "transport/connector.h"

namespace coverbs::cm {

namespace {

std::string Endpoint(const std::string& a, uint16_t p) {
  return absl::StrCat(a, ":", p);
}

absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

namespace internal {

struct ConnectRequestState {
  Context* listener_ctx = nullptr;
  Listener::Stats* stats = nullptr;
  std::weak_ptr<bool> listener_alive;
  ListenerOptions options;
  PeerInfo peer;
  bool decided = false;
  std::unique_ptr<transport::IncomingRequest> request;
};

struct ListenerState {
  Context* ctx = nullptr;
  std::string address;
  uint16_t port = 0;
  ListenerOptions options;
  bool closed = false;
  Listener::Stats stats;
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
  std::shared_ptr<transport::PassiveEndpoint> endpoint;
};

}  // namespace internal

using internal::ConnectRequestState;
using internal::ListenerState;

namespace {

void CountReject(ConnectRequestState& st, std::string_view reason) {
  if (!st.listener_alive.expired() && st.stats != nullptr) {
    ++st.stats->rejected;
    st.stats->last_reject_reason = std::string(reason);
  }
}

absl::Status RejectState(ConnectRequestState& st, std::string_view reason) {
  st.decided = true;
  CountReject(st, reason);
  return st.request->Reject(reason);
}

}  // namespace

ConnectRequest::ConnectRequest(std::unique_ptr<ConnectRequestState> s)
    : state_(std::move(s)) {}

ConnectRequest::~ConnectRequest() {
  if (state_ != nullptr && !state_->decided) {
    RejectState(*state_, "not accepted").IgnoreError();
  }
}

const PeerInfo& ConnectRequest::peer() const { return state_->peer; }

absl::Status ConnectRequest::Reject(std::string_view reason) {
  if (state_->decided) {
    return absl::FailedPreconditionError("connect request already decided");
  }
  return RejectState(*state_, reason);
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> ConnectRequest::Accept(
    Context& ctx) {
  ConnectRequestState& st = *state_;
  std::string where =
      absl::StrCat("accept from ", Endpoint(st.peer.address, st.peer.port));
  if (st.decided) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(where, ": request already decided"));
  }
  if (&ctx.device() != &st.listener_ctx->device()) {
    st.decided = true;
    co_return absl::InvalidArgumentError(
        absl::StrCat(where, ": the target context uses another device"));
  }
  absl::Time deadline = absl::Now() + st.options.accept_timeout;
  auto setup = internal::ConnectionSetup::Create(ctx, st.options.connection,
                                                 /*active_side=*/false);
  if (!setup.ok()) {
    RejectState(st, std::string(setup.status().message())).IgnoreError();
    co_return Annotate(setup.status(), where);
  }
  st.decided = true;
  auto est = co_await st.request->Accept(internal::ConnectorOf(ctx), **setup,
                                         deadline);
  if (!est.ok()) {
    if (st.request->rejected()) CountReject(st, st.request->reject_reason());
    co_return est.status();
  }
  auto conn = (*setup)->Start(st.peer, std::move(est->link));
  if (!conn.ok()) co_return conn.status();
  if (!st.listener_alive.expired()) ++st.stats->accepted;
  co_return conn;
}

// ---------------------------------------------------------------------------

Listener::Listener(std::unique_ptr<ListenerState> s) : state_(std::move(s)) {}
Listener::~Listener() { Close(); }

uint16_t Listener::port() const { return state_->port; }
const std::string& Listener::address() const { return state_->address; }
const Listener::Stats& Listener::stats() const { return state_->stats; }

void Listener::Close() {
  if (state_->closed) return;
  state_->closed = true;
  if (state_->endpoint != nullptr) state_->endpoint->Close();
  state_->endpoint.reset();
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Create(
    Context& ctx, std::string address, uint16_t port, ListenerOptions options) {
  auto st = std::make_unique<ListenerState>();
  st->ctx = &ctx;
  st->address = address;
  st->options = std::move(options);
  auto ep =
      internal::ConnectorOf(ctx).Listen(address, port, st->options.backlog);
  if (!ep.ok()) return ep.status();
  st->endpoint = *std::move(ep);
  st->port = st->endpoint->port();
  return std::unique_ptr<Listener>(new Listener(std::move(st)));
}

Task<absl::StatusOr<std::unique_ptr<ConnectRequest>>> Listener::Next() {
  ListenerState& st = *state_;
  std::string where = absl::StrCat("listener ", Endpoint(st.address, st.port));
  for (;;) {
    if (st.closed) {
      co_return absl::CancelledError(absl::StrCat(where, ": closed"));
    }
    // Bounded waits so that Close() is noticed promptly; the endpoint stays
    // alive while this waits on it.
    std::shared_ptr<transport::PassiveEndpoint> ep = st.endpoint;
    auto in = co_await ep->Next(absl::Milliseconds(100));
    if (!in.ok()) {
      if (in.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
      co_return in.status();
    }
    auto req = std::make_unique<ConnectRequestState>();
    req->listener_ctx = st.ctx;
    req->stats = &st.stats;
    req->listener_alive = st.alive;
    req->options = st.options;
    req->request = *std::move(in);
    req->peer.address = req->request->peer_address();
    req->peer.port = req->request->peer_port();
    // A peer that connects and never sends its request (soft) is dropped
    // after accept_timeout; others are served only after this one --
    // requests are small and come at once from coverbs peers.
    auto private_data = co_await req->request->ReadPrivateData(
        absl::Now() + st.options.accept_timeout);
    ++st.stats.requests;
    if (!private_data.ok()) {
      ++st.stats.rejected;
      st.stats.last_reject_reason =
          std::string(private_data.status().message());
      continue;
    }
    auto h = DecodeHandshake(std::as_bytes(std::span(*private_data)));
    if (!h.ok()) {
      RejectState(*req, std::string(h.status().message())).IgnoreError();
      continue;
    }
    req->peer.handshake = *std::move(h);
    co_return std::unique_ptr<ConnectRequest>(
        new ConnectRequest(std::move(req)));
  }
}

Task<absl::StatusOr<std::unique_ptr<Connection>>> Listener::Accept() {
  for (;;) {
    auto req = co_await Next();
    if (!req.ok()) co_return req.status();
    if (state_->options.admit) {
      absl::Status s = state_->options.admit((*req)->peer());
      if (!s.ok()) {
        (*req)->Reject(std::string(s.message())).IgnoreError();
        continue;
      }
    }
    auto conn = co_await (*req)->Accept(*state_->ctx);
    // One failed setup (the peer gave up, say) does not stop the listener.
    if (!conn.ok()) continue;
    co_return conn;
  }
}

}  // namespace coverbs::cm
