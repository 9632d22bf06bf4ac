// A standalone driver for wire_fuzzer.cc, for compilers without libFuzzer
// (gcc; usage: tests/fuzz_driver_main.h): the rpc frames' seeds mutated
// 200,000 times unless told, with byte flips, truncations, extensions and
// field splices.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rpc/wire.h"
#include "tests/fuzz_driver_main.h"

namespace {

std::vector<std::vector<uint8_t>> Seeds() {
  using namespace coverbs::rpc;
  std::vector<std::vector<uint8_t>> seeds;
  auto add = [&](const HeaderBytes& h, size_t payload) {
    std::vector<uint8_t> v(kHeaderSize + payload, 0x5a);
    std::memcpy(v.data(), h.data(), kHeaderSize);
    seeds.push_back(std::move(v));
  };
  add(RequestHeader(1, MethodId("Echo"), 0), 0);
  add(RequestHeader(7, MethodId("Echo"), 17), 17);
  add(ResponseHeader(9, MethodId("Echo"), 5), 5);
  add(CancelHeader(3, MethodId("Slow")), 0);
  std::string err = EncodeError(4, MethodId("Fail"),
                                absl::InvalidArgumentError("bad input"));
  seeds.emplace_back(err.begin(), err.end());
  std::string conn = EncodeError(0, 0, absl::InvalidArgumentError("bad frame"));
  seeds.emplace_back(conn.begin(), conn.end());
  seeds.push_back({});
  return seeds;
}

std::vector<uint8_t> Mutate(std::vector<uint8_t> v, std::mt19937_64& rng) {
  int n = 1 + rng() % 4;
  for (int i = 0; i < n; ++i) {
    switch (rng() % 6) {
      case 0:  // flip a byte, biased toward the header
        if (!v.empty()) v[rng() % std::min<size_t>(v.size(), 40)] ^= 1 + rng() % 255;
        break;
      case 1:  // truncate
        if (!v.empty()) v.resize(rng() % v.size());
        break;
      case 2:  // extend
        v.resize(v.size() + 1 + rng() % 64, static_cast<uint8_t>(rng()));
        break;
      case 3:  // an interesting u32 into a header field
        if (v.size() >= 32) {
          static const uint32_t kVals[] = {0, 1, 4, 16, 17, 0x7fffffff,
                                           0xffffffff, 4096, 4097};
          uint32_t x = kVals[rng() % std::size(kVals)];
          size_t off = 4 * (rng() % 8);
          std::memcpy(&v[off], &x, 4);
        }
        break;
      case 4:  // make payload_len match the size (gets past that check)
        if (v.size() >= 32) {
          uint32_t len = static_cast<uint32_t>(v.size() - 32);
          std::memcpy(&v[24], &len, 4);
        }
        break;
      case 5:  // random byte anywhere
        if (!v.empty()) v[rng() % v.size()] = static_cast<uint8_t>(rng());
        break;
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  return coverbs::testing::RunFuzzDriver(argc, argv, 200000, Seeds(), Mutate);
}
