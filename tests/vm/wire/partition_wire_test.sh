#!/bin/bash
# A partition and a dead host (issue 38, point 3), across two kernels:
# echo_server in guest a; in guest b an rpc::ClientPool under load
# (tests/rpc/pool_client: 4 callers, 3 s deadline per call) and, for (b), a
# second echo_server on b's own address.
#  (a) The wire drops everything at b (wire.sh cut: egress and ingress) for
#      2 s, heals, then for 30 s, heals. Asserted: every failed call ended
#      with a cause that names it (the peer unreachable, no live
#      connection, or its deadline), never later than its deadline; after
#      each heal the pool calls successfully again by itself, within 20 s.
#  (b) Guest a is killed outright (qemu SIGKILL through run-in-vms.sh: no
#      FIN, no DREQ, nothing more on the wire) while the pool calls both
#      servers. Asserted: the pool's calls keep succeeding on the second
#      server, the loss of the first is detected (a connection lost), and
#      the calls that failed are the ones in flight on the dead host.
# The timings (failures, detection, recovery after each heal) are printed
# as "wire-partition:" lines for bench/RESULTS.md. The RC settings that
# bound them are ConnectionOptions::qp's (ACK timeout 14: 67 ms, 7
# retries: a QP with work outstanding fails ~0.5 s into the silence) and
# the pool's reconnect backoff (20 ms to 500 ms); siw retransmits by TCP,
# so there the pool's keepalive (1 s, 3 probes) bounds the detection.
#   partition_wire_test.sh <echo_server> <pool_client> cut|kill
# runs (a) or (b): one boot each keeps each under the VM time budget.
set -u
. "$(dirname "$0")/lib.sh"
server_bin=$1 pool_bin=$2 phase=${3:?cut or kill}
wire=${COVERBS_VM_WIRE_TOOL:?no wire tool (vm-rdma-setup.sh exports it)}

if [ "$ROLE" = server ]; then
  LOGS=("$TMP/server.log")
  # --drain=1s: at the end nothing is left to drain but what the cuts broke.
  serve "$TMP/port" "$server_bin" --address="$SERVER" --port=0 --port_file="$TMP/port" \
    --drain=1s >"$TMP/server.log" 2>&1
  put port "$(cat "$TMP/port")"
  # Killed in (b): the harness counts that as this side's success.
  serve_until_client_exits 900 || fail "echo_server did not exit 0"
  exit 0
fi

out=$TMP/pool.out
LOGS=("$out" "$TMP/local.log")
await port 120
port=$(got port)
field() {  # the last tick's field $1
  grep '^tick ' "$out" | tail -1 | sed -n "s/.* $1=\([0-9]*\).*/\1/p"
}
wait_ok_above() {  # count seconds: until ok > count; prints the ms it took
  local t0 i
  t0=$(now_ms)
  for ((i = 0; i < $2 * 10; i++)); do
    (($(field ok) > $1)) && { echo $(($(now_ms) - t0)); return 0; }
    kill -0 "$pool" 2>/dev/null || fail "pool_client ended early"
    sleep 0.1
  done
  return 1
}
pool() {  # servers, run_for
  "$pool_bin" --provider=verbs --servers="$1" --callers=4 --deadline=3s --tick=100ms \
    --run_for="$2" --keepalive=1s --threads=1 ${COVERBS_WIRE_RETRY:+--retry_count=$COVERBS_WIRE_RETRY} \
    >"$out" 2>&1 &
  pool=$!
}
# Every failure must name its cause: the transport's retries exhausted, no
# live connection, the connection lost, or the call's deadline.
check_failures() {
  local bad
  echo "  failures by cause:"
  grep '^fail ' "$out" | sed 's/^fail start_ms=[0-9]* //; s/conn [0-9]* ([^)]*)/conn N/g; s/([^()]*)$//' |
    cut -c1-150 | sort | uniq -c | sort -rn | head -8 | sed 's/^/    /'
  bad=$(grep '^fail ' "$out" | grep -v "unreachable\|no live connection\|DEADLINE_EXCEEDED\|peer gone\|connection lost\|is down") || true
  [ -z "$bad" ] || fail "failures without a named cause:
$bad"
}

