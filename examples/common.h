// Helpers shared by the example programs: opening the provider the flags
// name, one cm::Worker per reactor of a ReactorPool, signal handling, and
// latency percentiles. Examples only; not part of the library's API.
#ifndef COVERBS_EXAMPLES_COMMON_H_
#define COVERBS_EXAMPLES_COMMON_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cm/connection.h"
#include "cm/worker.h"
#include "cm/worker_pool.h"  // IWYU pragma: export
#include "core/reactor.h"
#include "core/reactor_pool.h"
#include "transport/device.h"

namespace coverbs::examples {

// Parses the command line like absl::ParseCommandLine, with the exit codes
// the examples promise: 2 for a bad flag, a bad flag value or any
// positional argument (each refused with a message naming it), 0 after
// --help and friends. Returns only when every argument was a valid flag.
void ParseFlagsOrExit(int argc, char** argv);

// --landing_buffers / --landing_buffer_size and the RC retransmission
// flags --ack_timeout / --retry_count (defined here, shared by the examples
// that connect or accept) applied to `o`.
void ApplyConnectionFlags(cm::ConnectionOptions& o);

// The --address/--server value, refused when empty: listening on every
// interface must be asked for explicitly with 0.0.0.0. The message is a
// server's for --address and a client's for any other flag (--server).
bool CheckAddressFlag(const char* program, const char* flag,
                      const std::string& value);

// Range checks for the examples' numeric flags: false after printing
// "<program>: --<flag>=<value> is out of range: it must be in [lo, hi]"
// (with `unit` after the bounds, e.g. "MiB"), so that the caller exits 2.
bool CheckIntFlag(const char* program, const char* flag, int64_t value,
                  int64_t lo, int64_t hi, const char* unit = "");
// Likewise for a duration in [lo, hi]; `infinite_ok` also accepts "inf"
// (the flag's "forever").
bool CheckDurationFlag(const char* program, const char* flag,
                       absl::Duration value, absl::Duration lo,
                       absl::Duration hi, bool infinite_ok = false);
// A file the program will write (--port_file): its directory must exist
// and be writable, checked before anything starts; false after printing
// why.
bool CheckOutputFileFlag(const char* program, const char* flag,
                         const std::string& path);

// The --provider value, refused with a message when it names no provider
// (checked with the other flags, so that it exits 2 like them).
bool CheckProviderFlag(const char* program, const std::string& value);

// provider: "auto" | "verbs" | "soft"; device: verbs device name or "".
absl::StatusOr<std::unique_ptr<transport::Device>> OpenDevice(
    const std::string& provider, const std::string& device);

// Blocks SIGINT, SIGTERM and SIGUSR1 in the calling thread and in every
// thread it creates afterwards, so that WaitForSignal can take them
// synchronously. Call first thing in main().
void BlockTerminationSignals();
// Waits for SIGINT/SIGTERM (and SIGUSR1 if `stats_signal`) for at most
// `limit`; returns the signal number, or 0 when the time ran out.
int WaitForSignal(absl::Duration limit, bool stats_signal = false);

// The p-quantile (0..1) of `sorted` (nearest rank); 0 when empty.
int64_t Percentile(const std::vector<int64_t>& sorted, double p);

// The byte the examples put at `index` of a payload tagged `tag`; the
// receiver of an echo checks every byte against it.
inline std::byte PatternByte(uint64_t tag, size_t index) {
  return static_cast<std::byte>(
      (tag * 0x9E3779B1u + index * 131 + (index >> 9)) & 0xff);
}
void FillPattern(std::span<std::byte> out, uint64_t tag);
// Index of the first byte that differs from the pattern, or -1.
int64_t FirstMismatch(std::span<const std::byte> in, uint64_t tag);

}  // namespace coverbs::examples

#endif  // COVERBS_EXAMPLES_COMMON_H_
