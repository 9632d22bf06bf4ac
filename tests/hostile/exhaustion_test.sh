#!/bin/bash
# Issue #36, points 3 and 4: what a peer can exhaust, with real processes
# on loopback (soft provider) and echo_server's default flags.
#  1. The metrics endpoint: hostile_client --mode=http_slowloris holds
#     $slow sockets on it (as many as rpc::ServerMetrics' default
#     http_threads, 16; half silent, half dripping header bytes, each
#     re-opened once closed) while 10 curl scrapes must each succeed
#     within Prometheus' default scrape timeout (10 s). Before the fix one
#     idle socket stopped every scrape (0 of 10 in 25 s).
#  2. Descriptors: echo_server started under `ulimit -n 1024`, idle (no
#     connection yet); hostile_client --mode=silent_reopen holds 1,100
#     silent sockets on it, re-opening those the server closes; then 7
#     good echo_clients, one after another, must each be served within
#     the hang guard ($guard s; the issue asks for 1 s: the times are
#     printed), with one retry per run for a client starved on a loaded
#     host. Before the fix none of 7 was served in 30 s ("soft:
#     io_uring_queue_init for the progress thread: Too many open files").
#   exhaustion_test.sh <echo_server> <echo_client> <hostile_client>
set -u
server_bin=$1 client_bin=$2 hostile_bin=$3
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
log="$tmp/server.log"
server="" hostile=""
cleanup() {
  [[ -n "$hostile" ]] && kill "$hostile" 2>/dev/null && wait "$hostile" 2>/dev/null
  [[ -n "$server" ]] && kill -9 "$server" 2>/dev/null && wait "$server" 2>/dev/null
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  echo "--- server log (last 30 lines)"; tail -30 "$log"
  echo "--- hostile_client"; cat "$tmp/hostile.out" 2>/dev/null
  exit 1
}
command -v curl >/dev/null || fail "curl is missing (tools/install-deps.sh installs it)"
now_ms() { echo $(($(date +%s%N) / 1000000)); }

start_server() {  # <descriptor limit or ""> extra flags...
  local limit=$1
  shift
  rm -f "$tmp/port"
  (
    [[ -z "$limit" ]] || ulimit -n "$limit" || exit 97
    exec "$server_bin" --provider=soft --address=127.0.0.1 --port=0 \
      --port_file="$tmp/port" "$@"
  ) >"$log" 2>&1 &
  server=$!
  for _ in $(seq 200); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
  [[ -s "$tmp/port" ]] || fail "echo_server did not start"
  port=$(cat "$tmp/port")
}
stop_server() {
  kill -TERM "$server"
  wait "$server"
  local rc=$?
  server=""
  ((rc == 0)) || fail "echo_server exited $rc on SIGTERM"
}
stop_hostile() {
  kill "$hostile" 2>/dev/null
  wait "$hostile" 2>/dev/null
  hostile=""
  sed 's/^/  hostile: /' "$tmp/hostile.out"
}

# --- 1. The metrics endpoint under a slowloris.
slow=16  # rpc::ServerMetrics::Options::http_threads' default
echo "metrics: $slow slowloris sockets (re-opened) on the metrics port"
start_server "" --metrics_port=0
mport=$(sed -n 's/^echo_server: metrics on port \([0-9]*\)$/\1/p' "$log")
[[ -n "$mport" ]] || fail "echo_server printed no metrics port"
"$hostile_bin" --mode=http_slowloris --port="$mport" --count="$slow" \
  --hold_ms=120000 >"$tmp/hostile.out" 2>&1 &
hostile=$!
sleep 0.5  # every worker thread holds one of them by now
ok=0 times=""
for i in $(seq 10); do
  t0=$(now_ms)
  if curl -sS --max-time 10 "http://127.0.0.1:$mport/metrics" >"$tmp/scrape" 2>"$tmp/curl.err" &&
    grep -q '^coverbs_rpc_server_connections_total ' "$tmp/scrape"; then
    ok=$((ok + 1))
  else
    echo "  scrape $i failed: $(cat "$tmp/curl.err")"
  fi
  times="$times $(($(now_ms) - t0))"
done
echo "  $ok of 10 scrapes succeeded; each took (ms):$times"
kill -0 "$hostile" 2>/dev/null || fail "hostile_client ended early"
stop_hostile
((ok == 10)) || fail "$ok of 10 scrapes succeeded under the slowloris"
stop_server

# --- 2. 1,100 silent sockets against a server at ulimit -n 1024.
attackers=1100 guard=5
hard=$(ulimit -Hn)
[[ "$hard" == unlimited ]] || ((hard >= attackers + 100)) ||
  fail "the hard descriptor limit ($hard) leaves hostile_client no room for $attackers sockets"
echo "descriptors: $attackers silent sockets (re-opened) against echo_server at ulimit -n 1024"
# Only the server gets the low limit.
start_server 1024
grep -q "^Max open files *1024 " "/proc/$server/limits" ||
  fail "echo_server does not run at 1024 descriptors: $(grep 'open files' "/proc/$server/limits")"
"$hostile_bin" --mode=silent_reopen --port="$port" --count="$attackers" \
  --hold_ms=120000 >"$tmp/hostile.out" 2>&1 &
hostile=$!
# Until the server holds as many as it lets them have.
for _ in $(seq 100); do
  (($(ls "/proc/$server/fd" | wc -l) >= 700)) && break
  sleep 0.05
done
sleep 1
fds=$(ls "/proc/$server/fd" | wc -l)
echo "  echo_server holds $fds descriptors"
((fds >= 700)) || fail "the attack did not take hold: the server has $fds descriptors"
times="" retried=""
good_client() {  # -> rc; the time it took in $ms
  local t0 rc
  t0=$(now_ms)
  timeout $((guard + 5)) "$client_bin" --provider=soft --server=127.0.0.1 --port="$port" \
    --calls=100 --concurrency=4 --size=64 >"$tmp/client.out" 2>&1
  rc=$?
  ms=$(($(now_ms) - t0))
  ((rc == 0 && ms < guard * 1000))
}
for i in $(seq 7); do
  if ! good_client; then
    # On a loaded 2-core host the flood, the server and the client share
    # the cores; one client in 150 there (plain build, two busy loops
    # beside it) was starved past the guard. One retry per run, in any
    # build; a second miss, or a failed retry, fails the test.
    [[ -z "$retried" ]] || { cat "$tmp/client.out"; fail "good client $i missed the guard ($ms ms), after one retry already"; }
    retried=$i
    echo "  good client $i missed the guard after $ms ms; one retry. It said:"
    grep -v '^coverbs\[transport\] I' "$tmp/client.out" | tail -3 | sed 's/^/    /'
    good_client || { cat "$tmp/client.out"; fail "good client $i missed the guard twice (retry: $ms ms)"; }
  fi
  times="$times $ms"
  kill -0 "$server" 2>/dev/null || fail "echo_server died"
done
echo "  7 of 7 good clients served; each took (ms):$times"
kill -0 "$hostile" 2>/dev/null || fail "hostile_client ended early"
# The counters while the attack holds: pending handshakes at the cap.
kill -USR1 "$server"
sleep 0.3
grep "served .* call(s) on" "$log" | tail -1 | sed 's/^/  /'
stop_hostile
! grep -q "Too many open files" "$log" ||
  fail "the server ran out of descriptors: $(grep -m1 'Too many open files' "$log")"
stop_server
echo "PASS"
