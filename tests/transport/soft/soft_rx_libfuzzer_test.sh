#!/bin/bash
# Runs the libFuzzer build of soft_rx_fuzzer.cc (build_soft_rx_libfuzzer.sh)
# from the committed corpus for a bounded number of inputs and time. Any
# crash, sanitizer report, leak, hang (the target aborts after 10 s on one
# input) or property violation fails the test. Prints libFuzzer's final
# stats (execs, cov, ft).
#   usage: soft_rx_libfuzzer_test.sh <fuzzer> <corpus dir> [runs [seconds]]
set -uo pipefail
fuzzer=$(realpath "$1")
corpus=$2
runs=${3:-2000}
seconds=${4:-30}
out=${TEST_TMPDIR:-$(mktemp -d)}
# A copy: inputs libFuzzer keeps must not land in the source tree.
mkdir -p "$out/corpus"
cp "$corpus"/* "$out/corpus/"
chmod u+w "$out"/corpus/*
cd "$out"  # crash artifacts go here
# -seed fixed: a failure reproduces.
"$fuzzer" -seed=1 -runs="$runs" -max_len=8192 -max_total_time="$seconds" \
  -timeout=20 -print_final_stats=1 "$out/corpus" >"$out/fuzz.log" 2>&1
status=$?
grep -v -E '^#[0-9]+.*(NEW|REDUCE|pulse)' "$out/fuzz.log" | tail -60
grep -E '^#[0-9]+.*(INITED|DONE)' "$out/fuzz.log"
if [[ $status -ne 0 ]]; then
  echo "FAIL: libFuzzer exited $status" >&2
  exit 1
fi
echo "PASS: libFuzzer ran without a finding"
