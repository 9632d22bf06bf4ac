#include "coverbs/metrics.h"

#include <memory>
#include <utility>

#include "core/log.h"

namespace coverbs {

std::function<absl::Status(const ServeContext&)> ExportMetrics(
    rpc::ServerMetrics& metrics, const rpc::Server& server, std::string address,
    uint16_t port) {
  return [&metrics, &server, address = std::move(address),
          port](const ServeContext& ctx) -> absl::Status {
    metrics.Watch(&server);
    // ServeContext::keep is released after the server's shutdown and
    // before Serve returns: no scrape reads a server that is going.
    ctx.keep.push_back(std::shared_ptr<void>(&metrics, [](void* m) {
      static_cast<rpc::ServerMetrics*>(m)->Watch(nullptr);
    }));
    absl::Status s = metrics.Listen(address, port);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          "metrics endpoint: " + std::string(s.message()));
    }
    COVERBS_LOG(kInfo, "run", "metrics on http://%s:%u/metrics", address,
                metrics.port());
    return absl::OkStatus();
  };
}

}  // namespace coverbs
