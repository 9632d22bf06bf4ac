// libFuzzer entry point for the rpc frame decoder (rpc/wire.h).
//
// Built two ways: with clang -fsanitize=fuzzer this file is a real libFuzzer
// target (tests/rpc/libfuzzer_test.sh builds and runs it); with gcc, which
// has no libFuzzer, it links tests/rpc/fuzz_driver.cc, a small standalone
// driver that replays inputs and random mutations through the same entry
// point (so `bazel build --config=asan //...` builds it everywhere).
//
// Properties checked on every input, for both sides:
//  - the decoder never crashes, reads out of bounds or hangs (sanitizers);
//  - an accepted frame is self-consistent: its payload is exactly the bytes
//    after the header, within the limit, and re-encoding its header gives
//    the input's header bytes back (nothing the decoder accepted was
//    silently ignored);
//  - an error frame's status round-trips as a non-OK status.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "rpc/wire.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

void DecodeAs(std::span<const std::byte> in, coverbs::rpc::Side side,
              uint64_t limit) {
  using namespace coverbs::rpc;
  absl::StatusOr<Frame> f = DecodeFrame(in, side, DecodeLimits{limit});
  if (!f.ok()) {
    Check(!f.status().message().empty());
    return;
  }
  Check(in.size() >= kHeaderSize);
  Check(f->payload.size() == f->header.payload_len);
  Check(f->payload.data() == in.data() + kHeaderSize);
  Check(f->payload.size() <= limit);
  HeaderBytes again = EncodeHeader(f->header);
  Check(std::memcmp(again.data(), in.data(), kHeaderSize) == 0);
  if (f->header.type == FrameType::kError) {
    Check(!StatusFromErrorFrame(*f).ok());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data),
                                size);
  for (uint64_t limit : {uint64_t{0}, uint64_t{64}, uint64_t{1} << 30}) {
    DecodeAs(in, coverbs::rpc::Side::kServer, limit);
    DecodeAs(in, coverbs::rpc::Side::kClient, limit);
  }
  return 0;
}