if [ "$phase" = cut ]; then
# (a) partitions of 2 s and 30 s.
pool "$SERVER:$port" 90s
wait_ok_above 20 60 >/dev/null || fail "no calls before the partition"
for secs in 2 30; do
  "$wire" cut  # takes effect as it returns (its tc commands take ~1 s under TCG)
  before=$(field ok)
  fails_before=$(field fail)
  sleep "$secs"
  cut_ok=$(($(field ok) - before))
  "$wire" heal
  recovered=$(wait_ok_above "$(field ok)" 20) || fail "no successful call within 20 s of healing a ${secs}s partition"
  printf 'wire-partition: %2ss cut: %s ok during, %s failed; first ok %s ms after the heal; live=%s losses=%s reconnects=%s\n' \
    "$secs" "$cut_ok" $(($(field fail) - fails_before)) "$recovered" "$(field live)" "$(field losses)" "$(field reconnects)"
done
kill -TERM "$pool" 2>/dev/null
# Callers end within a deadline of the stop: a call that hung would keep
# pool_client from printing "done".
wait "$pool" || fail "pool_client exited $?"
grep -q '^done ' "$out" || fail "pool_client did not finish (a hang)"
check_failures
sed -n 's/^done /  pool (a): /p' "$out"
echo "PASS (partitions of 2 s and 30 s healed)"
exit 0
fi

# (b) the server's host dies while the pool calls it and a local server.
serve "$TMP/local.port" "$server_bin" --address="$COVERBS_VM_ADDR_LOCAL" --port=0 \
  --port_file="$TMP/local.port" >"$TMP/local.log" 2>&1
pool "$SERVER:$port,$COVERBS_VM_ADDR_LOCAL:$(cat "$TMP/local.port")" 40s
wait_ok_above 40 60 >/dev/null || fail "no calls before the kill"
losses_before=$(field losses)
fails_before=$(field fail)
: >"$WIRE_DIR/kill-server"
t_kill=$(now_ms)
first_fail= detected=
for ((i = 0; i < 300; i++)); do
  [ -z "$first_fail" ] && (($(field fail) > fails_before)) && first_fail=$(($(now_ms) - t_kill))
  (($(field losses) > losses_before)) && { detected=$(($(now_ms) - t_kill)); break; }
  sleep 0.1
done
[ -n "$detected" ] || fail "the pool did not see the dead host's connection go within 30 s"
ok_at=$(field ok)
recovered=$(wait_ok_above $((ok_at + 20)) 20) || fail "no calls on the surviving server after the kill"
kill -TERM "$pool" 2>/dev/null
wait "$pool" || fail "pool_client exited $? after the kill"
grep -q '^done ' "$out" || fail "pool_client did not finish (a hang)"
check_failures
failed=$(($(grep '^done ' "$out" | sed -n 's/.* fail=\([0-9]*\).*/\1/p') - fails_before))
printf 'wire-partition: host killed: first call failed after %s ms, the pool counted the loss after %s ms; %s call(s) failed; 20 more ok on the survivor in %s ms\n' \
  "${first_fail:-?}" "$detected" "$failed" "$recovered"
sed -n 's/^done /  pool (b): /p' "$out"
# The calls that failed were those sent to the dead host before the pool
# saw it go: a caller's call there fails at its deadline (3 s) or when the
# connection ends (RC retries, or keepalive: 3 probes 1 s apart), and may
# be sent there once more before the pool saw the loss: at most 3 per
# caller.
((failed <= 12)) || fail "$failed calls failed after the kill (more than 3 per caller)"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || fail "the local echo_server exited $?"
SERVER_PIDS=()
echo "PASS (a dead host's calls failed with their cause, the survivor served the rest)"
