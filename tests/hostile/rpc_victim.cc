// rpc_victim: a small rpc::Client program (RunMain) for hostile_rpc_test.sh:
// it calls "Echo" on a server -- hostile_server, usually -- and prints what
// each call returned, so the test can check that a misbehaving server
// costs the client a clear error and nothing else.
//
//   rpc_victim --port=P [--address=127.0.0.1] [--calls=4] [--rounds=2]
//              [--deadline_ms=2000] [--max_response_bytes=1024]
//              [--leave_in_flight]
//
// Each round connects a new Client on the same Worker, runs --calls calls
// at once (each with --deadline_ms through ClientOptions::call_timeout; 0:
// none), prints "round R call I: <status>" for each, then one more call
// ("round R after: <status>": a connection the server broke fails at
// once), the client's status, and closes. The rounds show the process
// going on after a server broke a connection. With --leave_in_flight the
// first round starts --calls calls without deadlines and returns an error
// while they wait (RunMain's teardown with a live client and calls in
// flight). Exit status: RunMain's -- 0 when every call succeeded, 1 (and
// the first error, logged) otherwise; a crash or a hang is the bug.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "coverbs/coverbs.h"

ABSL_FLAG(std::string, address, "127.0.0.1", "server address");
ABSL_FLAG(uint16_t, port, 0, "server port");
ABSL_FLAG(int, calls, 4, "calls at once per round");
ABSL_FLAG(int, rounds, 2, "connections, one after the other");
ABSL_FLAG(int64_t, deadline_ms, 2000, "deadline of every call; 0: none");
ABSL_FLAG(uint64_t, max_response_bytes, 1024, "largest response accepted");
ABSL_FLAG(bool, leave_in_flight, false,
          "return from main with the calls still in flight");

namespace {

using namespace coverbs;

const std::string kEcho = "Echo";
const std::string kPing = "ping";

Task<void> Detached(Task<absl::StatusOr<rpc::Response>> call) {
  (void)co_await std::move(call);
}

Task<absl::Status> Round(cm::Worker& worker, int round) {
  rpc::ClientOptions options;
  options.max_response_size = absl::GetFlag(FLAGS_max_response_bytes);
  const bool leave = absl::GetFlag(FLAGS_leave_in_flight);
  const int64_t deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  if (deadline_ms > 0 && !leave) {
    options.call_timeout = absl::Milliseconds(deadline_ms);
  }
  const std::string address = absl::GetFlag(FLAGS_address);
  CO_ASSIGN_OR_RETURN(auto client,
                      co_await rpc::Client::Connect(
                          worker, address, absl::GetFlag(FLAGS_port), options));
  const int n = absl::GetFlag(FLAGS_calls);
  if (leave) {
    // The calls are made now (each holds the client's state), and run on
    // the reactor after main has returned.
    for (int i = 0; i < n; ++i) {
      worker.reactor().Spawn(Detached(client->Call(kEcho, AsBytes(kPing))));
    }
    while (client->in_flight() < static_cast<size_t>(n)) {
      (void)co_await worker.reactor().Sleep(absl::Milliseconds(1));
    }
    (void)co_await worker.reactor().Sleep(absl::Milliseconds(50));
    std::printf("round %d: leaving with %zu call(s) in flight\n", round,
                client->in_flight());
    std::fflush(stdout);
    co_return absl::AbortedError(absl::StrCat(
        "main returns with ", client->in_flight(), " call(s) in flight"));
  }
  auto results = co_await ForEachBounded(
      n, n, [&](size_t) -> Task<absl::StatusOr<rpc::Response>> {
        co_return co_await client->Call(kEcho, AsBytes(kPing));
      });
  absl::Status first;
  for (int i = 0; i < n; ++i) {
    std::printf(
        "round %d call %d: %s\n", round, i,
        results[i].ok() ? "OK" : results[i].status().ToString().c_str());
    if (first.ok()) first = results[i].status();
  }
  auto after = co_await client->Call(kEcho, AsBytes(kPing));
  std::printf("round %d after: %s\n", round,
              after.ok() ? "OK" : after.status().ToString().c_str());
  std::printf("round %d client: %s\n", round,
              client->status().ToString().c_str());
  std::fflush(stdout);
  (void)co_await client->Close();
  co_return first;
}

Task<absl::Status> Main(cm::Worker& worker) {
  absl::Status first;
  for (int r = 1; r <= absl::GetFlag(FLAGS_rounds); ++r) {
    absl::Status s = co_await Round(worker, r);
    if (first.ok()) first = s;
    if (absl::GetFlag(FLAGS_leave_in_flight)) break;
  }
  co_return first;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return coverbs::RunMain(Main);
}
