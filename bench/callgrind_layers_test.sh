#!/bin/bash
# callgrind_layers.py on small hand-written callgrind files: self cost only
# (a call's inclusive cost is not added to the caller), inlined code stays
# with its function, templates go to the layer they name, libraries by
# object, compressed names resolve, and each thread gets its role.
#   callgrind_layers_test.sh <callgrind_layers.py>
set -eu
tool="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
cat >"$tmp/cg.out-01" <<'CG'
version: 1
creator: callgrind-3.19.0
cmd: coverbs_bench
positions: line
events: Ir

ob=(1) /w/coverbs_bench
fl=(1) /proc/self/cwd/cm/connection.cc
fn=(1) coverbs::cm::Connection::Send()
10 100
fi=(2) /usr/include/c++/12/bits/stl_vector.h
20 30
fe=(1)
cob=(2) /usr/lib/x86_64-linux-gnu/libc.so.6
cfi=(3) ???
cfn=(2) memcpy
calls=1 0
11 500
fl=(2)
fn=(3) std::vector<coverbs::rpc::Call, std::allocator<coverbs::rpc::Call> >::push_back()
5 7
fl=(4) /usr/include/boost/core/demangle.hpp
fn=(4) boost::core::demangle()
+1 3
fl=(5) /proc/self/cwd/transport/soft/qp_core.cc
fn=(5) coverbs::transport::soft::QpCore::PostSend()
1 40
fl=(6) /proc/self/cwd/bench/rpc_echo.cc
fn=(6) coverbs::bench::DriveRpc()
1 9
fl=(1)
fn=(1)
12 1

ob=(2)
fl=(3)
fn=(2)
0 50
CG
cat >"$tmp/cg.out-02" <<'CG'
events: Ir
ob=(1) /w/coverbs_bench
fl=(1) /proc/self/cwd/core/reactor.cc
fn=(1) main
1 5
CG
python3 "$tool" --json "$tmp/r.json" "$tmp/cg.out-01" "$tmp/cg.out-02" >"$tmp/out"
python3 - "$tmp/r.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
ir = d["ir"]
want = {
    "client": {"cm": 131, "rpc (templates)": 7, "binary: std/absl/other": 3,
               "transport/soft": 40, "bench": 9, "libc": 50},
    "main": {"core": 5},
}
assert ir == want, ir
assert [t["role"] for t in d["threads"]] == ["client", "main"], d["threads"]
assert [t["ir"] for t in d["threads"]] == [240, 5], d["threads"]
PY
grep -q "client	cm	131" "$tmp/out"
echo PASS
