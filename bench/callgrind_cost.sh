#!/bin/bash
# Framework cost per message in instructions (issue 13, item 3): callgrind
# counts of coverbs' own code (core + transport + cm + rpc; the soft
# provider, libc, libstdc++, Abseil and the kernel excluded) per 64 B echo
# RPC and per 64 B `co_await conn.Send`, for each side. Instruction counts
# do not depend on the machine's load or speed, so they compare across
# machines and days where timings do not.
#
#   bench/callgrind_cost.sh            # build, run, print the table
#
# How: coverbs_bench --loopback (client and server in one process, one
# reactor thread each, the soft provider's progress thread beside them),
# run under `valgrind --tool=callgrind --separate-threads=yes
# --fair-sched=yes` twice per test, with N1 and N2 operations after the same
# warm-up; (Ir(N2) - Ir(N1)) / (N2 - N1) leaves out start-up, connection
# set-up, warm-up and teardown. Each thread's self Ir is attributed by
# callgrind_layers.py: to a layer by the source path of the function (code
# inlined into a function counts with it), std/absl templates instantiated
# for coverbs types to the layer they name, the rest to its shared object.
# Thread roles: client = the client side's reactor thread, server = the
# server side's, provider = the soft provider's progress thread (both QPs).
# valgrind 3.19 needs bench/valgrind_uring_shim.cc preloaded to run
# coverbs at all (it would hang in io_uring_enter); the script builds it.
# Under valgrind the threads run one at a time; the whole script takes
# about a minute.
#
# PROVIDER=loop runs it on the in-process loop provider instead (no
# progress thread: its work runs on the client and server threads, in the
# transport/loop row, outside the framework's sum).
#
# Environment (defaults in brackets): PROVIDER [soft], N1 [200], N2 [1200],
# WARMUP [100],
# DEPTH [16], SIZE [64], TESTS ["rpc_rate send_bw"], OUT_DIR [a temporary
# directory; callgrind files, per-run layer tables and callgrind_annotate
# --inclusive=yes listings are kept there when it is given],
# BIN [a coverbs_bench built before with -c opt --copt=-g --strip=never].
set -euo pipefail
cd "$(dirname "$0")/.."

provider="${PROVIDER:-soft}"
n1="${N1:-200}"
n2="${N2:-1200}"
warmup="${WARMUP:-100}"
depth="${DEPTH:-16}"
size="${SIZE:-64}"
read -r -a tests <<<"${TESTS:-rpc_rate send_bw}"
if [ -n "${OUT_DIR:-}" ]; then
  out="$OUT_DIR"
  mkdir -p "$out"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
command -v valgrind >/dev/null || { echo "callgrind_cost: valgrind is not installed" >&2; exit 2; }

bin="${BIN:-}"
# -g for source paths; it does not change the generated code.
targets=(//bench:libvalgrind_uring_shim.so)
[ -z "$bin" ] && targets+=(//bench:coverbs_bench)
bazel build -c opt --copt=-g --strip=never "${targets[@]}" 2>&1 | tail -1 >&2
cp bazel-bin/bench/libvalgrind_uring_shim.so "$out/"
if [ -z "$bin" ]; then
  cp bazel-bin/bench/coverbs_bench "$out/coverbs_bench"
  bin="$out/coverbs_bench"
fi

echo "# $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
  "$(valgrind --version), provider $provider, size $size B, depth $depth," \
  "warm-up $warmup," \
  "N1 $n1, N2 $n2 operations"
for test in "${tests[@]}"; do
  for n in "$n1" "$n2"; do
    rm -f "$out/$test.$n.out"* "$out/$test.$n.inclusive-"*
    # The shim: without it valgrind 3.19 hangs on the first thread that
    # sleeps in io_uring_enter (valgrind_uring_shim.cc says why).
    # KILL: valgrind holds SIGTERM back while a thread is stuck.
    LD_PRELOAD="$out/libvalgrind_uring_shim.so" timeout -s KILL 600 \
      valgrind --tool=callgrind --separate-threads=yes --fair-sched=yes \
      --callgrind-out-file="$out/$test.$n.out" \
      "$bin" --loopback --provider="$provider" --poll=event --threads=1 --connections=1 \
      --test="$test" --sizes="$size" --depth="$depth" --iters="$n" --warmup="$warmup" \
      --progress=off >"$out/$test.$n.log" 2>&1 ||
      { echo "callgrind_cost: $test, $n operations failed:" >&2; cat "$out/$test.$n.log" >&2; exit 1; }
    threads=("$out/$test.$n.out"-[0-9]*)
    python3 bench/callgrind_layers.py --json "$out/$test.$n.json" "${threads[@]}" \
      >"$out/$test.$n.layers"
    for f in "${threads[@]}"; do
      callgrind_annotate --inclusive=yes --threshold=99 "$f" \
        >"${f/.out-/.inclusive-}.txt" 2>/dev/null || true
    done
  done
  python3 - "$out/$test.$n1.json" "$out/$test.$n2.json" "$n1" "$n2" "$test" <<'PY'
import json, sys
a, b = (json.load(open(p))["ir"] for p in sys.argv[1:3])
n1, n2, test = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
per = {}
for role in set(a) | set(b):
    for layer in set(a.get(role, {})) | set(b.get(role, {})):
        d = b.get(role, {}).get(layer, 0) - a.get(role, {}).get(layer, 0)
        per.setdefault(layer, {})[role] = d / (n2 - n1)
roles = [r for r in ("client", "server", "provider", "main", "other")
         if any(r in v for v in per.values())]
what = {"rpc_rate": "one 64 B echo RPC (Call -> Echo -> response)",
        "send_bw": "one 64 B co_await conn.Send (and its Recv on the server)"}.get(test, test)
print(f"\n## {test}: instructions per operation, {what}")
print("%-34s" % "layer" + "".join("%14s" % r for r in roles))
framework = ("core", "transport", "cm", "rpc")
def row(name, vals):
    print("%-34s" % name + "".join("%14.0f" % (vals.get(r, 0) + 0.0) for r in roles))
order = sorted(per, key=lambda l: (l.split(" ")[0] not in framework, l))
for layer in order:
    if any(abs(v) >= 0.5 for v in per[layer].values()):
        row(layer, per[layer])
fw = {r: sum(v.get(r, 0) for l, v in per.items() if l.split(" ")[0] in framework)
      for r in roles}
tot = {r: sum(v.get(r, 0) for v in per.values()) for r in roles}
row("= framework (core+transport+cm+rpc)", fw)
row("= everything", tot)
print("FRAMEWORK_IR_PER_OP %s client=%.0f server=%.0f" % (test, fw.get("client", 0),
                                                       fw.get("server", 0)))
PY
done
