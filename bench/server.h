// The bench server: listens for cm connections (send_bw, write_bw, read_bw,
// send_lat) and serves the "Echo" RPC (rpc_rate, rpc_lat). On each cm
// connection it reads the client's Params, runs its side of the test and
// sends back its verdict (and, when asked, its reactors' CPU time).
#ifndef COVERBS_BENCH_SERVER_H_
#define COVERBS_BENCH_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>

#include "absl/status/status.h"
#include "bench/protocol.h"
#include "bench/side.h"
#include "cm/connection.h"
#include "cm/listener.h"
#include "core/task.h"
#include "rpc/server.h"

namespace coverbs::bench {

class Server {
 public:
  explicit Server(Side* side) : side_(side) {}

  // Port 0: any free port (port() and rpc_port() say which).
  absl::Status Start(const std::string& address, uint16_t port,
                     uint16_t rpc_port);
  uint16_t port() const { return port_; }
  uint16_t rpc_port() const { return rpc_->port(); }

  // Stops accepting and waits until every bench connection ended.
  void Shutdown();

 private:
  Task<void> AcceptLoop(std::unique_ptr<cm::Listener> ln);
  Task<void> AcceptAndServe(std::unique_ptr<cm::ConnectRequest> req,
                            cm::Worker* ctx);
  Task<void> Serve(cm::Connection* conn);
  Task<absl::Status> Run(cm::Connection* conn, const Params& p, Reply* rep);

  Side* side_;
  uint16_t port_ = 0;
  std::unique_ptr<rpc::Server> rpc_;
  std::stop_source stop_;
  std::atomic<int> live_{0};
  double cpu_begin_ = 0;  // connection 0's reactor only
};

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_SERVER_H_
