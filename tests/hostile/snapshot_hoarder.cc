// A kv_typed client that takes snapshots and never releases them (issue
// #37: every Snapshot exposed memory kept until the connection closed, with
// no bound): puts --keys keys, then calls Snapshot --snapshots times on one
// connection without Release, and reports how many the server granted and
// how it refused the rest:
//   hoarder: granted G refused R other O; first refusal: <status>
// then holds the connection for --hold_ms (the test reads the server's
// memory meanwhile) and, with --release, releases what it holds before it
// closes. Exit 0 unless the connection itself failed.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "examples/kv_typed.h"

ABSL_FLAG(std::string, server, "127.0.0.1", "kv_typed_server address");
ABSL_FLAG(uint16_t, port, 7471, "kv_typed_server port");
ABSL_FLAG(size_t, keys, 500, "keys to put first (the snapshot's size)");
ABSL_FLAG(size_t, snapshots, 3000, "Snapshot calls, none released");
ABSL_FLAG(int64_t, hold_ms, 0, "hold the connection this long afterwards");
ABSL_FLAG(bool, release, false, "release every granted snapshot at the end");

namespace coverbs {
namespace {

Task<absl::Status> Main(cm::Worker& worker) {
  rpc::ClientOptions options;
  options.call_timeout = absl::Seconds(20);
  CO_ASSIGN_OR_RETURN(auto client, co_await rpc::Client::Connect(
                                       worker, absl::GetFlag(FLAGS_server),
                                       absl::GetFlag(FLAGS_port), options));
  for (size_t i = 0; i < absl::GetFlag(FLAGS_keys); ++i) {
    PutArgs args{absl::StrCat("key-", i), std::string(100, 'v')};
    CO_RETURN_IF_ERROR((co_await client->Call(kPut, args)).status());
  }
  std::vector<RemoteRegion> held;
  size_t refused = 0, other = 0;
  std::string first_refusal = "none";
  for (size_t i = 0; i < absl::GetFlag(FLAGS_snapshots); ++i) {
    auto snap = co_await client->Call(kSnapshot);
    if (snap.ok()) {
      held.push_back(*snap);
    } else if (snap.status().code() == absl::StatusCode::kResourceExhausted) {
      if (refused++ == 0) first_refusal = snap.status().ToString();
    } else {
      ++other;
      if (!client->connection().status().ok()) co_return snap.status();
    }
  }
  std::printf("hoarder: granted %zu refused %zu other %zu; first refusal: %s\n",
              held.size(), refused, other, first_refusal.c_str());
  std::fflush(stdout);
  const int64_t hold_ms = absl::GetFlag(FLAGS_hold_ms);
  if (hold_ms > 0) {
    (void)co_await Reactor::Current()->Sleep(absl::Milliseconds(hold_ms));
  }
  if (absl::GetFlag(FLAGS_release)) {
    for (const RemoteRegion& r : held) {
      CO_RETURN_IF_ERROR((co_await client->Call(kRelease, r)).status());
    }
    // Released: a new snapshot is granted again.
    CO_RETURN_IF_ERROR((co_await client->Call(kSnapshot)).status());
    std::printf("hoarder: released %zu; a new snapshot was granted\n",
                held.size());
  }
  co_return co_await client->Close();
}

}  // namespace
}  // namespace coverbs

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return coverbs::RunMain(coverbs::Main);
}
