#!/bin/bash
# rpc::ClientPool against real echo_server processes that are killed and
# restarted while 16 calls are in flight (tests/rpc/pool_client.cc):
#  1. the only server kill -9'd, restarted on its port after 3 s: the pool
#     reconnects by itself and new calls succeed; while the server is down
#     the client process uses little CPU (no busy loop) and its calls fail
#     fast (UNAVAILABLE, at once) -- then the same with wait_for_ready (the
#     calls wait instead, and nothing fails after the ones in flight);
#  2. the server stopped with SIGTERM (it drains: the pool's calls it
#     refuses count as drain_retries, not losses) and restarted;
#  3. two servers, one kill -9'd: only the calls in flight on it fail;
#  4. two servers, one SIGTERMed: it drains, and no call fails.
# The recovery time and CPU share are printed; the bounds asserted are
# generous hang guards (the figures are for bench/RESULTS.md, not a race).
#   pool_recovery_test.sh <echo_server> <pool_client>
set -u
server_bin="$1"
client_bin="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
servers=()
client=""
cleanup() {
  for p in "${servers[@]}" $client; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  echo "--- client output (last 40 lines)"; tail -40 "$tmp/client.out"
  for f in "$tmp"/server*.log; do echo "--- $f"; tail -10 "$f"; done
  exit 1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# start_server <slot> <port>: port 0 picks one; its port lands in port_<slot>.
start_server() {
  rm -f "$tmp/port_$1"
  "$server_bin" --provider=soft --address=127.0.0.1 --port="$2" --threads=1 \
    --port_file="$tmp/port_$1" >>"$tmp/server$1.log" 2>&1 &
  servers[$1]=$!
  for _ in $(seq 200); do [[ -s "$tmp/port_$1" ]] && return 0; sleep 0.05; done
  fail "server $1 did not start on port $2"
}

# The last tick line's field $1 (e.g. ok, cpu_ms).
field() { grep '^tick ' "$tmp/client.out" | tail -1 | sed -n "s/.* $1=\([0-9]*\).*/\1/p"; }
wait_field_above() {  # field value [seconds]
  local limit=$(($(now_ms) + ${3:-20} * 1000))
  while (($(now_ms) < limit)); do
    local v
    v=$(field "$1")
    [[ -n "$v" ]] && ((v > $2)) && return 0
    sleep 0.05
  done
  return 1
}

# run_kill_restart <what> <signal> <extra client flags...>
run_kill_restart() {
  local what=$1 sig=$2
  shift 2
  : >"$tmp/client.out"
  start_server 0 0
  local port
  port=$(cat "$tmp/port_0")
  "$client_bin" --servers="127.0.0.1:$port" --callers=16 --run_for=12s "$@" \
    >"$tmp/client.out" 2>&1 &
  client=$!
  wait_field_above ok 200 || fail "$what: no calls succeeded before the kill"
  kill "-$sig" "${servers[0]}"
  wait "${servers[0]}" 2>/dev/null
  local killed_ms
  killed_ms=$(now_ms)
  # kill -9: a loss; SIGTERM: the server drains, the pool closes its side.
  if [[ $sig == KILL ]]; then
    wait_field_above losses 0 10 || fail "$what: the pool never counted the loss"
  else
    wait_field_above drain_retries 0 10 || fail "$what: no call was refused by the draining server"
  fi
  # 0.5 s after the kill to 2.5 s: the pool's CPU while the server is down.
  sleep 0.5
  local cpu0 t0
  cpu0=$(field cpu_ms)
  t0=$(now_ms)
  sleep 2
  local cpu1 t1 ok_down
  cpu1=$(field cpu_ms)
  t1=$(now_ms)
  ok_down=$(field ok)
  sleep $((3 - (t1 - killed_ms) / 1000 > 0 ? 3 - (t1 - killed_ms) / 1000 : 0))
  start_server 0 "$port"
  local restarted_ms
  restarted_ms=$(now_ms)
  wait_field_above ok "$ok_down" 10 ||
    fail "$what: no call succeeded within 10 s of the restart"
  # The first tick with more successes, against the restart.
  local first
  first=$(awk -v ok="$ok_down" '/^tick / {
      split($2, m, "="); split($3, o, "=");
      if (o[2] > ok) { print m[2]; exit } }' "$tmp/client.out")
  local cpu_pct=$(((cpu1 - cpu0) * 100 / (t1 - t0)))
  echo "  $what: recovered $((first - restarted_ms)) ms after the restart" \
    "(tick 100 ms); client CPU while down ${cpu_pct}% of a core" \
    "($((cpu1 - cpu0)) ms in $((t1 - t0)) ms)"
  ((cpu_pct < 25)) || fail "$what: the client used ${cpu_pct}% CPU while the server was down"
  wait "$client"
  local rc=$?
  client=""
  ((rc == 0)) || fail "$what: pool_client exited $rc"
  grep -q '^done ' "$tmp/client.out" || fail "$what: no summary"
  grep -Eq "reconnects=[1-9]" <(grep '^tick ' "$tmp/client.out" | tail -1) ||
    fail "$what: no reconnect counted"
  kill -9 "${servers[0]}" 2>/dev/null
  wait "${servers[0]}" 2>/dev/null
}

echo "1a. kill -9, fail fast"
run_kill_restart "kill -9, fail fast" KILL
# While down the calls failed at once, naming the refused connect.
grep -q 'code=UNAVAILABLE .*no live connection' "$tmp/client.out" ||
  fail "no fail-fast UNAVAILABLE while the server was down"
grep -Eq "fail_fast=[1-9]" <(grep '^tick ' "$tmp/client.out" | tail -1) ||
  fail "fail-fast calls not counted"

echo "1b. kill -9, wait_for_ready"
run_kill_restart "kill -9, wait_for_ready" KILL --wait_for_ready --deadline=10s
# Only the calls in flight at the kill failed (one per caller at most).
fails=$(grep -c '^fail ' "$tmp/client.out")
((fails <= 16)) || fail "wait_for_ready: $fails calls failed (at most the 16 in flight)"
echo "  wait_for_ready: $fails call(s) failed, all in flight at the kill"

echo "2. SIGTERM"
run_kill_restart "SIGTERM" TERM

echo "3. two servers, one kill -9'd"
: >"$tmp/client.out"
start_server 0 0
start_server 1 0
"$client_bin" --servers="127.0.0.1:$(cat "$tmp/port_0"),127.0.0.1:$(cat "$tmp/port_1")" \
  --callers=16 --run_for=6s >"$tmp/client.out" 2>&1 &
client=$!
wait_field_above ok 200 || fail "two servers: no calls succeeded"
kill -9 "${servers[0]}"
wait "${servers[0]}" 2>/dev/null
wait_field_above losses 0 10 || fail "two servers: the loss was not counted"
ok_after=$(field ok)
wait_field_above ok $((ok_after + 500)) 10 ||
  fail "two servers: calls stopped succeeding on the live server"
wait "$client"
rc=$?
client=""
((rc == 0)) || fail "two servers: pool_client exited $rc"
fails=$(grep -c '^fail ' "$tmp/client.out")
((fails <= 16)) || fail "two servers: $fails calls failed (at most the 16 in flight)"
echo "  two servers: $fails call(s) failed (in flight at the kill), $(field ok) succeeded"
kill -9 "${servers[1]}" 2>/dev/null
wait "${servers[1]}" 2>/dev/null

echo "4. two servers, one drained by SIGTERM"
: >"$tmp/client.out"
start_server 0 0
start_server 1 0
"$client_bin" --servers="127.0.0.1:$(cat "$tmp/port_0"),127.0.0.1:$(cat "$tmp/port_1")" \
  --callers=16 --run_for=6s >"$tmp/client.out" 2>&1 &
client=$!
wait_field_above ok 200 || fail "drain: no calls succeeded"
kill -TERM "${servers[0]}"
wait "${servers[0]}" || fail "drain: server 0 exited $? after SIGTERM"
ok_after=$(field ok)
wait_field_above ok $((ok_after + 500)) 10 ||
  fail "drain: calls stopped succeeding on the live server"
wait "$client"
rc=$?
client=""
((rc == 0)) || fail "drain: pool_client exited $rc"
fails=$(grep -c '^fail ' "$tmp/client.out")
((fails == 0)) || fail "drain: $fails calls failed while a server drained"
echo "  drain: 0 calls failed, $(field ok) succeeded;" \
  "$(field drain_retries) refused by the draining server and sent on"
kill -9 "${servers[1]}" 2>/dev/null
wait "${servers[1]}" 2>/dev/null
echo "PASS"
