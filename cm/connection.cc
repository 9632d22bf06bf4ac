#include "cm/connection.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "cm/connection_impl.h"

namespace coverbs::cm {

// ---------------------------------------------------------------------------
// Message

void Message::ReleaseOwner() { owner_->Release(); }
// ---------------------------------------------------------------------------
// Connection

Connection::Connection(std::shared_ptr<internal::ConnectionImpl> impl)
    : impl_(std::move(impl)) {}
// Internal tasks (control sends) keep the state alive until they end; the
// abort wakes or flushes all of them.
Connection::~Connection() {
  impl_->Abort(absl::UnavailableError("connection destroyed"));
}

std::optional<Message> Connection::TryRecv() { return impl_->TryRecv(); }
// One-sided operations run to their completion whatever the caller's stop
// token says (Unstoppable): a posted work request cannot be taken back from
// the NIC, and cancelling it would move the QP to the error state -- the
// connection's end for every caller (the transport's retry timer bounds the
// wait).
using ::coverbs::internal::Unstoppable;

Task<absl::Status> Connection::Read(transport::LocalBuffer local,
                                    transport::RemoteRegion remote) {
  return Unstoppable(impl_->OneSided(true, local, remote));
}
Task<absl::Status> Connection::Write(transport::LocalBuffer local,
                                     transport::RemoteRegion remote) {
  return Unstoppable(impl_->OneSided(false, local, remote));
}
Task<absl::Status> Connection::Read(std::span<std::byte> local,
                                    transport::RemoteRegion remote) {
  return Unstoppable(
      impl_->OneSidedPlain(true, local.data(), local.size(), remote));
}
Task<absl::Status> Connection::Write(std::span<const std::byte> local,
                                     transport::RemoteRegion remote) {
  return Unstoppable(
      impl_->OneSidedPlain(false, local.data(), local.size(), remote));
}
Task<absl::StatusOr<uint64_t>> Connection::FetchAdd(
    transport::RemoteRegion remote, uint64_t add) {
  return Unstoppable(impl_->Atomic(false, remote, add, 0));
}
Task<absl::StatusOr<uint64_t>> Connection::CompareSwap(
    transport::RemoteRegion remote, uint64_t compare, uint64_t swap) {
  return Unstoppable(impl_->Atomic(true, remote, compare, swap));
}
namespace {
// The state stays alive until Close ends, even when another caller's Close
// returns first and destroys the Connection.
Task<absl::Status> CloseHolding(
    std::shared_ptr<internal::ConnectionImpl> impl) {
  co_return co_await impl->Close();
}
}  // namespace

Task<absl::Status> Connection::Close() { return CloseHolding(impl_); }

absl::Status Connection::status() const { return impl_->status(); }
CloseCause Connection::close_cause() const { return impl_->close_cause(); }
const PeerInfo& Connection::peer() const { return impl_->peer(); }
const Handshake& Connection::local_handshake() const {
  return impl_->local_handshake();
}
Worker& Connection::worker() const { return impl_->worker(); }
transport::QueuePair& Connection::qp() const { return impl_->qp(); }
const std::string& Connection::name() const { return impl_->name(); }
Connection::Stats Connection::stats() const { return impl_->stats(); }

}  // namespace coverbs::cm
