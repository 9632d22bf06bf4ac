#!/bin/bash
# The typed kv example across two kernels (tests/vm/run-in-vms.sh):
# kv_typed_server in one guest, kv_typed_client (an rpc::ClientPool) in the
# other, by the server's host name: puts and gets keys with 16 in flight,
# then reads the whole store by one RDMA READ of the region the server
# exposed to that connection; then scrapes the server's /metrics over the
# same wire (plain TCP beside the RDMA traffic). On siw, which has no
# memory windows, the server's ExposeBytes refuses the snapshot (a key it
# cannot scope to one connection) and the client must fail with that
# reason, naming the device, after its puts and gets succeeded.
#   kv_typed_wire_test.sh <kv_typed_server> <kv_typed_client>
set -u
. "$(dirname "$0")/lib.sh"
server_bin=$1 client_bin=$2
port=7471 mport=9471  # a fresh guest: nothing else listens there

if [ "$ROLE" = server ]; then
  LOGS=("$TMP/server.log")
  "$server_bin" --address="$SERVER" --port=$port --metrics_port=$mport --threads=2 \
    >"$TMP/server.log" 2>&1 &
  SERVER_PIDS+=($!)
  put started
  serve_until_client_exits || fail "kv_typed_server did not exit 0"
  exit 0
fi

LOGS=("$TMP/out")
await started 120
keys=$(repeat 500 100)
rc=1
for _ in $(seq 1 100); do  # the server may still be opening its device
  timeout 120 "$client_bin" --server="$COVERBS_VM_NAME_A" --port=$port --keys="$keys" \
    >"$TMP/out" 2>&1
  rc=$?
  ((rc == 0)) && break
  grep -qi "connection refused" "$TMP/out" || break
  sleep 0.2
done
sed 's/^/  /' "$TMP/out"
grep -q "^Get(no-such-key): NOT_FOUND: no key no-such-key" "$TMP/out" ||
  fail "kv_typed_client exited $rc before its gets were done"
if [ "$COVERBS_VM_RDMA" = siw ]; then
  ((rc == 1)) || fail "kv_typed_client exited $rc on siw, where the snapshot cannot be exposed"
  grep -q "FAILED_PRECONDITION: expose on conn .*device siw0 has no type-2 memory windows" "$TMP/out" ||
    fail "the snapshot's refusal did not name its reason"
else
  ((rc == 0)) || fail "kv_typed_client exited $rc"
  grep -q "$keys key(s) put and got, 16 in flight; snapshot of [0-9]* bytes read by one RDMA READ: $keys key(s); 0 mismatch(es)" \
    "$TMP/out" || fail "unexpected summary"
fi
curl -sS --max-time 20 "http://$COVERBS_VM_NAME_A:$mport/metrics" >"$TMP/metrics" ||
  fail "metrics scrape across the wire failed"
puts=$(awk '/^coverbs_rpc_server_method_calls_total\{.*method="Put"/ && /code="OK"/ { print $2 }' "$TMP/metrics")
[ "$puts" = "$keys" ] || fail "metrics: Put OK calls = '$puts', expected $keys"
echo "PASS ($keys keys put and got, the snapshot as the device allows, /metrics scraped across the wire)"
