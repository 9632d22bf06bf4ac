// kv_client: stores --keys values in a kv_server with the "Put" RPC (values
// above the 8 KiB rendezvous threshold travel by RDMA WRITE), asks where
// each one is with the "Get" RPC once, then reads them --reads times with
// one-sided RDMA READs (`co_await conn.Read(local, remote)`), checking every
// byte. Prints the latency of a Get RPC next to that of a one-sided read.
// Exit status 0 only when every value read back is exactly what was put.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "examples/common.h"
#include "examples/kv_protocol.h"
#include "rpc/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1", "Address of the kv_server.");
ABSL_FLAG(uint16_t, port, 7472, "Port of the kv_server.");
ABSL_FLAG(int, keys, 64, "Keys to put.");
ABSL_FLAG(std::vector<std::string>, value_sizes, std::vector<std::string>({"100", "4000", "60000"}),
          "Value sizes, used in turn for key 0, 1, 2, ... (values above 8 KiB go "
          "by rendezvous).");
ABSL_FLAG(int, reads, 2000, "One-sided reads to make, round-robin over the keys.");
ABSL_FLAG(std::string, provider, "auto", "verbs, soft or auto.");
ABSL_FLAG(std::string, device, "", "verbs device (e.g. rxe0); empty = first active.");

namespace coverbs::examples {
namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  std::vector<int64_t> get_ns, read_ns;
  int64_t retries = 0, mismatches = 0;
  std::vector<std::string> errors;
};

std::string Key(int k) { return absl::StrCat("key-", k); }

Task<absl::Status> Session(rpc::Client& c, cm::Worker* ctx, const std::vector<size_t>& sizes,
                           Stats* st) {
  const int keys = absl::GetFlag(FLAGS_keys);
  size_t max_size = 0;
  // 1. Put every value (pattern tagged by key number).
  for (int k = 0; k < keys; ++k) {
    std::vector<std::byte> value(sizes[k % sizes.size()]);
    max_size = std::max(max_size, value.size());
    FillPattern(value, k);
    std::string req = kv::EncodePut(Key(k), value);
    auto r = co_await c.Call("Put", std::span(reinterpret_cast<const std::byte*>(req.data()),
                                              req.size()));
    if (!r.ok()) co_return absl::Status(r.status().code(), absl::StrCat("Put ", Key(k), ": ",
                                                                        r.status().message()));
  }
  // 2. Where is each value? One Get RPC per key.
  std::vector<kv::Location> where(keys);
  for (int k = 0; k < keys; ++k) {
    std::string key = Key(k);
    auto t0 = Clock::now();
    auto r = co_await c.Call("Get", std::span(reinterpret_cast<const std::byte*>(key.data()),
                                              key.size()));
    st->get_ns.push_back((Clock::now() - t0).count());
    if (!r.ok()) co_return r.status();
    if (r->size() != sizeof(kv::Location)) co_return absl::DataLossError("bad Get response");
    std::memcpy(&where[k], r->data().data(), sizeof(kv::Location));
  }
  // The errors a caller gets: a missing key, an oversized value.
  {
    std::string key = "no-such-key";
    auto r = co_await c.Call("Get", std::span(reinterpret_cast<const std::byte*>(key.data()),
                                              key.size()));
    if (r.ok() || r.status().code() != absl::StatusCode::kNotFound) {
      st->errors.push_back(absl::StrCat("Get of a missing key: ", r.status().ToString()));
    } else {
      std::printf("kv_client: Get(\"no-such-key\") -> %s\n", r.status().ToString().c_str());
    }
  }
  // 3. One-sided reads into registered memory of this connection's PD.
  std::vector<std::byte> local(kv::ReadBytes(max_size));
  auto mr = ctx->pd().Register(local.data(), local.size(), IBV_ACCESS_LOCAL_WRITE);
  if (!mr.ok()) co_return mr.status();
  cm::Connection& conn = c.connection();
  for (int i = 0; i < absl::GetFlag(FLAGS_reads); ++i) {
    const int k = i % keys;
    const kv::Location& loc = where[k];
    const size_t n = kv::ReadBytes(loc.length);
    transport::RemoteRegion remote{loc.addr, n, loc.rkey};
    for (int attempt = 0;; ++attempt) {
      auto t0 = Clock::now();
      absl::Status s = co_await conn.Read(mr->Local(0, n), remote);
      st->read_ns.push_back((Clock::now() - t0).count());
      if (!s.ok()) co_return s;
      uint64_t head, tail;
      uint32_t len;
      std::memcpy(&head, local.data(), 8);
      std::memcpy(&len, local.data() + 8, 4);
      std::memcpy(&tail, local.data() + kv::kSlotHeader + kv::Round8(loc.length), 8);
      if (head == tail && head % 2 == 0 && len == loc.length) {
        std::span<const std::byte> value(local.data() + kv::kSlotHeader, len);
        if (FirstMismatch(value, k) >= 0) {
          ++st->mismatches;
          st->errors.push_back(absl::StrCat("read of ", Key(k), ": wrong bytes"));
        }
        break;
      }
      // A Put was changing the slot while we read it: read again.
      ++st->retries;
      if (attempt == 100) co_return absl::AbortedError("value kept changing");
    }
  }
  co_return absl::OkStatus();
}

