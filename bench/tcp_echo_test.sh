#!/bin/bash
# tcp_echo end to end: a server on port 0, clients of small, medium and
# large frames with calls pipelined on one connection and on several (one
# server thread serving them all; two threads, one with a single connection
# and one with two), every echoed byte checked (errors=0 and the one-line
# result compare_coro_rpc.sh parses, latency percentiles in order), bad
# arguments refused, a flipped byte caught, and the server leaving with
# status 0 on SIGTERM.
#   tcp_echo_test.sh <tcp_echo>
set -u
bin="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
spid=""
spid2=""
fail() {
  echo "FAIL: $*"
  for f in "$tmp"/*.out; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done
  for p in $spid $spid2; do kill -KILL "$p" 2>/dev/null; done
  exit 1
}

"$bin" server 0 1 >"$tmp/srv.out" 2>&1 &
spid=$!
for _ in $(seq 1 100); do grep -q '^port=' "$tmp/srv.out" && break; sleep 0.05; done
port=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$tmp/srv.out")
[ -n "$port" ] && [ "$port" -gt 0 ] || fail "no port=N line from the server"

# check_run PORT SIZE CALLS DEPTH [CONNECTIONS]: one client, its line.
check_run() {
  local port=$1 size=$2 calls=$3
  timeout 20 "$bin" client "$@" >"$tmp/cli.out" 2>&1 || fail "client ${*:2} exited $?"
  grep -Eq "^size=$size calls=$calls errors=0 seconds=[0-9]+\.[0-9]{6} calls_per_s=[0-9]+\.[0-9] p50_us=[0-9]+\.[0-9] p99_us=[0-9]+\.[0-9] p999_us=[0-9]+\.[0-9]$" \
    "$tmp/cli.out" || fail "client ${*:2}: unexpected output"
  [ "$(wc -l <"$tmp/cli.out")" -eq 1 ] || fail "client ${*:2}: more than one line"
  sed 's/[a-z0-9_]*=//g' "$tmp/cli.out" |
    awk '{ exit !($6 > 0 && $6 <= $7 && $7 <= $8) }' || fail "client ${*:2}: percentiles out of order"
}
# size calls depth [connections]
for run in "64 500 16" "8192 300 16" "1048576 20 16" "0 100 4" "5 100 1" \
  "64 2000 64 4" "4096 500 8 3" "1048576 20 4 2"; do
  # shellcheck disable=SC2086
  check_run "$port" $run
done

# Two server threads, three connections: one thread polls two of them, the
# other reads its only one directly.
"$bin" server 0 2 >"$tmp/srv2.out" 2>&1 &
spid2=$!
for _ in $(seq 1 100); do grep -q '^port=' "$tmp/srv2.out" && break; sleep 0.05; done
port2=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$tmp/srv2.out")
[ -n "$port2" ] || fail "no port=N line from the 2-thread server"
check_run "$port2" 64 3000 16 3
check_run "$port2" 65536 200 4 3
kill -TERM "$spid2"
wait "$spid2" || { rc=$?; spid2=""; fail "the 2-thread server exited $rc on SIGTERM"; }
spid2=""

# Absurd sizes and bad arguments: status 2, nothing run.
"$bin" client "$port" 268435457 1 1 >"$tmp/cli.out" 2>&1
[ $? -eq 2 ] || fail "SIZE over 256 MiB not refused with status 2"
grep -q "256 MiB" "$tmp/cli.out" || fail "no message for the refused SIZE"
"$bin" client "$port" 64 0 1 >"$tmp/cli.out" 2>&1
[ $? -eq 2 ] || fail "CALLS=0 not refused with status 2"
"$bin" client "$port" 64 10 1 0 >"$tmp/cli.out" 2>&1
[ $? -eq 2 ] || fail "CONNECTIONS=0 not refused with status 2"

# A server that flips one byte of the echo stream (in call 2's payload):
# the client must count exactly that call as an error and exit 1.
timeout 20 python3 - "$tmp/bad.port" <<'PY' >"$tmp/bad.out" 2>&1 &
import socket, sys
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen(1)
open(sys.argv[1], "w").write(str(l.getsockname()[1]))
c, _ = l.accept()
seen = 0
while data := c.recv(65536):
    b = bytearray(data)
    flip = 2 * (12 + 64) + 12 + 30 - seen  # frame 2, payload byte 30
    if 0 <= flip < len(b):
        b[flip] ^= 1
    seen += len(b)
    c.sendall(b)
PY
bpid=$!
for _ in $(seq 1 100); do [ -s "$tmp/bad.port" ] && break; sleep 0.05; done
timeout 20 "$bin" client "$(cat "$tmp/bad.port")" 64 10 4 >"$tmp/cli.out" 2>&1
rc=$?
wait "$bpid"
[ "$rc" -eq 1 ] || fail "client against a corrupting server exited $rc, not 1"
grep -q "^size=64 calls=10 errors=1 " "$tmp/cli.out" || fail "the flipped byte not counted"

# A server gone: the client reports errors and exits non-zero, in bounded time.
kill -TERM "$spid"
wait "$spid"
rc=$?
spid=""
[ "$rc" -eq 0 ] || fail "server exited $rc on SIGTERM"
timeout 20 "$bin" client "$port" 64 10 4 >"$tmp/cli.out" 2>&1
rc=$?
[ "$rc" -eq 1 ] || fail "client against no server exited $rc, not 1"
echo PASS
