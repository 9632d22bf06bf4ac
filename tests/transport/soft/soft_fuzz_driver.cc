// A standalone driver for soft_rx_fuzzer.cc, for compilers without libFuzzer
// (gcc): the test that CI's ASan run executes. Usage:
//   driver [-runs=N] [-seed=S] PATH...
// Each PATH is a corpus file or a directory of them. Every file is run
// once, then N mutations of them (default 2000): byte flips biased toward
// frame headers, header fields set to boundary values, truncation,
// extension, splices of two inputs, new mode / split bytes.
// Exits non-zero only if the target aborts (which kills the process).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::vector<uint8_t>;

void Load(const std::string& path, std::vector<Bytes>& out) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* d = opendir(path.c_str());
    std::vector<std::string> names;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    }
    closedir(d);
    std::sort(names.begin(), names.end());  // a fixed order: reproducible
    for (const auto& n : names) Load(path + "/" + n, out);
    return;
  }
  std::ifstream in(path, std::ios::binary);
  out.emplace_back(std::istreambuf_iterator<char>(in),
                   std::istreambuf_iterator<char>());
}

// Offsets of the header fields a mutation aims at, relative to a frame
// start; frames start at 2 + 40k when payloads are empty, which the seeds'
// request frames mostly are not, so offsets are also tried at random.
constexpr size_t kFieldOffsets[] = {0, 1, 2, 3, 4, 8, 16, 24, 28, 32, 36};

Bytes Mutate(Bytes v, const std::vector<Bytes>& seeds, std::mt19937_64& rng) {
  int n = 1 + rng() % 4;
  for (int i = 0; i < n; ++i) {
    switch (rng() % 7) {
      case 0:  // flip a byte
        if (v.size() > 2) v[2 + rng() % (v.size() - 2)] ^= 1 + rng() % 255;
        break;
      case 1:  // truncate
        if (v.size() > 2) v.resize(2 + rng() % (v.size() - 2));
        break;
      case 2:  // extend
        v.resize(v.size() + 1 + rng() % 64, static_cast<uint8_t>(rng()));
        break;
      case 3: {  // a boundary value into a header field
        static const uint64_t kVals[] = {
            0,          1,          7,          8,          16,    40,
            4096,       0x7fffffff, 0x80000000, 0xffffffff, ~0ULL, 0xC0B5AE00,
            0xC0B5AE01, 0xC0B5AE02, 0xC0B5AE03, 0xC0B5AE04};
        size_t frame = 2 + 40 * (rng() % std::max<size_t>(1, v.size() / 40));
        size_t off = frame + kFieldOffsets[rng() % std::size(kFieldOffsets)];
        uint64_t x = kVals[rng() % std::size(kVals)];
        size_t w = rng() % 2 ? 4 : 8;
        if (off + w <= v.size()) std::memcpy(&v[off], &x, w);
        break;
      }
      case 4: {  // splice: another input's stream appended
        const Bytes& o = seeds[rng() % seeds.size()];
        if (o.size() > 2) v.insert(v.end(), o.begin() + 2, o.end());
        break;
      }
      case 5:  // mode and split seed
        if (v.size() >= 2) v[rng() % 2] = static_cast<uint8_t>(rng());
        break;
      case 6: {  // an opcode at a frame boundary, any of the 24 and more
        size_t off = 2 + 40 * (rng() % (1 + v.size() / 40));
        if (off < v.size()) v[off] = rng() % 24;
        break;
      }
    }
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  long runs = 2000;
  uint64_t seed = 1;
  std::vector<Bytes> seeds;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("-runs=", 0) == 0) {
      runs = std::strtol(a.c_str() + 6, nullptr, 10);
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::strtoull(a.c_str() + 6, nullptr, 10);
    } else {
      Load(a, seeds);
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "no corpus given\n");
    return 2;
  }
  for (const Bytes& s : seeds) LLVMFuzzerTestOneInput(s.data(), s.size());
  std::mt19937_64 rng(seed);
  for (long i = 0; i < runs; ++i) {
    Bytes v = Mutate(seeds[rng() % seeds.size()], seeds, rng);
    LLVMFuzzerTestOneInput(v.data(), v.size());
  }
  std::printf("ran %zu corpus inputs and %ld mutations (seed %llu)\n",
              seeds.size(), runs, static_cast<unsigned long long>(seed));
  return 0;
}
