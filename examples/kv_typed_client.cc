// The typed key-value client, on an rpc::ClientPool: puts --keys keys and
// gets them back with 16 calls in flight (ForEachBounded), then leases one
// connection to call Snapshot, read the whole store by one RDMA READ from
// the region the server exposed to that connection, and release it.
// Exits 0 when every byte matched; 1 with the reason otherwise: a call past
// --deadline_ms (a server that does not answer), a snapshot longer than
// --max_snapshot_bytes (one that lies), anything the library refused.
//   kv_typed_client --server=127.0.0.1 --port=7471 [--keys=1000]
//                   [--deadline_ms=10000] [--max_snapshot_bytes=268435456]
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "examples/kv_typed.h"
using namespace coverbs;

ABSL_FLAG(std::string, server, "127.0.0.1", "server address");
ABSL_FLAG(uint16_t, port, 7471, "server port");
ABSL_FLAG(size_t, keys, 1000, "keys to put, get and find in the snapshot");
ABSL_FLAG(int64_t, deadline_ms, 10000, "deadline of every call (ms)");
ABSL_FLAG(uint64_t, max_snapshot_bytes, 256 << 20,
          "longest snapshot accepted from the server");

std::string Key(size_t i) { return absl::StrCat("key-", i); }
std::string Value(size_t i) { return std::string(1 + i % 200, 'a' + i % 26); }

Task<absl::Status> Main(rpc::ClientPool& pool) {
  size_t n = absl::GetFlag(FLAGS_keys), mismatches = 0;
  auto puts = co_await ForEachBounded(
      n, 16, [&](size_t i) -> Task<absl::StatusOr<uint64_t>> {
        PutArgs args{Key(i), Value(i)};
        co_return co_await pool.Call(kPut, args);
      });
  auto gets = co_await ForEachBounded(
      n, 16, [&](size_t i) -> Task<absl::StatusOr<std::string>> {
        std::string key = Key(i);
        co_return co_await pool.Call(kGet, key);
      });
  for (size_t i = 0; i < n; ++i) {
    CO_RETURN_IF_ERROR(puts[i].status());
    CO_ASSIGN_OR_RETURN(std::string value, std::move(gets[i]));
    mismatches += value != Value(i);
  }
  auto missing = co_await pool.Call(kGet, std::string("no-such-key"));
  std::printf("Get(no-such-key): %s\n", missing.status().ToString().c_str());
  // The snapshot's token is good on the connection that carried it only.
  CO_ASSIGN_OR_RETURN(auto lease, co_await pool.Lease());
  CO_ASSIGN_OR_RETURN(RemoteRegion snap, co_await lease->Call(kSnapshot));
  // The length is the server's word: checked before anything is allocated.
  const uint64_t limit = absl::GetFlag(FLAGS_max_snapshot_bytes);
  if (snap.length > limit) {
    co_return absl::OutOfRangeError(
        absl::StrCat("the server announced a snapshot of ", snap.length,
                     " bytes, more than --max_snapshot_bytes=", limit));
  }
  std::string bytes(snap.length, '\0');
  CO_RETURN_IF_ERROR(co_await lease->connection().Read(AsBytes(bytes), snap));
  CO_RETURN_IF_ERROR((co_await lease->Call(kRelease, snap)).status());
  CO_ASSIGN_OR_RETURN(KvMap all, rpc::Codec<KvMap>::Decode(AsBytes(bytes)));
  for (size_t i = 0; i < n; ++i) mismatches += all[Key(i)] != Value(i);
  std::printf(
      "%zu key(s) put and got, 16 in flight; snapshot of %zu bytes "
      "read by one RDMA READ: %zu key(s); %zu mismatch(es)\n",
      n, bytes.size(), all.size(), mismatches);
  if (mismatches > 0) co_return absl::DataLossError("values differ");
  co_return absl::OkStatus();
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Every call gets a deadline (ClientPoolOptions::default_deadline).
  rpc::ClientPoolOptions options{
      .servers = {{absl::GetFlag(FLAGS_server), absl::GetFlag(FLAGS_port)}},
      .default_deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms))};
  return RunClientPool(Main, std::move(options));
}
