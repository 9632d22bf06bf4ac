// rpc::ServerMetrics: an rpc::Server's counters and a latency histogram per
// method, exported in the Prometheus text format through prometheus-cpp
// (Debian's prometheus-cpp-dev), optionally served as /metrics over HTTP.
// An optional target (//rpc:metrics): the rpc library itself does not
// depend on prometheus-cpp.
//
//   rpc::ServerMetrics metrics;                  // outlives the server
//   rpc::ServerOptions options;
//   options.call_observer = metrics.Observer();  // latency per method
//   rpc::Server server(options);
//   metrics.Watch(&server);                      // counters, read per scrape
//   RETURN_IF_ERROR(metrics.Listen("0.0.0.0", 9464));
//   ...
//   server.Shutdown();
//   metrics.Watch(nullptr);                      // before the server goes
//
// Exported (all names prefixed coverbs_rpc_server_):
//  - the counters of Server::Stats as `<name>_total` counters, and
//    `open_connections` and `pending_handshakes` as gauges, read from
//    Server::stats() at every scrape;
//  - `call_duration_seconds{method}`: a histogram per method of the time
//    from a request's arrival to its response posted (Server's CallRecord);
//  - `method_calls_total{method,code}`: calls per method and status code
//    (OK, the handler's error code, CANCELLED).
//
// The HTTP server (civetweb, through prometheus-cpp's Exposer) serves each
// connection on one of Options::http_threads worker threads, one request
// per connection (no keep-alive). A connection that sends nothing, or its
// request a byte at a time, holds its thread at most
// Options::http_request_timeout and is then closed; so no peer silences the
// endpoint: with k such sockets open (re-opened as they are closed) a scrape
// waits at most about ceil((k + 1) / http_threads) x http_request_timeout
// (tests/rpc:metrics_test holds 2 x http_threads of them while 10 of 10
// scrapes succeed). The endpoint holds at most http_threads + 20 (civetweb's
// connection_queue) sockets; more wait in the kernel's listen backlog.
//
// Threads: every member is callable from any thread; the observer runs on
// the server's reactors, concurrently.
#ifndef COVERBS_RPC_METRICS_H_
#define COVERBS_RPC_METRICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rpc/server.h"

namespace prometheus {
class Registry;
class Exposer;
class Collectable;
}  // namespace prometheus

namespace coverbs::rpc {

class ServerMetrics {
 public:
  struct Options {
    // Upper bounds of the latency histogram's buckets, in seconds,
    // increasing: 5 us .. 10 s by default.
    std::vector<double> latency_buckets = {
        5e-6,  10e-6, 20e-6, 50e-6,  100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3,
        10e-3, 20e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,    2.5,  5.0,  10.0};
    // Listen's HTTP server. Worker threads: connections served at once
    // (civetweb's num_threads; at least 1).
    int http_threads = 16;
    // How long a connection may take to send its request (headers), from
    // when a worker takes it, and the most one write of the response may
    // wait for the peer to read (civetweb's request_timeout_ms; at least
    // 1 ms). A scraper sends its request at once: this bounds what a silent
    // or dripping peer costs.
    absl::Duration http_request_timeout = absl::Seconds(2);
  };
  ServerMetrics();
  explicit ServerMetrics(Options options);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // For ServerOptions::call_observer. It refers to this object, which must
  // outlive every server that calls it.
  CallObserver Observer();

  // The server whose stats() every scrape reads (not owned). Watch(nullptr)
  // before that server is destroyed; until then no counters are exported.
  void Watch(const Server* server);

  // Serves the metrics as http://address:port/metrics (port 0: the system
  // picks one, see port()). Once; the listener ends with this object.
  // address is an IPv4 or IPv6 literal ("::" listens on both).
  absl::Status Listen(const std::string& address, uint16_t port);
  uint16_t port() const;  // 0 before Listen

  // The registry the per-method metrics live in; a service may add its own
  // families to it (they are served too).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Everything exported, in the Prometheus text format (what /metrics
  // returns).
  std::string Text() const;

 private:
  struct MethodMetrics;
  class StatsCollectable;
  MethodMetrics& ForMethod(const CallRecord& call);
  void Record(const CallRecord& call);

  Options options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StatsCollectable> stats_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::atomic<uint16_t> port_{0};
  struct Families;
  std::unique_ptr<Families> families_;
};

}  // namespace coverbs::rpc

#endif  // COVERBS_RPC_METRICS_H_
