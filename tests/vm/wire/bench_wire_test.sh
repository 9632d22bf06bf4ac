#!/bin/bash
# coverbs_bench across two kernels (tests/vm/run-in-vms.sh): the server in
# one guest, the client in the other; connection-level SEND/RECV, RDMA
# WRITE and READ, and RPC, at sizes from one byte to 1 MiB (several wire
# packets each), every byte verified. The rates are printed for the record
# (TCG: only ratios against perftest run the same way mean anything).
#   bench_wire_test.sh <coverbs_bench>
set -u
. "$(dirname "$0")/lib.sh"
bench=$1

if [ "$ROLE" = server ]; then
  LOGS=("$TMP/server.out")
  "$bench" --server --address="$SERVER" --port=0 --rpc_port=0 >"$TMP/server.out" 2>&1 &
  SERVER_PIDS+=($!)
  ports=
  for _ in $(seq 1 300); do
    ports=$(sed -n 's/.*cm port \([0-9]*\), rpc port \([0-9]*\).*/\1 \2/p' "$TMP/server.out")
    [ -n "$ports" ] && break
    sleep 0.1
  done
  [ -n "$ports" ] || fail "coverbs_bench --server did not start"
  put ports "$ports"
  serve_until_client_exits || fail "coverbs_bench --server did not exit 0"
  exit 0
fi

LOGS=("$TMP/out")
await ports 120
read -r cm_port rpc_port <"$SHARED/ports"
iters=$(repeat 100 10)
"$bench" --client="$SERVER" --port="$cm_port" --rpc_port="$rpc_port" \
  --test=send_bw,write_bw,read_bw,send_lat,rpc_rate,rpc_lat --sizes=1,8K,1M --depth=4 \
  --iters="$iters" --warmup=4 --verify --progress=off --json="$TMP/c.json" >"$TMP/out" 2>&1 ||
  fail "coverbs_bench --client exited $?"
sed 's/^/  /' "$TMP/out"
python3 - "$TMP/c.json" <<'PY' || fail "client JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["mode"] == "client", d["mode"]
rs = d["results"]
assert len(rs) == 6 * 3, len(rs)
bad = [r for r in rs if r["errors"] or r["mismatches"]]
assert not bad, bad
PY
echo "PASS (6 tests x 3 sizes across the wire, verified)"
