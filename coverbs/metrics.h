// A Prometheus endpoint for a server run by Serve(): the server's counters
// and a latency histogram per method (rpc::ServerMetrics, prometheus-cpp) at
// http://address:port/metrics while Serve runs. A separate target
// (//coverbs:metrics), so that //coverbs does not depend on prometheus-cpp.
//
//   rpc::ServerMetrics metrics;  // outlives the server
//   rpc::Server server({.call_observer = metrics.Observer()});
//   ...
//   ServeOptions options{.setup = ExportMetrics(metrics, server, "::", 9464)};
//   return Serve(server, "::", 7471, options);
#ifndef COVERBS_COVERBS_METRICS_H_
#define COVERBS_COVERBS_METRICS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "coverbs/run.h"
#include "rpc/metrics.h"

namespace coverbs {

// For ServeOptions::setup: watches `server` and listens on address:port
// (port 0: any free port, logged) before the server does; stops watching
// once the server has shut down, before Serve returns. Listen's error (a
// port in use) ends Serve. `metrics` and `server` must outlive Serve.
std::function<absl::Status(const ServeContext&)> ExportMetrics(
    rpc::ServerMetrics& metrics, const rpc::Server& server, std::string address,
    uint16_t port);

}  // namespace coverbs

#endif  // COVERBS_COVERBS_METRICS_H_
