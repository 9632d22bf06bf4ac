// decode_server: the server of decode_test.sh (issue 36, point 2). Typed
// methods whose arguments an attacker can try to amplify (tests/hostile/
// decode.h): a two-field msgpack struct, vector<string>, vector<float> and
// a protobuf batch of sub-messages, each answering how many elements it
// got, on --threads reactors.
//
//   decode_server --provider=soft --address=127.0.0.1 --port=0
//     --port_file=/tmp/port --threads=4
//
// SIGUSR1 prints the counters (calls, failed calls, reactor stalls);
// SIGTERM ends it. --decode_memory_factor / --decode_offload_above set the
// server's rpc::DecodeOptions.
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "examples/common.h"
#include "rpc/server.h"
#include "tests/hostile/decode.h"

ABSL_FLAG(std::string, provider, "soft", "verbs or soft");
ABSL_FLAG(std::string, device, "", "verbs: the device; empty: the first");
ABSL_FLAG(std::string, address, "127.0.0.1", "address to listen on");
ABSL_FLAG(uint16_t, port, 0, "port; 0: any (written to --port_file)");
ABSL_FLAG(std::string, port_file, "", "where to write the port");
ABSL_FLAG(size_t, threads, 4, "reactors serving connections");
ABSL_FLAG(uint32_t, decode_memory_factor, 8,
          "rpc::DecodeOptions::memory_factor (a large one, with "
          "--decode_offload_above=-1, to see decode_test.sh fail)");
ABSL_FLAG(int64_t, decode_offload_above, 64 << 10,
          "rpc::DecodeOptions::offload_above; -1: never");

namespace coverbs::decode_test {
namespace {

using ::decode_methods::Pair;

void PrintStats(const rpc::Server& server) {
  rpc::Server::Stats st = server.stats();
  auto u = [](uint64_t v) { return static_cast<unsigned long long>(v); };
  std::printf(
      "decode_server: served %llu call(s) on %llu connection(s) (%llu open); "
      "%llu failed; %llu reactor stall(s)\n",
      u(st.calls), u(st.connections), u(st.open_connections),
      u(st.failed_calls), u(st.reactor_stalls));
  std::fflush(stdout);
}

absl::Status Register(rpc::Server& s) {
  absl::Status st = s.Register(
      ::decode_methods::kPair, [](Pair p) -> Task<absl::StatusOr<uint64_t>> {
        co_return p.key.size() + p.value.size();
      });
  if (st.ok()) {
    st = s.Register(::decode_methods::kStrings,
                    [](std::vector<std::string> v)
                        -> Task<absl::StatusOr<uint64_t>> {
                      co_return v.size();
                    });
  }
  if (st.ok()) {
    st = s.Register(
        ::decode_methods::kFloats,
        [](std::vector<float> v) -> Task<absl::StatusOr<uint64_t>> {
          co_return v.size();
        });
  }
  if (st.ok()) {
    st = s.Register(::decode_methods::kBatch,
                    [](rpc::test::Batch b) -> Task<absl::StatusOr<uint64_t>> {
                      co_return static_cast<uint64_t>(b.items_size());
                    });
  }
  if (st.ok()) {
    st = s.Register("Echo",
                    [](rpc::Request r) -> Task<absl::StatusOr<rpc::Payload>> {
                      co_return std::move(r.payload);
                    });
  }
  return st;
}

int Run() {
  if (!examples::CheckProviderFlag("decode_server",
                                   absl::GetFlag(FLAGS_provider)) ||
      !examples::CheckOutputFileFlag("decode_server", "port_file",
                                     absl::GetFlag(FLAGS_port_file))) {
    return 2;
  }
  auto device = examples::OpenDevice(absl::GetFlag(FLAGS_provider),
                                     absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::fprintf(stderr, "decode_server: %s\n",
                 device.status().ToString().c_str());
    return 1;
  }
  auto workers = cm::WorkerPool::Create(
      **device, {.threads = absl::GetFlag(FLAGS_threads)});
  if (!workers.ok()) {
    std::fprintf(stderr, "decode_server: %s\n",
                 workers.status().ToString().c_str());
    return 1;
  }
  rpc::ServerOptions options;
  options.decode.memory_factor = absl::GetFlag(FLAGS_decode_memory_factor);
  const int64_t offload = absl::GetFlag(FLAGS_decode_offload_above);
  options.decode.offload_above =
      offload < 0 ? SIZE_MAX : static_cast<size_t>(offload);
  auto server = std::make_unique<rpc::Server>(options);
  absl::Status s = Register(*server);
  if (s.ok()) {
    s = server->Start(**workers, absl::GetFlag(FLAGS_address),
                      absl::GetFlag(FLAGS_port));
  }
  if (!s.ok()) {
    std::fprintf(stderr, "decode_server: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("decode_server: listening on %s:%u, provider %s, %zu reactors\n",
              absl::GetFlag(FLAGS_address).c_str(), server->port(),
              (*device)->Describe().c_str(), absl::GetFlag(FLAGS_threads));
  std::fflush(stdout);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    // Write then rename: a script polling for the file never reads half.
    const std::string tmp = f + ".tmp";
    std::ofstream out(tmp);
    out << server->port() << "\n";
    out.close();
    if (out.fail() || std::rename(tmp.c_str(), f.c_str()) != 0) {
      std::fprintf(stderr, "decode_server: cannot write %s: %s\n", f.c_str(),
                   std::strerror(errno));
      server->Shutdown();
      return 1;
    }
  }
  for (;;) {
    const int sig = examples::WaitForSignal(absl::InfiniteDuration(),
                                            /*stats_signal=*/true);
    if (sig == SIGUSR1) {
      PrintStats(*server);
      continue;
    }
    if (sig != 0) break;
  }
  server->Shutdown();
  PrintStats(*server);
  server.reset();
  workers->reset();
  return 0;
}

}  // namespace
}  // namespace coverbs::decode_test

int main(int argc, char** argv) {
  // Before any thread exists, so that the reactors inherit the mask.
  coverbs::examples::BlockTerminationSignals();
  absl::SetProgramUsageMessage(
      "The server of tests/hostile/decode_test.sh: typed methods an attacker "
      "tries to make decode into far more memory than it sent.");
  coverbs::examples::ParseFlagsOrExit(argc, argv);
  return coverbs::decode_test::Run();
}
