#!/bin/bash
# The kv example end to end, as two processes: kv_client puts values of
# 100 B, 4000 B and 60000 B (rendezvous), gets their locations by RPC and
# reads them back by one-sided RDMA READ, checking every byte; then an
# oversized Put must fail with RESOURCE_EXHAUSTED.
#   kv_test.sh <kv_server> <kv_client>
set -u
server="$1"
client="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
addr="${COVERBS_VM_ADDR_A:-127.0.0.1}"
fail() { echo "FAIL: $*"; cat "$tmp/out" "$tmp/server.out" 2>/dev/null; kill "$spid" 2>/dev/null; exit 1; }
"$server" --address="$addr" --port=0 --port_file="$tmp/port" --max_value_size=65536 \
  >"$tmp/server.out" 2>&1 &
spid=$!
for _ in $(seq 1 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
[ -s "$tmp/port" ] || fail "kv_server did not start"
port=$(cat "$tmp/port")
"$client" --server="$addr" --port="$port" --keys=30 --reads=600 >"$tmp/out" 2>&1 \
  || fail "kv_client exited $?"
grep -q "30 key(s) put, 30 Get RPC(s), 6[0-9][0-9] one-sided read(s), [0-9]* retried, 0 mismatch(es)" \
  "$tmp/out" || fail "unexpected summary"
grep -q "Get(\"no-such-key\") -> NOT_FOUND" "$tmp/out" || fail "missing key not NOT_FOUND"
# Too large for a slot: a clear error, and the client fails.
"$client" --server="$addr" --port="$port" --keys=1 --value_sizes=70000 >"$tmp/out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "oversized Put: exit status $rc, expected 1 (a clean failure)"
grep -q "RESOURCE_EXHAUSTED: Put key-0: Put: value of 70000 bytes exceeds" "$tmp/out" \
  || fail "oversized Put error not reported"
kill -TERM "$spid"
wait "$spid" || fail "kv_server exit status $?"
grep -q "30 key(s) stored" "$tmp/server.out" || fail "server summary"
echo PASS
