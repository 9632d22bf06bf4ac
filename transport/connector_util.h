// Internal: helpers the connectors share (rdma_connector.cc,
// tcp_connector.cc).
#ifndef COVERBS_TRANSPORT_CONNECTOR_UTIL_H_
#define COVERBS_TRANSPORT_CONNECTOR_UTIL_H_

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/task.h"
#include "transport/connector.h"
#include "transport/provider.h"

namespace coverbs::transport::connector_util {

// An IPv4 or IPv6 socket address with its port.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const {
    return reinterpret_cast<const sockaddr*>(&storage);
  }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&storage); }
  int family() const { return storage.ss_family; }
  // The numeric address, without the port ("10.0.0.1", "::1").
  std::string Numeric() const;
  // 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104.
  bool IsLoopback() const;
};

// A numeric IPv4 or IPv6 address ("::1", also in brackets "[::1]"), "" =
// any IPv4 address (0.0.0.0); NotFound when `address` is none of these (a
// host name: see Resolve).
absl::StatusOr<SocketAddress> ParseNumeric(const std::string& address,
                                           uint16_t port);

// The address to listen on: ParseNumeric's ("localhost" = 127.0.0.1),
// else the first address getaddrinfo gives for the host name (it blocks:
// a listener starts once).
// InvalidArgument naming the address when it resolves to nothing.
absl::StatusOr<SocketAddress> ListenAddress(const std::string& address,
                                            uint16_t port);

// Every address to try in turn to reach `address`, in the resolver's order:
// a numeric one at once; a host name through getaddrinfo (IPv4 and IPv6)
// on a thread of its own, so that the reactor never blocks, within
// `timeout` (DeadlineExceeded past it; the lookup then finishes unseen).
// Unavailable "address resolution failed" naming the name and getaddrinfo's
// reason when it resolves to nothing. Cancellable (stop token).
Task<absl::StatusOr<std::vector<SocketAddress>>> Resolve(
    const std::string& address, uint16_t port, absl::Duration timeout);

// "address:port" ("[::1]:port" for IPv6), as errors name endpoints.
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
