// Internal: the Connector of the soft provider (transport/connector.h).
//
// The same steps as rdma_cm over a TCP connection made on the reactor
// (non-blocking sockets): the connecting side sends a request frame carrying
// its private data, the listener answers with an accept frame (its private
// data) or a reject frame (the reason); then the socket is handed to the
// soft QP (soft::ConnectQp), whose own wire protocol starts right after the
// frames.
//   Frame: u32 magic "CVBS", u8 kind (1 request, 2 accept, 3 reject),
//   u8 pad, u16 length, then `length` bytes (<= 512).
#ifndef COVERBS_TRANSPORT_TCP_CONNECTOR_H_
#define COVERBS_TRANSPORT_TCP_CONNECTOR_H_

#include <memory>

#include "transport/connector.h"

namespace coverbs::transport {

std::unique_ptr<Connector> CreateTcpConnector();

}  // namespace coverbs::transport

#endif  // COVERBS_TRANSPORT_TCP_CONNECTOR_H_