Task<absl::Status> Main(cm::Worker* ctx, const std::vector<size_t>& sizes, Stats* st) {
  rpc::ClientOptions co;
  ApplyConnectionFlags(co.connect.connection);
  auto client = co_await rpc::Client::Connect(*ctx, absl::GetFlag(FLAGS_server),
                                              absl::GetFlag(FLAGS_port), co);
  if (!client.ok()) {
    co_return absl::UnavailableError(absl::StrCat("connecting to ", absl::GetFlag(FLAGS_server),
                                                  ":", absl::GetFlag(FLAGS_port), ": ",
                                                  client.status().ToString()));
  }
  absl::Status s = co_await Session(**client, ctx, sizes, st);
  // Closed on every path: the connection must be gone before its Worker.
  absl::Status closed = co_await (*client)->Close();
  co_return s.ok() ? closed : s;
}

int RunMain() {
  if (!CheckAddressFlag("kv_client", "server", absl::GetFlag(FLAGS_server))) return 2;
  if (!CheckProviderFlag("kv_client", absl::GetFlag(FLAGS_provider))) return 2;
  std::vector<size_t> sizes;
  for (const std::string& v : absl::GetFlag(FLAGS_value_sizes)) {
    size_t n;
    if (!absl::SimpleAtoi(v, &n)) {
      std::fprintf(stderr, "kv_client: --value_sizes: bad '%s'\n", v.c_str());
      return 2;
    }
    sizes.push_back(n);
  }
  if (sizes.empty() || absl::GetFlag(FLAGS_keys) < 1 || absl::GetFlag(FLAGS_reads) < 0) {
    std::fprintf(stderr, "kv_client: need --value_sizes, --keys >= 1, --reads >= 0\n");
    return 2;
  }
  auto device = OpenDevice(absl::GetFlag(FLAGS_provider), absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "kv_client: %s\n", device.status().ToString().c_str());
    return 1;
  }
  auto reactor = Reactor::Create();
  if (!reactor.ok()) return 1;
  auto ctx = cm::Worker::Create(**reactor, **device);
  if (!ctx.ok()) {
    std::fprintf(stderr, "kv_client: %s\n", ctx.status().ToString().c_str());
    return 1;
  }
  Stats st;
  absl::Status s = (*reactor)->BlockOn(Main(ctx->get(), sizes, &st));
  ctx->reset();
  std::sort(st.get_ns.begin(), st.get_ns.end());
  std::sort(st.read_ns.begin(), st.read_ns.end());
  std::printf("kv_client: provider %s, %d key(s) put, %zu Get RPC(s), %zu one-sided read(s), "
              "%lld retried, %lld mismatch(es)\n",
              (*device)->Describe().c_str(), absl::GetFlag(FLAGS_keys), st.get_ns.size(),
              st.read_ns.size(), static_cast<long long>(st.retries),
              static_cast<long long>(st.mismatches));
  std::printf("kv_client: latency p50 / p99: Get RPC %.1f / %.1f us, one-sided READ %.1f / %.1f us\n",
              Percentile(st.get_ns, 0.5) / 1e3, Percentile(st.get_ns, 0.99) / 1e3,
              Percentile(st.read_ns, 0.5) / 1e3, Percentile(st.read_ns, 0.99) / 1e3);
  for (const std::string& e : st.errors) std::fprintf(stderr, "kv_client: error: %s\n", e.c_str());
  if (!s.ok()) {
    std::fprintf(stderr, "kv_client: %s\n", s.ToString().c_str());
    return 1;
  }
  return st.errors.empty() ? 0 : 1;
}

}  // namespace
}  // namespace coverbs::examples

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Puts values into a kv_server, then reads them back by one-sided RDMA READ.\n"
      "Usage: kv_client --server=A --port=P [--keys=N] [--value_sizes=100,4000,60000] "
      "[--reads=R]");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::examples::RunMain();
}
