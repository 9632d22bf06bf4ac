#include "examples/common.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <future>
#include <string_view>

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
// RC retransmission (cm::ConnectionOptions::qp), for the same examples.
ABSL_FLAG(int, ack_timeout, 14,
          "RC ACK timeout of this side's QPs, as verbs encodes it: 4.096 us x "
          "2^N per retransmission (14: 67 ms; 17: 537 ms, what rdma_cm "
          "would pick on RoCE). After --retry_count + 1 timeouts without "
          "progress the connection fails (the peer was unreachable). "
          "iWARP (siw) retransmits by TCP and ignores it.");
ABSL_FLAG(int, retry_count, 7,
          "RC retransmissions of one packet before the connection fails "
          "(0-7).");

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
  if (std::string_view(flag) == "address") {
    std::fprintf(stderr,
                 "%s: --%s is empty; give an address to listen on (0.0.0.0 "
                 "for every interface)\n",
                 program, flag);
  } else {
    std::fprintf(stderr,
                 "%s: --%s is empty; give the server's address (e.g. "
                 "127.0.0.1)\n",
                 program, flag);
  }
  return false;
}

bool CheckIntFlag(const char* program, const char* flag, int64_t value,
                  int64_t lo, int64_t hi, const char* unit) {
  if (value >= lo && value <= hi) return true;
  std::fprintf(
      stderr, "%s: --%s=%lld is out of range: it must be in [%lld, %lld]%s%s\n",
      program, flag, static_cast<long long>(value), static_cast<long long>(lo),
      static_cast<long long>(hi), *unit != '\0' ? " " : "", unit);
  return false;
}

bool CheckDurationFlag(const char* program, const char* flag,
                       absl::Duration value, absl::Duration lo,
                       absl::Duration hi, bool infinite_ok) {
  if (infinite_ok && value == absl::InfiniteDuration()) return true;
  if (value >= lo && value <= hi) return true;
  std::fprintf(
      stderr, "%s: --%s=%s is out of range: it must be in [%s, %s]%s\n",
      program, flag, absl::FormatDuration(value).c_str(),
      absl::FormatDuration(lo).c_str(), absl::FormatDuration(hi).c_str(),
      infinite_ok ? " or inf (forever)" : "");
  return false;
}

bool CheckOutputFileFlag(const char* program, const char* flag,
                         const std::string& path) {
  if (path.empty()) return true;
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos
                              ? "."
                              : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::fprintf(stderr, "%s: --%s=%s: directory '%s' does not exist\n",
                 program, flag, path.c_str(), dir.c_str());
    return false;
  }
  if (access(dir.c_str(), W_OK) != 0) {
    std::fprintf(stderr, "%s: --%s=%s: directory '%s' is not writable: %s\n",
                 program, flag, path.c_str(), dir.c_str(),
                 std::strerror(errno));
    return false;
  }
  return true;
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

void ApplyConnectionFlags(cm::ConnectionOptions& o) {
  o.landing_buffers =
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_landing_buffers)));
  o.landing_windows = absl::GetFlag(FLAGS_landing_windows);
  o.landing_buffer_size = static_cast<size_t>(
      std::max<int64_t>(0, absl::GetFlag(FLAGS_landing_buffer_size)));
  o.qp.timeout =
      static_cast<uint8_t>(std::clamp(absl::GetFlag(FLAGS_ack_timeout), 1, 31));
  o.qp.retry_cnt =
      static_cast<uint8_t>(std::clamp(absl::GetFlag(FLAGS_retry_count), 0, 7));
}

}  // namespace coverbs::examples
