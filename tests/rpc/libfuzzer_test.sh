#!/bin/bash
# Builds the rpc frame decoder's fuzz target as a real libFuzzer binary with
# clang (gcc has no libFuzzer) and runs it for a bounded number of inputs.
# Any crash, sanitizer report or property violation (abort) fails the test.
#   usage: libfuzzer_test.sh <wire.cc> <wire_fuzzer.cc> [runs]
set -euo pipefail
wire_cc=$1
fuzzer_cc=$2
runs=${3:-300000}
CLANG=${CLANG:-/usr/bin/clang++}
if [[ ! -x $CLANG ]]; then
  echo "FAIL: $CLANG not found; the libFuzzer build needs clang" >&2
  exit 1
fi
# The workspace root of the runfiles tree holds rpc/wire.h.
root=$(cd "$(dirname "$wire_cc")/.." && pwd)
out=${TEST_TMPDIR:-$(mktemp -d)}
bin=$out/wire_libfuzzer
"$CLANG" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=all -I"$root" "$wire_cc" "$fuzzer_cc" -o "$bin" \
  -labsl_status -labsl_statusor -labsl_strings -labsl_strings_internal \
  -labsl_str_format_internal -labsl_cord -labsl_cord_internal \
  -labsl_cordz_info -labsl_cordz_handle -labsl_cordz_functions \
  -labsl_base -labsl_int128 -labsl_raw_logging_internal \
  -labsl_throw_delegate -labsl_spinlock_wait -labsl_log_severity \
  -labsl_synchronization -labsl_time -labsl_time_zone -labsl_stacktrace \
  -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal \
  -labsl_malloc_internal -labsl_exponential_biased -labsl_strerror \
  -labsl_bad_optional_access -labsl_graphcycles_internal -labsl_civil_time
mkdir -p "$out/corpus"
# -seed fixed: a failure reproduces; max_len covers header + small payloads.
"$bin" -seed=1 -runs="$runs" -max_len=256 -max_total_time=120 \
  "$out/corpus"
echo "PASS: libFuzzer ran $runs inputs without a finding"
