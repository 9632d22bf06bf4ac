#!/bin/bash
# Issue 36, point 6 (client side): a scripted malicious server against the
# client library and the examples. Each case starts hostile_server in one
# mode on a free loopback port, runs a client against it under a time
# limit and checks that the client
#   - got a clear error (the expected status and cause in its output),
#   - exited 1 through RunMain (never a signal, never the time limit: no
#     crash, no hang; under --config=asan also no sanitizer report),
#   - went on after the broken connection where the case allows it
#     (rpc_victim's second round connects again on the same Worker).
# Usage: hostile_rpc_test.sh HOSTILE_SERVER RPC_VICTIM KV_TYPED_CLIENT
#                            GUIDE_ECHO_CLIENT ECHO_SERVER
set -u
server_bin=$1
victim=$2
kv_client=$3
guide_client=$4
echo_server=$5
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
addr="${COVERBS_VM_ADDR_A:-127.0.0.1}"
spid=
failures=0

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

stop_server() {
  [ -n "$spid" ] || return 0
  kill -TERM "$spid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null
  spid=
}
trap stop_server EXIT

# start_server LOG ARGS...: runs it on $port, waits until it listens.
start_server() {
  local log=$1
  shift
  port=$(free_port)
  rm -f "$log"
  "$@" --port="$port" >"$log" 2>&1 &
  spid=$!
  for _ in $(seq 1 100); do
    grep -q "listening" "$log" 2>/dev/null && return 0
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  echo "FAIL: server did not start: $*"
  cat "$log"
  return 1
}

# check NAME OUT RC WANT_RC PATTERN...: the client's exit status and output.
check() {
  local name=$1 out=$2 rc=$3 want=$4
  shift 4
  local bad=
  if [ "$rc" -eq 124 ]; then
    bad="the client hung (killed by the time limit)"
  elif [ "$rc" -ge 128 ]; then
    bad="the client died of signal $((rc - 128))"
  elif [ "$rc" -ne "$want" ]; then
    bad="exit status $rc, expected $want"
  elif grep -q "AddressSanitizer\|LeakSanitizer\|runtime error:" "$out"; then
    bad="a sanitizer report"
  fi
  for p in "$@"; do
    [ -n "$bad" ] && break
    grep -q -- "$p" "$out" || bad="no line matching '$p'"
  done
  if [ -n "$bad" ]; then
    echo "FAIL: $name: $bad"
    sed 's/^/    /' "$out"
    failures=$((failures + 1))
  else
    echo "ok: $name ($(grep -m1 -o 'DEADLINE_EXCEEDED\|UNAVAILABLE\|NOT_FOUND\|OUT_OF_RANGE\|INTERNAL\|ABORTED\|PERMISSION_DENIED' "$out" | head -1))"
  fi
}

# victim_case NAME MODE PATTERN... -- VICTIM_ARGS...
victim_case() {
  local name=$1 mode=$2
  shift 2
  local patterns=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  start_server "$tmp/server.$name" "$server_bin" --mode="$mode" --address="$addr" || {
    failures=$((failures + 1)); return; }
  local out="$tmp/out.$name"
  local t0=$SECONDS
  timeout 30 "$victim" --address="$addr" --port="$port" "$@" >"$out" 2>&1
  local rc=$?
  check "$name" "$out" "$rc" 1 "${patterns[@]}"
  if grep -q "call [0-9]*: OK\|after: OK" "$out"; then
    echo "FAIL: $name: a call succeeded against a server that never answers well"
    failures=$((failures + 1))
  fi
  echo "    ($((SECONDS - t0)) s)"
  stop_server
}

# A server that never answers: every call ends at its deadline; the
# connection stays up, so the call after them waits its deadline too.
victim_case silent silent \
  "round 1 call 0: DEADLINE_EXCEEDED" "round 1 after: DEADLINE_EXCEEDED" \
  "round 2 call 3: DEADLINE_EXCEEDED" -- --deadline_ms=300
