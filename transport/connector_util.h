// Internal: helpers the connectors share (rdma_connector.cc,
// tcp_connector.cc).
#ifndef COVERBS_TRANSPORT_CONNECTOR_UTIL_H_
#define COVERBS_TRANSPORT_CONNECTOR_UTIL_H_

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/connector.h"
#include "transport/provider.h"

namespace coverbs::transport::connector_util {

// A numeric IPv4 address ("localhost" = 127.0.0.1, "" = any) and a port;
// InvalidArgument for anything else (no other host name is resolved).
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address,
                                         uint16_t port);

// "address:port", as errors name endpoints.
std::string Endpoint(const std::string& address, uint16_t port);

// `s` with "what: " in front of its message.
absl::Status Annotate(const absl::Status& s, absl::string_view what);

// The provider-level QP attributes for `setup` (inline data clamped to the
// device's).
QpInit InitFor(QpSetup& setup);

inline std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

}  // namespace coverbs::transport::connector_util

#endif  // COVERBS_TRANSPORT_CONNECTOR_UTIL_H_
