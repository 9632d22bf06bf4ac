// Internal: the Connector of the loop provider (transport/connector.h).
//
// Both ends are in this process: Listen enters the port in a process-wide
// table (the address must parse or resolve, but selects nothing: any
// address reaches the port's listener), Connect finds the listener there
// (after resolving the address, so a bad name fails as elsewhere; the
// request's peer address is the one dialed) and queues a request
// carrying its QP and private data; Accept creates the passive QP joined
// to the requester's (loop::CreateQp with `peer`), connects the two
// (loop::ConnectQps) and answers with its private data. Nothing crosses a
// socket: the answer wakes the requester's reactor through a core Event.
#ifndef COVERBS_TRANSPORT_LOOP_CONNECTOR_H_
#define COVERBS_TRANSPORT_LOOP_CONNECTOR_H_

#include <memory>

#include "core/reactor.h"
#include "transport/connector.h"

namespace coverbs::transport {

// `reactor`: where the OnDown callbacks of the connections it makes run.
std::unique_ptr<Connector> CreateLoopConnector(Reactor& reactor);

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_LOOP_CONNECTOR_H_
