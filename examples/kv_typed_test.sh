#!/bin/bash
# The typed kv example end to end, as two processes: kv_typed_client puts
# and gets 500 keys with 16 calls in flight on a 4-reactor server, then
# reads the whole store by one RDMA READ from the snapshot region; every
# value must match; then two clients at once; then scrapes the server's
# /metrics with curl (the Put calls counted per method and code; checked by
# promtool where installed). Also holds the example to its size (issue
# #37), without blank lines, comments, includes and flag definitions: the
# client (on an rpc::ClientPool, its snapshot READ through a lease) in at
# most 60 lines, the server in at most 50, their shared header in 15.
#   kv_typed_test.sh <kv_typed_server> <kv_typed_client> <source dir>
set -u
server="$1"
client="$2"
src="$3"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
addr="${COVERBS_VM_ADDR_A:-127.0.0.1}"
fail() { echo "FAIL: $*"; cat "$tmp/out" "$tmp/server.out" 2>/dev/null; kill "$spid" 2>/dev/null; exit 1; }

count() { grep -cvE '^\s*$|^\s*//|^#|^ABSL_FLAG|^\s*"[^"]*"\);$' "$src/$1"; }
server_lines=$(count kv_typed_server.cc)
client_lines=$(count kv_typed_client.cc)
header_lines=$(count kv_typed.h)
echo "kv_typed: server $server_lines, client $client_lines, header $header_lines lines"
[ "$server_lines" -le 50 ] || { spid=; fail "kv_typed_server takes $server_lines lines (> 50)"; }
[ "$client_lines" -le 60 ] || { spid=; fail "kv_typed_client takes $client_lines lines (> 60)"; }
[ "$header_lines" -le 15 ] || { spid=; fail "kv_typed.h takes $header_lines lines (> 15)"; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
mport=$(free_port)
"$server" --address="$addr" --port="$port" --threads=4 --metrics_port="$mport" >"$tmp/server.out" 2>&1 &
spid=$!
ok=
for _ in $(seq 1 100); do
  if timeout 60 "$client" --server="$addr" --port="$port" --keys=500 >"$tmp/out" 2>&1; then
    ok=1; break
  fi
  grep -q "connection refused\|UNAVAILABLE" "$tmp/out" || break  # a real failure
  sleep 0.1
done
[ -n "$ok" ] || fail "kv_typed_client failed"
cat "$tmp/out"
grep -q "^Get(no-such-key): NOT_FOUND: no key no-such-key" "$tmp/out" || fail "missing key not NOT_FOUND"
grep -q "500 key(s) put and got, 16 in flight; snapshot of [0-9]* bytes read by one RDMA READ: 500 key(s); 0 mismatch(es)" \
  "$tmp/out" || fail "unexpected summary"
# Two clients at once (the server's reactors serve one each; the store is
# shared): both see all their values and their own snapshot.
"$client" --server="$addr" --port="$port" --keys=300 >"$tmp/out1" 2>&1 &
c1=$!
"$client" --server="$addr" --port="$port" --keys=300 >"$tmp/out2" 2>&1 || fail "second client: $(cat "$tmp/out2")"
wait "$c1" || fail "first client: $(cat "$tmp/out1")"
grep -q "0 mismatch(es)" "$tmp/out1" && grep -q "0 mismatch(es)" "$tmp/out2" || fail "concurrent clients"
# 500 + 2 x 300 Puts, all OK (the first client's tries before the server
# listened made no call).
curl -sS --max-time 5 "http://$addr:$mport/metrics" >"$tmp/metrics" || fail "metrics scrape failed"
puts=$(awk '/^coverbs_rpc_server_method_calls_total\{.*method="Put"/ && /code="OK"/ { print $2 }' "$tmp/metrics")
[ "$puts" = 1100 ] || fail "metrics: Put OK calls = '$puts', expected 1100: $(grep Put "$tmp/metrics")"
if command -v promtool >/dev/null; then
  promtool check metrics <"$tmp/metrics" >"$tmp/promtool" 2>&1 || fail "promtool: $(cat "$tmp/promtool")"
fi
echo "metrics: $puts Put calls counted"
kill -TERM "$spid"
wait "$spid" || fail "kv_typed_server exit status $?"
echo PASS
