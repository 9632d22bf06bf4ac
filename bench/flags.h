// coverbs_bench's command line: every flag but the fault-injection build's
// --corrupt_message (main.cc), declared here for the files that read them.
#ifndef COVERBS_BENCH_FLAGS_H_
#define COVERBS_BENCH_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(bool, server);
ABSL_DECLARE_FLAG(std::string, client);
ABSL_DECLARE_FLAG(bool, loopback);
ABSL_DECLARE_FLAG(std::string, address);
ABSL_DECLARE_FLAG(uint16_t, port);
ABSL_DECLARE_FLAG(int, rpc_port);
ABSL_DECLARE_FLAG(std::string, test);
ABSL_DECLARE_FLAG(std::string, sizes);
ABSL_DECLARE_FLAG(int64_t, iters);
ABSL_DECLARE_FLAG(int64_t, warmup);
ABSL_DECLARE_FLAG(absl::Duration, duration);
ABSL_DECLARE_FLAG(int, depth);
ABSL_DECLARE_FLAG(int, inline_size);
ABSL_DECLARE_FLAG(int, connections);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(std::string, poll);
ABSL_DECLARE_FLAG(std::string, provider);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(bool, verify);
ABSL_DECLARE_FLAG(std::string, json);
ABSL_DECLARE_FLAG(std::string, csv);
ABSL_DECLARE_FLAG(std::string, plot);
ABSL_DECLARE_FLAG(std::string, progress);
ABSL_DECLARE_FLAG(absl::Duration, run_timeout);

#endif  // COVERBS_BENCH_FLAGS_H_
