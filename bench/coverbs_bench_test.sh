#!/bin/bash
# Smoke test of coverbs_bench: every mode (loopback, server + client in two
# processes), every test and every output format, tiny sizes and few
# iterations; and --verify catching a corrupted byte (fault-injection build).
#   coverbs_bench_test.sh <coverbs_bench> <coverbs_bench_fault_injection>
set -u
bench="$1"
faulty="$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*"; [ -f "$tmp/out" ] && cat "$tmp/out"; exit 1; }
# Repetitions scaled by COVERBS_TEST_REPEAT_PERCENT (tests/README.md; the VM
# harness runs 10%), never below the floor that keeps the path covered.
percent="${COVERBS_TEST_REPEAT_PERCENT:-100}"
[[ "$percent" =~ ^[1-9][0-9]{0,4}$ ]] || fail "COVERBS_TEST_REPEAT_PERCENT=$percent is not a percentage"
repeat() {  # full floor
  local n=$(($1 * percent / 100))
  echo $((n < $2 ? $2 : n))
}
# --warmup's default (100 per connection, test and size) at full scale.
warmup=$(repeat 100 1)

# 1. Loopback, all tests, all formats, verification on; 50 iterations per
# connection (at least 8: two rounds of the 4 in-flight slots).
iters=$(repeat 50 8)
"$bench" --loopback --test=all --sizes=1,64,8K,64K --iters="$iters" --warmup="$warmup" \
  --depth=4 --connections=2 --threads=2 --verify --progress=off --json="$tmp/r.json" \
  --csv="$tmp/r.csv" --plot="$tmp/r.svg" >"$tmp/out" 2>&1 || fail "loopback run exited $?"
python3 - "$tmp/r.json" "$iters" <<'PY' || fail "JSON check"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["tool"] == "coverbs_bench" and d["mode"] == "loopback", d
import os
want = "verbs" if os.environ.get("COVERBS_PROVIDER") == "verbs" else "soft"
assert d["provider"].startswith(want), (d["provider"], want)
rs = d["results"]
tests = {r["test"] for r in rs}
assert tests == {"send_bw", "write_bw", "read_bw", "send_lat", "rpc_rate", "rpc_lat"}, tests
assert len(rs) == 6 * 4, len(rs)
for r in rs:
    for k in ("bytes", "iterations", "connections", "depth", "seconds", "bw_gbps",
              "bw_mbps", "mpps", "lat_us", "cpu_us_per_msg", "errors", "mismatches",
              "verified"):
        assert k in r, (k, r)
    assert r["iterations"] == 2 * int(sys.argv[2]), r  # --iters per connection, 2 connections
    assert r["errors"] == 0 and r["mismatches"] == 0 and r["verified"], r
    assert r["seconds"] > 0 and r["mpps"] > 0, r
    assert r["bw_mbps"] > 0 or r["bytes"] == 0, r
    lat = r["lat_us"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"], r
    assert r["cpu_us_per_msg"]["client"] is not None and r["cpu_us_per_msg"]["client"] >= 0, r
    assert r["cpu_us_per_msg"]["server"] is not None, r
    assert r["depth"] == (1 if r["test"].endswith("_lat") else 4), r
print("json ok")
PY
[ "$(head -1 "$tmp/r.csv" | cut -d, -f1-3)" = "test,bytes,iterations" ] || fail "CSV header"
[ "$(wc -l <"$tmp/r.csv")" -eq 25 ] || fail "CSV rows"
grep -q "<svg" "$tmp/r.svg" && grep -q "polyline" "$tmp/r.svg" && grep -q "send_bw" "$tmp/r.svg" \
  || fail "SVG plot"
grep -q "^send_bw " "$tmp/out" && grep -q "^rpc_lat " "$tmp/out" || fail "table rows"

# 2. Server and client as two processes.
# Port 0: the server picks free ports and prints them.
"$bench" --server --address="${COVERBS_VM_ADDR_A:-127.0.0.1}" --port=0 --rpc_port=0 >"$tmp/server.out" 2>&1 &
spid=$!
for _ in $(seq 1 100); do
  grep -q "cm port" "$tmp/server.out" && break
  sleep 0.1
done
port=$(sed -n 's/.*cm port \([0-9]*\), rpc port \([0-9]*\).*/\1 \2/p' "$tmp/server.out")
[ -n "$port" ] || { kill $spid; fail "server did not start: $(cat "$tmp/server.out")"; }
set -- $port
cm_port=$1
rpc_port=$2
"$bench" --client="${COVERBS_VM_ADDR_A:-127.0.0.1}" --port="$cm_port" --rpc_port="$rpc_port" --test=send_bw,read_bw,rpc_rate --sizes=2..16 \
    --iters=20 --warmup="$warmup" --verify --progress=off --json="$tmp/c.json" >"$tmp/out" 2>&1 \
  || { kill $spid; fail "client run exited $?"; }
python3 -c "
import json,sys; d=json.load(open('$tmp/c.json')); assert d['mode']=='client'
rs=d['results']; assert len(rs)==3*4, len(rs); assert all(r['errors']==0 and r['mismatches']==0 for r in rs)
assert [r['bytes'] for r in rs[:4]]==[2,4,8,16]" || { kill $spid; fail "client JSON"; }
kill -TERM $spid
wait $spid || fail "server exit status $?"

# 3. --verify catches one corrupted byte (and the run fails).
if "$faulty" --loopback --test=send_bw --sizes=4K --iters=20 --warmup="$warmup" --verify --corrupt_message=7 \
     --progress=off --json="$tmp/f.json" >"$tmp/out" 2>&1; then
  fail "corrupted run exited 0"
fi
python3 -c "
import json; r=json.load(open('$tmp/f.json'))['results'][0]
assert r['mismatches']==1 and r['errors']==0, r" || fail "corruption not reported as 1 mismatch"
grep -q "message 7: byte 2048 differs" "$tmp/out" || fail "mismatch not located"
# Without --verify the same fault goes unnoticed: the check is what caught it.
"$faulty" --loopback --test=send_bw --sizes=4K --iters=20 --warmup="$warmup" --corrupt_message=7 \
  --progress=off >"$tmp/out" 2>&1 || fail "run without --verify failed"
echo PASS
