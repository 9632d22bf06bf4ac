// OpenConnector(): the connector of the Device's provider, chosen at run
// time (as select.cc chooses the provider itself).
#include "absl/strings/str_cat.h"
#include "transport/connector.h"
#include "transport/loop_connector.h"
#include "transport/rdma_connector.h"
#include "transport/tcp_connector.h"
#include "transport/verbs/verbs_provider.h"

namespace coverbs::transport {

absl::StatusOr<std::unique_ptr<Connector>> OpenConnector(Device& device,
                                                         Reactor& reactor) {
  if (VerbsContext(*device.provider()) != nullptr) {
    return CreateRdmaConnector(device, reactor);
  }
  if (device.caps().provider == "soft") return CreateTcpConnector();
  if (device.caps().provider == "loop") return CreateLoopConnector(reactor);
  return absl::UnimplementedError(
      absl::StrCat("no connection establishment for provider '",
                   device.caps().provider, "' (device ", device.name(), ")"));
}

}  // namespace coverbs::transport
