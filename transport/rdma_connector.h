// Internal: the Connector of the verbs provider (transport/connector.h),
// over rdma_cm.
//
// One rdma_event_channel per connector (created on first use), its fd
// watched by the reactor (rdma_cm_events.h): every event is copied and acked
// at once, then queued on the id it belongs to. Each step has a timeout and
// each failure event its own Status naming address, port and step:
// ADDR_ERROR / ROUTE_ERROR / UNREACHABLE / CONNECT_ERROR -> Unavailable,
// REJECTED with a reject payload -> PermissionDenied with the peer's reason,
// REJECTED without (no listener, a foreign peer) -> Unavailable "connection
// refused", DEVICE_REMOVAL -> Aborted, timeouts -> DeadlineExceeded. After
// ESTABLISHED the id's DISCONNECTED / DEVICE_REMOVAL / TIMEWAIT_EXIT drive
// the connection's link.
//
// iWARP: rdma_connect makes the TCP connection inside the call, so it runs
// on a helper thread and is interrupted at the connect deadline; an
// EADDRNOTAVAIL is retried with a fresh id and QP (rdma_connector.cc).
#ifndef COVERBS_TRANSPORT_RDMA_CONNECTOR_H_
#define COVERBS_TRANSPORT_RDMA_CONNECTOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/reactor.h"
#include "transport/connector.h"
#include "transport/device.h"

namespace coverbs::transport {

std::unique_ptr<Connector> CreateRdmaConnector(Device& device,
                                               Reactor& reactor);

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_RDMA_CONNECTOR_H_
