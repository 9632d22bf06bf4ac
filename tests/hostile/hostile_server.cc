// hostile_server: a misbehaving RPC server, for tests only (issue #36.6,
// the client side). It accepts rpc::Client connections and answers their
// requests the way a broken or malicious server would; the client under
// test must get a clear error, end or keep its process cleanly, never crash
// and never hang (hostile_rpc_test.sh).
//
//   hostile_server --mode=MODE --port=P [--address=127.0.0.1]
//
// Connection-level modes (every accepted connection, every request):
//   silent         accepts, reads the requests, never answers
//   garbage        answers each request with 64 random bytes (no frame)
//   huge_length    a response header announcing 4 GiB - 1 payload bytes,
//                  with 8 behind it
//   oversize       a well-formed 4 KiB response (the client under test
//                  accepts less: ClientOptions::max_response_size)
//   unknown_id     a well-formed response for a call id never issued
//   wrong_type     a request frame sent to the client
//   after_goodbye  the cm GOODBYE (orderly close: nothing may follow), then
//                  the response to the request as DATA after it
// Typed modes (an rpc::Server with kv_typed.h's methods: Put and Get work,
// Snapshot lies about the region; any other method is NOT_FOUND):
//   kv_snapshot_huge   a region of 2^40 bytes
//   kv_snapshot_4g     a region of 0xffffffff bytes
//   kv_snapshot_badkey a region of 64 bytes with a key that exists nowhere
// Runs until killed (typed modes: until SIGINT/SIGTERM). Loopback or
// VM-internal addresses only; it answers only what it is sent.
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "cm/connection_test_peer.h"
#include "cm/listener.h"
#include "coverbs/coverbs.h"
#include "examples/kv_typed.h"
#include "rpc/wire.h"

ABSL_FLAG(std::string, mode, "", "how to misbehave (see the file's header)");
ABSL_FLAG(std::string, address, "127.0.0.1", "address to listen on");
ABSL_FLAG(uint16_t, port, 0, "port to listen on");

namespace {

using namespace coverbs;
using cm::internal::ConnectionTestPeer;

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string Str(const rpc::HeaderBytes& h) {
  return std::string(reinterpret_cast<const char*>(h.data()), h.size());
}

// The answer to request (id, method) in `mode`; empty: none.
std::string Answer(const std::string& mode, uint64_t id, uint32_t method,
                   std::mt19937_64& rng) {
  if (mode == "garbage") {
    std::string s(64, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  }
  if (mode == "huge_length") {
    return Str(rpc::ResponseHeader(id, method, 0xffffffffu)) +
           std::string(8, 'h');
  }
  if (mode == "oversize") {
    return Str(rpc::ResponseHeader(id, method, 4096)) + std::string(4096, 'o');
  }
  if (mode == "unknown_id") {
    return Str(rpc::ResponseHeader(id + 1000000, method, 4)) + "oops";
  }
  if (mode == "wrong_type") return Str(rpc::RequestHeader(id, method, 0));
  return "";
}

Task<void> Misbehave(std::unique_ptr<cm::Connection> conn, std::string mode) {
  std::mt19937_64 rng(1);
  rpc::DecodeLimits limits;
  bool said_goodbye = false;
  for (;;) {
    auto m = co_await conn->Recv();
    if (!m.ok()) break;  // the client ended the connection
    auto f = rpc::DecodeFrame(m->data(), rpc::Side::kServer, limits);
    if (!f.ok() || f->header.type != rpc::FrameType::kRequest) continue;
    const uint64_t id = f->header.call_id;
    const uint32_t method = f->header.method_id;
    if (mode == "after_goodbye") {
      if (said_goodbye) continue;
      said_goodbye = true;
      // GOODBYE says nothing follows; a response for a call in flight
      // does, as the DATA a client would have delivered before.
      const std::string data = Str(rpc::ResponseHeader(id, method, 4)) + "late";
      const std::span<const std::byte> none;
      // Started in this order in one turn of the loop (WhenAll), so both
      // leave together and the client takes them in one go: the DATA is
      // there before anything could report the GOODBYE's close.
      auto sent = co_await WhenAll(
          ConnectionTestPeer::SendRaw(*conn, cm::internal::kGoodbye, none),
          ConnectionTestPeer::SendRaw(*conn, cm::internal::kData, Bytes(data)));
      (void)sent;
      continue;
    }
    const std::string answer = Answer(mode, id, method, rng);
    if (answer.empty()) continue;  // silent
    (void)co_await conn->Send(Bytes(answer));
  }
  std::printf("hostile_server: %s: connection ended: %s\n", mode.c_str(),
              conn->status().ToString().c_str());
  std::fflush(stdout);
}

Task<absl::Status> RawMain(cm::Worker& worker) {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  CO_ASSIGN_OR_RETURN(auto listener,
                      cm::Listener::Create(worker, absl::GetFlag(FLAGS_address),
                                           absl::GetFlag(FLAGS_port)));
  std::printf("hostile_server: mode %s, port %d\n", mode.c_str(),
              listener->port());
  std::fflush(stdout);
  for (;;) {
    auto conn = co_await listener->Accept();
    if (!conn.ok()) {  // a refused handshake: keep listening
      (void)co_await worker.reactor().Sleep(absl::Milliseconds(10));
      continue;
    }
    worker.reactor().Spawn(Misbehave(*std::move(conn), mode));
  }
}

// Typed modes: a kv server whose Snapshot lies.
std::mutex mu;
KvMap store;

Task<absl::StatusOr<uint64_t>> Put(PutArgs a) {
  std::lock_guard lock(mu);
  store[std::move(a.key)] = std::move(a.value);
  co_return store.size();
}

Task<absl::StatusOr<std::string>> Get(std::string key) {
  std::lock_guard lock(mu);
  auto it = store.find(key);
  if (it == store.end()) co_return absl::NotFoundError("no key " + key);
  co_return it->second;
}

Task<absl::StatusOr<RemoteRegion>> LyingSnapshot() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  RemoteRegion r;
  r.addr = 0x10000;
  r.rkey = 0x5eed;
  if (mode == "kv_snapshot_huge") r.length = 1ull << 40;
  if (mode == "kv_snapshot_4g") r.length = 0xffffffffull;
  if (mode == "kv_snapshot_badkey") r.length = 64;
  co_return r;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  static const char* kRaw[] = {"silent",       "garbage",    "huge_length",
                               "oversize",     "unknown_id", "wrong_type",
                               "after_goodbye"};
  for (const char* m : kRaw) {
    if (mode == m) return coverbs::RunMain(RawMain);
  }
  if (mode == "kv_snapshot_huge" || mode == "kv_snapshot_4g" ||
      mode == "kv_snapshot_badkey") {
    coverbs::rpc::Server server;
    if (!server.Register(kPut, Put).ok() || !server.Register(kGet, Get).ok() ||
        !server.Register(kSnapshot, LyingSnapshot).ok()) {
      return 1;
    }
    std::printf("hostile_server: mode %s, port %d\n", mode.c_str(),
                absl::GetFlag(FLAGS_port));
    std::fflush(stdout);
    return coverbs::Serve(server, absl::GetFlag(FLAGS_address),
                          absl::GetFlag(FLAGS_port));
  }
  std::fprintf(stderr, "hostile_server: unknown --mode=%s\n", mode.c_str());
  return 2;
}
