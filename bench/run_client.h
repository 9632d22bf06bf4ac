// The client's main loop: for every test and size, a warm-up, the timed
// batches, both sides' CPU, one table row; then JSON, CSV and the plot.
#ifndef COVERBS_BENCH_RUN_CLIENT_H_
#define COVERBS_BENCH_RUN_CLIENT_H_

#include <cstdint>
#include <string>

#include "bench/side.h"

namespace coverbs::bench {

// Runs every --test at every --size against the bench server at
// address:port (rpc_port for the RPC tests). `mode` is "client" or
// "loopback"; `corrupt_message` >= 0 is the fault-injection build's
// message to corrupt. Returns the exit code.
int RunClient(Side* side, const std::string& address, uint16_t port,
              uint16_t rpc_port, const std::string& mode,
              int64_t corrupt_message);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_RUN_CLIENT_H_
