#include "tests/fuzz_driver_main.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace coverbs::testing {

int RunFuzzDriver(int argc, char** argv, long default_runs,
                  const std::vector<FuzzInput>& seeds,
                  const FuzzMutator& mutate) {
  long runs = default_runs;
  uint64_t seed = 1;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("-runs=", 0) == 0) {
      runs = std::strtol(a.c_str() + 6, nullptr, 10);
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::strtoull(a.c_str() + 6, nullptr, 10);
    } else if (!a.empty() && a[0] != '-') {
      files.push_back(a);
    }
  }
  if (!files.empty()) {
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      FuzzInput v((std::istreambuf_iterator<char>(in)),
                  std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(v.data(), v.size());
    }
    std::printf("replayed %zu inputs\n", files.size());
    return 0;
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "no seeds\n");
    return 2;
  }
  for (const FuzzInput& s : seeds) LLVMFuzzerTestOneInput(s.data(), s.size());
  std::mt19937_64 rng(seed);
  for (long i = 0; i < runs; ++i) {
    FuzzInput v = mutate(seeds[rng() % seeds.size()], rng);
    LLVMFuzzerTestOneInput(v.data(), v.size());
  }
  std::printf("ran %zu seeds and %ld mutations (seed %llu)\n", seeds.size(),
              runs, static_cast<unsigned long long>(seed));
  return 0;
}

}  // namespace coverbs::testing
