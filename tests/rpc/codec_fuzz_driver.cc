// A standalone driver for codec_fuzzer.cc, for compilers without libFuzzer
// (gcc): the test CI's ASan run executes (usage: tests/fuzz_driver_main.h;
// 20,000 mutations unless told).
// Seeds: encodings of each type the target decodes (msgpack values of
// several shapes, protobuf messages). Mutations know msgpack's format:
// a byte replaced by a type marker (nil, bool, integers, floats, str, bin,
// ext, array and map of every width), a length or count field set to a
// boundary value, truncation, extension, a slice repeated, two inputs
// spliced, a random byte.
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "rpc/codec.h"
#include "tests/fuzz_driver_main.h"
#include "tests/rpc/codec_fuzz_types.h"
#include "tests/rpc/typed_test.pb.h"

namespace {

using Bytes = coverbs::testing::FuzzInput;
namespace fuzz = coverbs::rpc::fuzz;

template <typename T>
Bytes Encoded(const T& v) {
  std::string s;
  coverbs::rpc::Codec<T>::Encode(v, s);
  return Bytes(s.begin(), s.end());
}

std::vector<Bytes> Seeds() {
  std::vector<Bytes> seeds;
  seeds.push_back(Encoded(std::vector<bool>{true, false, true}));
  seeds.push_back(Encoded(std::map<std::string, std::vector<std::string>>{
      {"k", {"v", std::string(40, 'x')}}, {"", {}}}));
  seeds.push_back(Encoded(std::vector<std::string>{"a", "", "abcdefghijklmnopq"}));
  seeds.push_back(
      Encoded(std::map<std::string, int64_t>{{"k", -1}, {"long key", 1 << 20}}));
  seeds.push_back(Encoded(std::unordered_map<int32_t, std::vector<uint8_t>>{
      {7, {1, 2, 3}}, {-300, {}}}));
  seeds.push_back(Encoded(std::vector<std::optional<double>>{
      1.5, std::nullopt, -0.0, std::numeric_limits<double>::infinity()}));
  seeds.push_back(Encoded(std::vector<std::vector<float>>{{1.f}, {}, {2.f, 3.f}}));
  seeds.push_back(Encoded(std::pair<uint16_t, std::string>{443, "tls"}));
  fuzz::Record r{"node", 7471, {-1, 0, 1}, true};
  seeds.push_back(Encoded(r));
  seeds.push_back(Encoded(std::vector<fuzz::Record>{r, fuzz::Record{}}));
  seeds.push_back(Encoded(
      std::tuple<int8_t, std::optional<std::string>, bool>{-5, "s", false}));
  coverbs::rpc::test::Batch b;
  auto* item = b.add_items();
  item->set_name("item");
  item->set_id(9);
  item->add_tags(1);
  item->add_tags(300);
  b.add_items();
  b.set_note("note");
  b.add_weights(0.5f);
  (*b.mutable_counts())["c"] = 3;
  seeds.push_back(Encoded(b));
  coverbs::rpc::test::KvPut p;
  p.set_key("key");
  p.set_value(std::string(20, '\0'));
  p.add_tags(5);
  seeds.push_back(Encoded(p));
  seeds.push_back({});
  return seeds;
}

// msgpack's type markers, one of each family and width.
constexpr uint8_t kMarkers[] = {
    0xc0, 0xc2, 0xc3,                    // nil, false, true
    0x00, 0x7f, 0xe0, 0xff,              // fixint
    0xcc, 0xcd, 0xce, 0xcf,              // uint 8..64
    0xd0, 0xd1, 0xd2, 0xd3,              // int 8..64
    0xca, 0xcb,                          // float32, float64
    0xa0, 0xa5, 0xbf, 0xd9, 0xda, 0xdb,  // str
    0xc4, 0xc5, 0xc6,                    // bin
    0xd4, 0xd8, 0xc7, 0xc8, 0xc9,        // ext
    0x90, 0x93, 0x9f, 0xdc, 0xdd,        // array
    0x80, 0x82, 0x8f, 0xde, 0xdf,        // map
    0xc1,                                // never used
};
constexpr uint32_t kCounts[] = {0,      1,      2,          15,        16,
                                255,    256,    0xffff,     0x10000,   0x7fffffff,
                                0xfffffffe, 0xffffffff};

Bytes Mutate(Bytes v, const std::vector<Bytes>& seeds, std::mt19937_64& rng) {
  const int n = 1 + rng() % 3;
  for (int i = 0; i < n; ++i) {
    switch (rng() % 7) {
      case 0:  // a type marker
        if (!v.empty()) v[rng() % v.size()] = kMarkers[rng() % std::size(kMarkers)];
        break;
      case 1:  // a length or count field (big-endian, 1, 2 or 4 bytes)
        if (!v.empty()) {
          const uint32_t c = kCounts[rng() % std::size(kCounts)];
          const size_t width = size_t{1} << (rng() % 3);
          const size_t at = rng() % v.size();
          for (size_t k = 0; k < width && at + k < v.size(); ++k) {
            v[at + k] = static_cast<uint8_t>(c >> (8 * (width - 1 - k)));
          }
        }
        break;
      case 2:  // truncate
        if (!v.empty()) v.resize(rng() % v.size());
        break;
      case 3:  // extend
        v.resize(v.size() + 1 + rng() % 16, static_cast<uint8_t>(rng()));
        break;
      case 4:  // repeat a slice
        if (!v.empty() && v.size() < 4096) {
          const size_t from = rng() % v.size();
          const size_t len = 1 + rng() % (v.size() - from);
          Bytes slice(v.begin() + from, v.begin() + from + len);
          v.insert(v.begin() + rng() % (v.size() + 1), slice.begin(),
                   slice.end());
        }
        break;
      case 5: {  // splice with another seed
        const Bytes& o = seeds[rng() % seeds.size()];
        if (!o.empty()) {
          const size_t cut = v.empty() ? 0 : rng() % v.size();
          const size_t from = rng() % o.size();
          v.resize(cut);
          v.insert(v.end(), o.begin() + from, o.end());
        }
        break;
      }
      case 6:  // a random byte
        if (!v.empty()) v[rng() % v.size()] = static_cast<uint8_t>(rng());
        break;
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Bytes> seeds = Seeds();
  return coverbs::testing::RunFuzzDriver(
      argc, argv, 20000, seeds, [&](Bytes v, std::mt19937_64& rng) {
        // Mutations of mutations too: a quarter mutate further.
        v = Mutate(std::move(v), seeds, rng);
        while (rng() % 4 == 0) v = Mutate(std::move(v), seeds, rng);
        return v;
      });
}