# Broken frames end the connection: every call in flight fails UNAVAILABLE
# with the cause, the next call at once; a new connection meets the same.
victim_case garbage garbage \
  "round 1 call 0: UNAVAILABLE: .*bad frame from the server" \
  "round 1 after: UNAVAILABLE" "round 2 call 0: UNAVAILABLE: .*bad frame" --
victim_case huge_length huge_length \
  "round 1 call 0: UNAVAILABLE: .*bad frame from the server" \
  "round 2 after: UNAVAILABLE" --
victim_case oversize oversize \
  "round 1 call 0: UNAVAILABLE: .*bad frame from the server" \
  "round 2 after: UNAVAILABLE" -- --max_response_bytes=1024
victim_case wrong_type wrong_type \
  "round 1 call 0: UNAVAILABLE: .*bad frame from the server" \
  "round 2 after: UNAVAILABLE" --
victim_case unknown_id unknown_id \
  "round 1 call 0: UNAVAILABLE: .*never issued" "round 2 after: UNAVAILABLE" --
# DATA after the server's GOODBYE is never delivered as a response: the
# connection ends as a protocol violation.
victim_case after_goodbye after_goodbye \
  "round 1 call 0: UNAVAILABLE: .*protocol violation by the peer.*after the peer's GOODBYE" \
  "round 1 after: UNAVAILABLE" "round 2 call 0: UNAVAILABLE" --
# RunMain's main returns an error with a live client and calls in flight.
victim_case leave_in_flight silent \
  "leaving with 8 call(s) in flight" "main returns with 8 call(s) in flight" \
  -- --leave_in_flight --calls=8 --rounds=1

# example_case NAME MODE|echo_server PATTERN... -- CLIENT ARGS...
example_case() {
  local name=$1 mode=$2
  shift 2
  local patterns=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  if [ "$mode" = echo_server ]; then
    start_server "$tmp/server.$name" "$echo_server" --address="$addr" --threads=1 || {
      failures=$((failures + 1)); return; }
  else
    start_server "$tmp/server.$name" "$server_bin" --mode="$mode" --address="$addr" || {
      failures=$((failures + 1)); return; }
  fi
  local out="$tmp/out.$name"
  local t0=$SECONDS
  local args=()
  for a in "$@"; do args+=("${a//PORT/$port}"); done
  timeout 30 "${args[@]}" >"$out" 2>&1
  local rc=$?
  check "$name" "$out" "$rc" 1 "${patterns[@]}"
  echo "    ($((SECONDS - t0)) s)"
  stop_server
}

# kv_typed_client: a silent server costs --deadline_ms, not forever.
example_case kv_silent silent "DEADLINE_EXCEEDED" -- \
  "$kv_client" --server="$addr" --port=PORT --keys=20 --deadline_ms=300
# Snapshot lengths the client cannot hold are refused before allocating.
example_case kv_snapshot_huge kv_snapshot_huge \
  "OUT_OF_RANGE: the server announced a snapshot of 1099511627776 bytes" -- \
  "$kv_client" --server="$addr" --port=PORT --keys=20
example_case kv_snapshot_4g kv_snapshot_4g \
  "OUT_OF_RANGE: the server announced a snapshot of 4294967295 bytes" -- \
  "$kv_client" --server="$addr" --port=PORT --keys=20
# A length it can hold with a key that opens nothing: the READ fails.
example_case kv_snapshot_badkey kv_snapshot_badkey "RDMA READ" -- \
  "$kv_client" --server="$addr" --port=PORT --keys=20
# The wrong server: responses that do not decode as the typed results.
example_case kv_vs_echo_server echo_server "run.*E:" -- \
  "$kv_client" --server="$addr" --port=PORT --keys=20
# guide_echo_client against a server without its method (a live client
# when main returns the error).
example_case guide_no_method kv_snapshot_huge "NOT_FOUND" -- \
  "$guide_client" PORT
example_case guide_garbage garbage "UNAVAILABLE: .*bad frame" -- \
  "$guide_client" PORT

if [ "$failures" -gt 0 ]; then
  echo "FAIL: $failures case(s)"
  exit 1
fi
echo PASS
