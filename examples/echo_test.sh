#!/bin/bash
# End-to-end test of the echo example as two processes (echo_demo starts
# echo_server, runs echo_client, stops the server). echo_client verifies
# every echoed byte and exits non-zero on any error or mismatch; this script
# also checks the table it prints.
#   echo_test.sh <echo_demo> <echo_server> <echo_client>
set -u
demo="$1"
export ECHO_SERVER_BIN="$2" ECHO_CLIENT_BIN="$3"
out="${TEST_TMPDIR:-/tmp}/echo_out.txt"
fail() { echo "FAIL: $*"; cat "$out"; exit 1; }
# Repetitions scaled by COVERBS_TEST_REPEAT_PERCENT (tests/README.md; the VM
# harness runs 10%), never below the floor that keeps the path covered.
percent="${COVERBS_TEST_REPEAT_PERCENT:-100}"
[[ "$percent" =~ ^[1-9][0-9]{0,4}$ ]] || fail "COVERBS_TEST_REPEAT_PERCENT=$percent is not a percentage"
repeat() {  # full floor
  local n=$(($1 * percent / 100))
  echo $((n < $2 ? $2 : n))
}

# Sizes around the RPC eager limit (8 KiB connection threshold - 32-byte
# frame header = 8160), 1 MiB and 16 MiB by rendezvous; 24 calls per size
# (at least 4: one per in-flight slot).
calls=$(repeat 24 4)
"$demo" --sizes=0,1,8159,8160,8161,1048576,16777216 --calls="$calls" --concurrency=4 \
  >"$out" 2>&1 || fail "echo sweep exited $?"
for size in 0 1 8159 8160 8161 1048576 16777216; do
  # size, calls, errors = 0
  grep -Eq "^ +$size +$calls +0 " "$out" || fail "no clean row for size $size"
done
grep -q "verify on" "$out" || fail "verification was not on"
grep -q "served $((7 * calls)) call(s)" "$out" || fail "server did not report $((7 * calls)) calls"

# 10,000 pipelined calls (at least 1,024: 4 rounds of the 256 slots), 256 in
# flight, over two connections.
calls=$(repeat 10000 1024)
"$demo" --size=64 --calls="$calls" --concurrency=256 --connections=2 \
  >"$out" 2>&1 || fail "pipelined run exited $?"
grep -Eq "^ +64 +$calls +0 " "$out" || fail "no clean row for $calls pipelined calls"

# No server: a clear error and exit status 1, at once.
addr="${COVERBS_VM_ADDR_A:-127.0.0.1}"
if "$ECHO_CLIENT_BIN" --server="$addr" --port=1 --calls=1 >"$out" 2>&1; then
  fail "echo_client succeeded without a server"
fi
grep -q "connecting to $addr:1" "$out" || fail "no connect error named"
echo "PASS"
