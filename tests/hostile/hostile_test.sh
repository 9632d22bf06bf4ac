#!/bin/bash
# The echo server against hostile clients: for each case a real
# hostile_client process does the bad thing, bounded in count and time,
# while this script asserts that
#   - the server stays up,
#   - a good echo_client is served meanwhile, within a bound,
#   - afterwards the server is back to its baseline descriptors and memory,
#   - it holds no connection of a hostile client any more (SIGUSR1's
#     counters), and the counters and log account for the refusals.
# On the host: the soft provider on loopback, raw TCP attacks. In the VM
# (tests/vm, COVERBS_PROVIDER=verbs): rxe or siw on the guest's address, raw
# rdma_cm attacks (random private data, connect-then-silent, disconnect right
# after ESTABLISHED, many connects from a process that exits).
#   hostile_test.sh <echo_server> <echo_client> <hostile_client>
set -u
server_bin=$1 client_bin=$2 hostile_bin=$3
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
log="$tmp/server.log"
fail() {
  echo "FAIL: $*"
  echo "--- server log (last 30 lines)"; tail -30 "$log"
  exit 1
}

provider=${COVERBS_PROVIDER:-soft}
[[ "$provider" == auto ]] && provider=soft
addr=127.0.0.1
[[ "$provider" == verbs ]] && addr=${COVERBS_VM_ADDR_A:?the VM harness sets COVERBS_VM_ADDR_A}
# A short accept deadline so that silent peers are dropped within the test.
"$server_bin" --provider="$provider" --address="$addr" --port=0 --threads=2 \
  --port_file="$tmp/port" --accept_timeout=1s >"$log" 2>&1 &
server=$!
trap 'kill -9 $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
[[ -s "$tmp/port" ]] || fail "server did not start"
port=$(cat "$tmp/port")

fds() { ls "/proc/$server/fd" | wc -l; }
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$server/status"; }
alive() { kill -0 "$server" 2>/dev/null || fail "server died ($1)"; }

# A good client: 200 echo calls, verified, on 2 connections; must finish in
# $1 seconds (connecting included).
good_client() {
  local limit=$1 what=$2 start end
  start=$(date +%s%N)
  timeout 20 "$client_bin" --provider="$provider" --server="$addr" --port="$port" \
    --calls=200 --concurrency=8 --connections=2 --size=64 \
    >"$tmp/client.out" 2>&1 || { cat "$tmp/client.out"; fail "good client failed ($what)"; }
  end=$(date +%s%N)
  local ms=$(((end - start) / 1000000))
  ((ms < limit * 1000)) || fail "good client took ${ms} ms, bound ${limit} s ($what)"
  echo "  good client served in ${ms} ms ($what)"
}

# The server's counters, printed on SIGUSR1.
counters() {
  local before
  before=$(grep -c "served .* call(s) on" "$log")
  kill -USR1 "$server"
  for _ in $(seq 100); do
    (($(grep -c "served .* call(s) on" "$log") > before)) && break
    sleep 0.02
  done
  grep "served .* call(s) on" "$log" | tail -1
}

# Memory slack: 16 MiB; under a sanitizer much more (ASan keeps up to 256 MiB
# of freed memory in quarantine, TSan its shadow), so there only a gross
# leak fails.
rss_slack=16384
ldd "$server_bin" 2>/dev/null | grep -q "libasan\|libtsan" && rss_slack=$((512 * 1024))

# Back to the baseline: no connection open, descriptors exactly (within
# 10 s: silent peers go at the 1 s deadline), memory within the slack.
back_to_baseline() {
  local what=$1 n open=-1
  for _ in $(seq 50); do
    open=$(counters | sed -E 's/.*\(([0-9]+) open,.*/\1/')
    [[ "$open" == 0 ]] && break
    sleep 0.2
  done
  [[ "$open" == 0 ]] || fail "$open connection(s) still open after $what"
  for _ in $(seq 200); do
    n=$(fds)
    ((n <= base_fds)) && break
    sleep 0.05
  done
  ((n <= base_fds)) || fail "$n descriptors after $what, baseline $base_fds"
  local rss
  rss=$(rss_kb)
  ((rss <= base_rss + rss_slack)) || fail "RSS ${rss} KiB after $what, baseline ${base_rss} KiB"
  echo "  back to baseline: $n fds, ${rss} KiB RSS"
}

# Seconds a good client may take while under attack: 2 on the host; under
# the VM's emulation (TCG) everything runs ~10x slower.
bound=2
[[ "$provider" == verbs ]] && bound=15
good_client 30 "warm-up"
base_fds=$(fds)
base_rss=$(rss_kb)
echo "baseline: $base_fds fds, $base_rss KiB RSS"

# case <mode> <count> <hold_ms>: the hostile client runs in the background
# while a good client is served; then both are done and the server is back.
run_case() {
  local mode=$1 count=$2 hold=$3
  echo "case $mode (count $count, hold ${hold} ms)"
  timeout 60 "$hostile_bin" --mode="$mode" --address="$addr" --port="$port" \
    --count="$count" --hold_ms="$hold" >"$tmp/hostile.out" 2>&1 &
  local h=$!
  sleep 0.3  # let it open its sockets
  alive "$mode"
  good_client "$bound" "during $mode"
  wait $h || { cat "$tmp/hostile.out"; fail "hostile_client $mode exited $?"; }
  sed 's/^/  hostile: /' "$tmp/hostile.out" | head -25
  alive "$mode"
  back_to_baseline "$mode"
  good_client "$bound" "after $mode"
}

if [[ "$provider" == verbs ]]; then
  run_case cm_random 50 0
  run_case cm_silent 20 2000
  run_case cm_disconnect 40 0
  run_case cm_many_exit 20 0
  want_refused=100
else
  run_case garbage 200 1500
  run_case truncated 200 1500
  run_case absurd 50 500
  run_case slow 20 1500
  run_case silent 400 2000
  run_case accepted_silent 100 2000
  run_case flood 1000 0
  # Accepted connections that then send bad requests (hostile_remote.cc):
  # each is refused by its QP (NAK or protocol error, checked by the
  # hostile client) and ends, and only it: the server accepted them all.
  conns() { counters | sed -E 's/.* on ([0-9]+) connection\(s\).*/\1/'; }
  before=$(conns)
  run_case remote 2 0
  after=$(conns)
  # 2 rounds of 19 cases + the stale-key donor, each accepted.
  ((after - before >= 39)) ||
    fail "the server accepted $((after - before)) of the remote mode's connections, expected >= 39"
  want_refused=1000
fi

# The counters account for it.
line=$(counters)
[[ -n "$line" ]] || fail "no counters printed on SIGUSR1"
echo "counters: $line"
refused=$(sed -E 's/.*\(([0-9]+) open, ([0-9]+) refused.*/\2/' <<<"$line")
((refused >= want_refused)) ||
  fail "the server counted $refused refused connections, expected >= $want_refused"
# And the log has the accepts and the drops of peers that said nothing.
grep -q "accepted conn" "$log" || fail "no log line for an accepted connection"
grep -q "refused .*\(sent nothing\|no valid handshake\)" "$log" ||
  fail "no log line for a peer that said nothing"

kill -TERM "$server"
wait "$server"
rc=$?
trap - EXIT
((rc == 0)) || fail "server exited $rc on SIGTERM"
echo "PASS"
