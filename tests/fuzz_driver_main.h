// The main of a standalone driver for a libFuzzer target, for compilers
// without libFuzzer (gcc): the target's LLVMFuzzerTestOneInput is fed the
// files named on the command line, or its seeds and then mutations of them.
//   driver FILE...              replay each file once
//   driver [-runs=N] [-seed=S]  every seed once, then N mutations (a seed
//                               picked at random, then `mutate`)
// Returns the exit status for main; only an abort in the target (which
// kills the process) makes a run fail.
#ifndef COVERBS_TESTS_FUZZ_DRIVER_MAIN_H_
#define COVERBS_TESTS_FUZZ_DRIVER_MAIN_H_

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace coverbs::testing {

using FuzzInput = std::vector<uint8_t>;
using FuzzMutator = std::function<FuzzInput(FuzzInput, std::mt19937_64&)>;

int RunFuzzDriver(int argc, char** argv, long default_runs,
                  const std::vector<FuzzInput>& seeds,
                  const FuzzMutator& mutate);

}  // namespace coverbs::testing

#endif  // COVERBS_TESTS_FUZZ_DRIVER_MAIN_H_
