// kv_server: a key-value service whose values clients read with one-sided
// RDMA READ. "Put" (an RPC; large values travel by the connection's
// rendezvous) stores a value in a slot of a registered region exposed for
// REMOTE_READ; "Get" (an RPC) returns where the value is (address, rkey,
// length, version) so that later reads go straight to memory with
// `co_await conn.Read(local, remote)`, without the server's CPU.
// See examples/README.md and kv_protocol.h.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "core/offload.h"
#include "examples/common.h"
#include "examples/kv_protocol.h"
#include "rpc/server.h"

ABSL_FLAG(std::string, address, "127.0.0.1",
          "Address to listen on (verbs: an address of the RDMA device's netdev).");
ABSL_FLAG(uint16_t, port, 7472, "Port; 0 picks one (printed and written to --port_file).");
ABSL_FLAG(std::string, port_file, "", "Write the listening port to this file.");
ABSL_FLAG(int, threads, 2, "Reactor threads serving connections.");
ABSL_FLAG(int, slots, 256, "Number of values the store holds.");
ABSL_FLAG(int64_t, max_value_size, 64 * 1024, "Largest value a Put accepts (bytes).");
ABSL_FLAG(std::string, provider, "auto", "verbs, soft or auto.");
ABSL_FLAG(std::string, device, "", "verbs device (e.g. rxe0); empty = first active.");

namespace coverbs::examples {
namespace {

class Store {
 public:
  Store(size_t slots, size_t max_value)
      : slot_bytes_(kv::ReadBytes(max_value)), max_value_(max_value),
        mem_(slots * slot_bytes_), slots_(slots) {}

  absl::Status Register(transport::ProtectionDomain& pd) {
    // REMOTE_READ only: clients read values in place but cannot write them.
    auto mr = pd.Register(mem_.data(), mem_.size(),
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!mr.ok()) return mr.status();
    mr_ = std::move(*mr);
    return absl::OkStatus();
  }

  absl::StatusOr<rpc::Payload> Put(std::span<const std::byte> req) {
    if (req.size() < 2) return absl::InvalidArgumentError("Put: truncated request");
    uint16_t klen;
    std::memcpy(&klen, req.data(), 2);
    if (req.size() < 2u + klen) return absl::InvalidArgumentError("Put: truncated key");
    std::string key(reinterpret_cast<const char*>(req.data()) + 2, klen);
    std::span<const std::byte> value = req.subspan(2 + klen);
    if (value.size() > max_value_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Put: value of ", value.size(), " bytes exceeds the store's ", max_value_));
    }
    std::lock_guard<std::mutex> l(mu_);
    auto it = index_.find(key);
    size_t slot;
    if (it != index_.end()) {
      slot = it->second;
    } else {
      if (next_ == slots_) return absl::ResourceExhaustedError("Put: the store is full");
      slot = next_++;
      index_.emplace(key, slot);
    }
    std::byte* s = mem_.data() + slot * slot_bytes_;
    uint64_t v;
    std::memcpy(&v, s, 8);
    // Seqlock: odd while writing, so a concurrent one-sided READ that sees
    // a half-written value sees mismatching versions and retries.
    Version(s, 0, v + 1);
    std::atomic_thread_fence(std::memory_order_release);
    uint32_t len = static_cast<uint32_t>(value.size());
    std::memcpy(s + 8, &len, 4);
    if (!value.empty()) std::memcpy(s + kv::kSlotHeader, value.data(), value.size());
    std::atomic_thread_fence(std::memory_order_release);
    Version(s, kv::kSlotHeader + kv::Round8(len), v + 2);
    std::atomic_thread_fence(std::memory_order_release);
    Version(s, 0, v + 2);
    return rpc::Payload();
  }

