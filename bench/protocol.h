// The bench's own control messages between its client and server (on the
// cm connection, before and after each run), and the payload pattern that
// --verify checks.
#ifndef COVERBS_BENCH_PROTOCOL_H_
#define COVERBS_BENCH_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/str_format.h"

namespace coverbs::bench {

constexpr uint32_t kMagic = 0x4e425643;  // "CVBN"
enum Op : uint16_t { kOpRun = 1, kOpCpuBegin = 2, kOpCpuEnd = 3 };

// Client -> server, one message before each run on each connection.
struct Params {
  uint32_t magic = kMagic;
  uint16_t op = kOpRun;
  uint16_t test = 0;
  uint64_t size = 0;
  uint64_t iters = 0;
  uint32_t slots = 0;  // write_bw / read_bw: slots of `size` in the region
  uint32_t verify = 0;
};

// Server -> client at the end of each run.
struct Reply {
  uint32_t magic = kMagic;
  uint32_t ok = 1;
  uint64_t mismatches = 0;
  uint64_t errors = 0;
  double cpu_seconds = 0;
  char error[96] = {};
};

// Counts a --verify mismatch in the server's verdict; the first one names
// what differed.
inline void Mismatch(Reply* rep, const std::string& what) {
  if (rep->mismatches++ == 0)
    absl::SNPrintF(rep->error, sizeof(rep->error), "%s", what);
}

inline std::span<const std::byte> AsBytes(const auto& v) {
  return {reinterpret_cast<const std::byte*>(&v), sizeof(v)};
}

// The byte at `index` of payload number `tag`; cheap enough for --verify.
inline std::byte PatternByte(uint64_t tag, size_t index) {
  return static_cast<std::byte>((tag * 0x9E3779B1u + index * 7 + (index >> 8)) &
                                0xff);
}
inline void FillPattern(std::span<std::byte> out, uint64_t tag) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(tag, i);
}
inline int64_t FirstMismatch(std::span<const std::byte> in, uint64_t tag) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != PatternByte(tag, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace coverbs::bench

#endif  // COVERBS_BENCH_PROTOCOL_H_
