// One entry per test kind: the client's driver of one run on one
// connection, and the server's side of it. Each kind lives in its own file:
//   send_bw.cc  (send_bw)    send_lat.cc  (send_lat)
//   one_sided.cc  (write_bw, read_bw)    rpc_echo.cc  (rpc_rate, rpc_lat)
#ifndef COVERBS_BENCH_TEST_KINDS_H_
#define COVERBS_BENCH_TEST_KINDS_H_

#include "absl/status/status.h"
#include "bench/driver.h"
#include "bench/protocol.h"
#include "cm/connection.h"
#include "core/task.h"
#include "rpc/server.h"

namespace coverbs::bench {

// Client drivers. Except for RPC, the client has sent the Params and
// registered size * depth bytes of local memory (EnsureMemory) before.
Task<absl::Status> DriveSendBw(ClientConn* c, const RunSpec& spec,
                               ConnRun* out);
Task<absl::Status> DriveSendLat(ClientConn* c, const RunSpec& spec,
                                ConnRun* out);
Task<absl::Status> DriveOneSided(ClientConn* c, const RunSpec& spec,
                                 ConnRun* out);
Task<absl::Status> DriveRpc(ClientConn* c, const RunSpec& spec, ConnRun* out);

// Server sides of the runs the Params ask for; `rep` is the verdict.
Task<absl::Status> ServeSendBw(cm::Connection* conn, const Params& p,
                               Reply* rep);
Task<absl::Status> ServeSendLat(cm::Connection* conn, const Params& p,
                                Reply* rep);
Task<absl::Status> ServeOneSided(cm::Connection* conn, const Params& p,
                                 Reply* rep);
// The "Echo" method rpc_rate and rpc_lat call.
absl::Status RegisterEcho(rpc::Server& server);

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_TEST_KINDS_H_