  absl::StatusOr<rpc::Payload> Get(std::span<const std::byte> req) {
    std::string key(reinterpret_cast<const char*>(req.data()), req.size());
    std::lock_guard<std::mutex> l(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return absl::NotFoundError(absl::StrCat("Get: no key '", key, "'"));
    const std::byte* s = mem_.data() + it->second * slot_bytes_;
    kv::Location loc;
    loc.addr = reinterpret_cast<uint64_t>(s);
    loc.rkey = mr_.rkey();
    std::memcpy(&loc.length, s + 8, 4);
    std::memcpy(&loc.version, s, 8);
    return rpc::Payload::Copy(
        std::span(reinterpret_cast<const std::byte*>(&loc), sizeof(loc)));
  }

  size_t size() const {
    std::lock_guard<std::mutex> l(mu_);
    return index_.size();
  }

 private:
  static void Version(std::byte* slot, size_t at, uint64_t v) {
    std::memcpy(slot + at, &v, 8);
  }
  const size_t slot_bytes_;
  const size_t max_value_;
  std::vector<std::byte> mem_;
  const size_t slots_;
  transport::MemoryRegion mr_;
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, size_t> index_;
  size_t next_ = 0;
};

int Run() {
  if (!CheckAddressFlag("kv_server", "address", absl::GetFlag(FLAGS_address))) return 2;
  if (!CheckProviderFlag("kv_server", absl::GetFlag(FLAGS_provider))) return 2;
  if (absl::GetFlag(FLAGS_slots) < 1 || absl::GetFlag(FLAGS_max_value_size) < 0 ||
      absl::GetFlag(FLAGS_max_value_size) > (16 << 20) || absl::GetFlag(FLAGS_threads) < 1) {
    std::fprintf(stderr, "kv_server: need --slots >= 1, 0 <= --max_value_size <= 16 MiB, "
                         "--threads >= 1\n");
    return 2;
  }
  auto device = OpenDevice(absl::GetFlag(FLAGS_provider), absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "kv_server: %s\n", device.status().ToString().c_str());
    return 1;
  }
  // One PD for every reactor, so the store's one region serves all connections.
  auto pd = (*device)->AllocPd();
  if (!pd.ok()) {
    std::fprintf(stderr, "kv_server: %s\n", pd.status().ToString().c_str());
    return 1;
  }
  Store store(absl::GetFlag(FLAGS_slots), absl::GetFlag(FLAGS_max_value_size));
  if (absl::Status s = store.Register(**pd); !s.ok()) {
    std::fprintf(stderr, "kv_server: registering the store: %s\n", s.ToString().c_str());
    return 1;
  }
  cm::WorkerPool::Options pool_options;
  pool_options.threads = static_cast<size_t>(absl::GetFlag(FLAGS_threads));
  pool_options.worker.pd = pd->get();  // one MR serves every reactor
  auto workers = cm::WorkerPool::Create(**device, pool_options);
  if (!workers.ok()) {
    std::fprintf(stderr, "kv_server: %s\n", workers.status().ToString().c_str());
    return 1;
  }
  rpc::ServerOptions options;
  ApplyConnectionFlags(options.listener.connection);
  // Values up to max_value_size plus the key.
  auto server = std::make_unique<rpc::Server>(options);
  absl::Status s = server->Register(
      "Put", [&store](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
        // A large value's copy runs off the reactor, so its other calls go
        // on meanwhile; waited for to the end, as it reads this request.
        if (r.data().size() >= (size_t{1} << 20)) {
          co_return co_await OffloadUntilDone([&] { return store.Put(r.data()); });
        }
        co_return store.Put(r.data());
      });
  if (s.ok()) {
    s = server->Register("Get", [&store](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
      co_return store.Get(r.data());
    });
  }
  if (s.ok()) {
    s = server->Start(**workers, absl::GetFlag(FLAGS_address),
                      absl::GetFlag(FLAGS_port));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "kv_server: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("kv_server: listening on %s:%u, provider %s, %d slots of up to %lld bytes\n",
              absl::GetFlag(FLAGS_address).c_str(), server->port(),
              (*device)->Describe().c_str(), absl::GetFlag(FLAGS_slots),
              static_cast<long long>(absl::GetFlag(FLAGS_max_value_size)));
  std::fflush(stdout);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    {
      std::ofstream out(f + ".tmp");
      out << server->port() << "\n";
    }
    std::rename((f + ".tmp").c_str(), f.c_str());
  }
  WaitForSignal(absl::InfiniteDuration());
  server->Shutdown();
  std::printf("kv_server: %zu key(s) stored, %llu call(s) served\n", store.size(),
              static_cast<unsigned long long>(server->stats().calls));
  server.reset();
  workers->reset();
  return 0;
}

}  // namespace
}  // namespace coverbs::examples

int main(int argc, char** argv) {
  coverbs::examples::BlockTerminationSignals();
  absl::SetProgramUsageMessage(
      "A key-value server whose values clients read by one-sided RDMA READ.\n"
      "Usage: kv_server [--address=A] [--port=P] [--slots=N] [--max_value_size=B]");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::examples::Run();
}
