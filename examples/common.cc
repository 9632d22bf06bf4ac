#include "examples/common.h"


#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <future>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

// Landing buffers (cm::ConnectionOptions), for echo_server and echo_client.
ABSL_FLAG(int, landing_buffers, 32,
          "Buffers this side keeps granted to its peer for medium messages "
          "(above 8 KiB, up to --landing_buffer_size) once the peer sends "
          "them: those skip the rendezvous round trip. 0: always the "
          "rendezvous. Costs up to landing_buffers x landing_buffer_size "
          "of registered memory per connection receiving medium messages.");
ABSL_FLAG(bool, landing_windows, true,
          "On devices with memory windows (rxe), grant landing buffers as "
          "windows over memory that stays registered (no registration per "
          "message); false: a registration per grant, as on other devices.");
ABSL_FLAG(int64_t, landing_buffer_size, 128 * 1024,
          "Largest message that may land in a granted buffer (bytes).");

namespace coverbs::examples {

namespace {
// 0: not parsing; 1: parsing (an exit now is absl refusing a flag);
// 2: parsing with a help flag present (an exit now is the help text).
std::atomic<int> g_parse_state{0};
void ExitCodeForFlagErrors() {
  int st = g_parse_state.load();
  // absl::ParseCommandLine exits with 1 both for a bad flag and after
  // printing --help; the examples promise 2 and 0.
  // _exit skips stdio's flush: flush first, or the help text (stdout)
  // never reaches a pipe.
  if (st != 0) {
    std::fflush(stdout);
    std::fflush(stderr);
  }
  if (st == 1) _exit(2);
  if (st == 2) _exit(0);
}
}  // namespace

void ParseFlagsOrExit(int argc, char** argv) {
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    if (absl::StartsWith(argv[i], "--help") ||
        absl::StartsWith(argv[i], "-help") ||
        absl::StartsWith(argv[i], "--version")) {
      help = true;
    }
  }
  std::fflush(stdout);
  g_parse_state.store(help ? 2 : 1);
  static const bool registered = [] {
    std::atexit(ExitCodeForFlagErrors);
    return true;
  }();
  (void)registered;
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  g_parse_state.store(0);
  if (rest.size() > 1) {
    std::fprintf(
        stderr, "%s: unexpected argument '%s' (every option is --name=value)\n",
        argv[0], rest[1]);
    std::exit(2);
  }
}

bool CheckAddressFlag(const char* program, const char* flag,
                      const std::string& value) {
  if (!value.empty()) return true;
  std::fprintf(stderr,
               "%s: --%s is empty; give an address (0.0.0.0 to listen on every "
               "interface)\n",
               program, flag);
  return false;
}

bool CheckProviderFlag(const char* program, const std::string& value) {
  absl::StatusOr<transport::ProviderKind> kind =
      transport::ParseProviderKind(value);
  if (kind.ok()) return true;
  std::fprintf(stderr, "%s: --provider: %s\n", program,
               std::string(kind.status().message()).c_str());
  return false;
}

absl::StatusOr<std::unique_ptr<transport::Device>> OpenDevice(
    const std::string& provider, const std::string& device) {
  transport::ProviderOptions o;
  absl::StatusOr<transport::ProviderKind> kind =
      transport::ParseProviderKind(provider);
  if (!kind.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--provider: ", kind.status().message()));
  }
  o.kind = *kind;
  o.device = device;
  return transport::Device::Open(o);
}

namespace {
sigset_t TerminationSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}
}  // namespace

void BlockTerminationSignals() {
  sigset_t set = TerminationSet();
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForSignal(absl::Duration limit, bool stats_signal) {
  sigset_t set = TerminationSet();
  if (stats_signal) sigaddset(&set, SIGUSR1);
  const absl::Time end = limit == absl::InfiniteDuration()
                             ? absl::InfiniteFuture()
                             : absl::Now() + limit;
  while (true) {
    // Wake at least once a minute so an infinite wait needs no special case.
    absl::Duration left = std::min(end - absl::Now(), absl::Minutes(1));
    if (left <= absl::ZeroDuration()) return 0;
    timespec ts = absl::ToTimespec(left);
    int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
  }
}

int64_t Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0;
  size_t rank = static_cast<size_t>(std::ceil(p * sorted.size()));
  if (rank == 0) rank = 1;
  return sorted[std::min(rank, sorted.size()) - 1];
}

void FillPattern(std::span<std::byte> out, uint64_t tag) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(tag, i);
}

int64_t FirstMismatch(std::span<const std::byte> in, uint64_t tag) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != PatternByte(tag, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

void ApplyLandingFlags(cm::ConnectionOptions& o) {
  o.landing_buffers =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_landing_buffers)));
  o.landing_windows = absl::GetFlag(FLAGS_landing_windows);
  o.landing_buffer_size = static_cast<size_t>(
      std::max<int64_t>(0, absl::GetFlag(FLAGS_landing_buffer_size)));
}

}  // namespace coverbs::examples
