// The loop provider: both ends of every connection in this process, each
// work request executed at once by a copy through a process-wide
// memory-region table -- no wire, no progress thread. It exists to measure
// the framework's own ceiling (core + transport + cm + rpc with nothing
// under them) and to run the provider-independent suites without sockets.
// It implements transport/provider.h as the other providers do (same
// structs, statuses, completion-channel mechanics); qp.h says how work
// requests run and fail, README.md what is left out.
#ifndef COVERBS_TRANSPORT_LOOP_LOOP_PROVIDER_H_
#define COVERBS_TRANSPORT_LOOP_LOOP_PROVIDER_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/provider.h"

namespace coverbs::transport {

// Opens the loop provider (device "loop"). Fails only if an eventfd cannot
// be made.
absl::StatusOr<std::unique_ptr<Provider>> CreateLoopProvider();

namespace loop {

// The lower-level API for the loop connector.
//
// Creates an RC QP on `pd` (a PD of the loop provider) in IBV_QPS_INIT:
// receives may be posted to it; sends fail with InvalidArgument until
// ConnectQps. With `peer` (another loop QP, still in INIT), the new QP is
// made to be connected to that one: it must then not be used from another
// thread before ConnectQps(peer, new QP) returns.
absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQp(
    ProviderPd* pd, const QpInit& init, ProviderQp* peer = nullptr);

// Connects `active` and `passive` (the QP created with `peer` = active):
// both move to IBV_QPS_RTS. Thread-safe with respect to `active`'s users.
absl::Status ConnectQps(ProviderQp* active, ProviderQp* passive);

}  // namespace loop
}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_LOOP_LOOP_PROVIDER_H_
