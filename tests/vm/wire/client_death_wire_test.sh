#!/bin/bash
# The client's host dies (issue 38, point 3c), across two kernels:
# echo_server in guest a (keepalive 1 s: 3 unanswered probes end a
# connection); in guest b echo_client opens 4 connections, makes 64 B and
# 1 MiB calls (the rendezvous and landing grants register memory on the
# server) and holds them open; then guest b is killed outright (qemu
# SIGKILL through run-in-vms.sh: nothing more comes on the wire). Asserted
# on the server: its open connections go to 0, and the device's queue
# pairs and memory registrations (rdma resource show: the kernel's count
# for the device) back to what they were after the same client had come
# and gone cleanly (the Worker keeps registered rendezvous buffers for
# reuse: those stay either way), within 15 s of the kill. The times are printed as
# "wire-client-death:" lines. Without keepalive nothing would notice an
# idle connection's peer gone (no traffic, no RC timer).
#   client_death_wire_test.sh <echo_server> <echo_client>
set -u
. "$(dirname "$0")/lib.sh"
server_bin=$1 client_bin=$2
mport=9471  # a fresh guest: nothing else listens there

if [ "$ROLE" = client ]; then
  LOGS=("$TMP/client.log")
  await port 120
  flags=(--server="$SERVER" --port="$(got port)" --connections=4 --sizes=64,1048576
    --calls=16 --concurrency=8)
  "$client_bin" "${flags[@]}" >"$TMP/client.log" 2>&1 || fail "the clean run exited $?"
  put warmed
  await baseline 120
  "$client_bin" "${flags[@]}" --hold=600s >"$TMP/client.log" 2>&1 &
  for _ in $(seq 600); do
    grep -q "^echo_client: holding" "$TMP/client.log" && break
    kill -0 $! 2>/dev/null || fail "echo_client exited before holding"
    sleep 0.1
  done
  grep -q "^echo_client: holding 4 idle connection" "$TMP/client.log" || fail "echo_client did not hold 4 connections"
  put holding
  await measured 120
  echo "client: killing this guest"
  trap - EXIT
  : >"$WIRE_DIR/kill-client"
  sleep 600
  exit 1
fi

LOGS=("$TMP/server.log")
metric() {  # the value of coverbs_rpc_server_$1
  curl -sS --max-time 5 "http://$SERVER:$mport/metrics" 2>/dev/null |
    awk -v m="coverbs_rpc_server_$1" '$1 == m { print $2 }'
}
resources() {  # "qp N mr N" of the device
  rdma resource show | sed -n "s/.* qp \([0-9]*\) .* mr \([0-9]*\) .*/qp \1 mr \2/p"
}
serve "$TMP/port" "$server_bin" --address="$SERVER" --port=0 --port_file="$TMP/port" \
  --keepalive=1s --metrics_port=$mport >"$TMP/server.log" 2>&1
put port "$(cat "$TMP/port")"
await warmed 300
for _ in $(seq 50); do
  [ "$(metric open_connections)" = 0 ] && break
  sleep 0.2
done
idle=$(resources)
put baseline
await holding 300
loaded=$(resources)
open=$(metric open_connections)
echo "server: after a clean client: $idle; with its 4 connections: $loaded, open_connections $open"
[ "$open" = 4 ] || fail "open_connections is '$open' with the client holding 4"
[ "$loaded" != "$idle" ] || fail "the client's connections took no queue pair or registration"
put measured
for _ in $(seq 600); do
  [ -e "$WIRE_DIR/client-exited" ] && break
  sleep 0.1
done
[ -e "$WIRE_DIR/client-exited" ] || fail "the client's guest was not killed"
t0=$(now_ms)
closed= freed=
while (($(now_ms) - t0 < 15000)); do
  [ -z "$closed" ] && [ "$(metric open_connections)" = 0 ] && closed=$(($(now_ms) - t0))
  [ -n "$closed" ] && [ "$(resources)" = "$idle" ] && { freed=$(($(now_ms) - t0)); break; }
  sleep 0.2
done
echo "wire-client-death: connections closed ${closed:-never} ms, device back to '$idle' ${freed:-never} ms after the client's host died (keepalive 1 s x 3)"
grep "connections ended\|closed:" "$TMP/server.log" | tail -3 | sed 's/^/  /'
[ -n "$closed" ] || fail "open_connections still $(metric open_connections) 15 s after the client died"
[ -n "$freed" ] || fail "the device still has '$(resources)' 15 s after the client died (after a clean client: '$idle')"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || fail "echo_server exited $? on SIGTERM"
echo "PASS (the dead client's connections and registrations freed in $freed ms)"
