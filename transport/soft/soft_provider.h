// The soft provider: a software RNIC with RC semantics over TCP, for hosts
// without RDMA hardware. It implements transport/provider.h exactly as the
// verbs provider does (same structs, statuses and completion-channel
// mechanics); see transport/soft/README.md for the model, the wire protocol
// and the threading.
#ifndef COVERBS_TRANSPORT_SOFT_SOFT_PROVIDER_H_
#define COVERBS_TRANSPORT_SOFT_SOFT_PROVIDER_H_

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/provider.h"

namespace coverbs::transport {

// Opens the soft provider (device "soft0"). Never fails: the progress thread
// starts with the first QP, on descriptors (its io_uring and eventfd) the
// provider has made ahead of it, so that running out of descriptors later
// cannot stop it (Engine::HoldReserve in engine.h).
std::unique_ptr<Provider> CreateSoftProvider();

namespace soft {

// The lower-level API for the connection layer, which runs its own TCP
// handshake (private data) and then hands the connected socket over.
//
// Creates an RC QP on `pd` (a PD of the soft provider) that is not connected
// yet: state IBV_QPS_INIT. Receives may be posted to it; sends fail with
// InvalidArgument until ConnectQp. Its qp_num() can go into the handshake.
absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQp(ProviderPd* pd,
                                                     const QpInit& init);

// Connects `qp` (from CreateQp, still unconnected) over `connected_fd`, a
// connected stream socket whose peer end is handed to the peer QP's
// ConnectQp. Takes ownership of the fd in every case (it is closed on
// failure). The QP is in IBV_QPS_RTS when this returns OK.
absl::Status ConnectQp(ProviderQp* qp, int connected_fd);

// CreateQp + ConnectQp.
absl::StatusOr<std::unique_ptr<ProviderQp>> CreateQpOnSocket(
    ProviderPd* pd, const QpInit& init, int connected_fd);

// Applies the socket options the soft provider wants on a QP's TCP socket
// (TCP_NODELAY, large buffers). ConnectQp does it too; the connection layer
// may call it earlier. Options that do not apply (a non-TCP socket) are
// skipped.
void ConfigureSocket(int fd);

// How long a requester waits after an RNR NAK carrying IB min_rnr_timer
// `code`: the IB value divided by 10 (code 12 = 0.64 ms in IB waits 64 us).
std::chrono::microseconds RnrTimerDelay(uint8_t code);

// Completion-channel events of a soft CQ handed out by GetEvents and not yet
// acknowledged with AckEvents (verbs would refuse to destroy such a CQ; the
// soft provider allows it and lets callers check). -1 if `cq` is not soft.
int64_t UnackedCqEvents(const ProviderCq* cq);

}  // namespace soft
}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_SOFT_SOFT_PROVIDER_H_
