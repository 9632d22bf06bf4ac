#!/bin/bash
# The framework's ceiling (issue 39, point 2): 64 B echo RPCs per second,
# and per second of CPU, over the loop provider -- client and server in one
# process (--loopback), every work request executed at once by a copy, no
# wire: what is left is core + transport + cm + rpc.
#
#   bench/ceiling.sh                 # build -c opt, 3 runs at depth 1 and 16
#
# "Per core" = calls / the process's user+sys CPU time (/usr/bin/time), so
# it does not depend on how the work is spread over threads (the client's
# and the server's reactors run on two threads; each call crosses them
# twice). The calls counted are --iters plus --warmup, as the CPU time
# covers both (and the set-up, small beside them). Timings depend on the
# machine and its load, printed beside each run; instruction counts do not
# (PROVIDER=loop bench/callgrind_cost.sh).
#
# Environment (defaults in brackets): REPS [3], DEPTHS ["1 16"], SIZE [64],
# ITERS_PER_DEPTH ["1:300000 16:2000000"], WARMUP [10000], POLL [event],
# BIN [built here with -c opt].
set -euo pipefail
cd "$(dirname "$0")/.."

reps="${REPS:-3}"
read -r -a depths <<<"${DEPTHS:-1 16}"
size="${SIZE:-64}"
warmup="${WARMUP:-10000}"
poll="${POLL:-event}"
iters_per_depth="${ITERS_PER_DEPTH:-1:300000 16:2000000}"
bin="${BIN:-}"
if [ -z "$bin" ]; then
  bazel build -c opt //bench:coverbs_bench 2>&1 | tail -1 >&2
  bin=bazel-bin/bench/coverbs_bench
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

iters_for() {
  local d="$1" pair
  for pair in $iters_per_depth; do
    [ "${pair%%:*}" = "$d" ] && { echo "${pair#*:}"; return; }
  done
  echo 1000000
}

echo "# $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, size $size B, poll $poll, 1 connection"
printf "%-6s %-4s %9s %10s %8s %8s %14s %9s %9s  %s\n" depth run calls rpc/s cpu_s wall_s rpc/cpu-s cli_us srv_us loadavg
for d in "${depths[@]}"; do
  n="$(iters_for "$d")"
  for r in $(seq 1 "$reps"); do
    load="$(cut -d' ' -f1-3 /proc/loadavg)"
    /usr/bin/time -f "%U %S %e" -o "$tmp/time" \
      timeout 600 "$bin" --loopback --provider=loop --poll="$poll" \
      --test=rpc_rate --sizes="$size" --depth="$d" --connections=1 \
      --iters="$n" --warmup="$warmup" --progress=off >"$tmp/out" 2>&1 ||
      { echo "ceiling: depth $d run $r failed:" >&2; cat "$tmp/out" >&2; exit 1; }
    # The result row: test bytes iters conn depth Gb/s MB/s Mpps lat... cli srv
    read -r -a row < <(grep '^rpc_rate ' "$tmp/out")
    read -r user sys wall <"$tmp/time"
    python3 - "$d" "$r" "$n" "$warmup" "${row[7]}" "$user" "$sys" "$wall" \
      "${row[-2]}" "${row[-1]}" "$load" <<'PY'
import sys
d, r, n, w, mpps, user, sys_, wall, cli, srv, load = sys.argv[1:]
calls = int(n) + int(w)
cpu = float(user) + float(sys_)
print("%-6s %-4s %9d %10.0f %8.2f %8.2f %14.0f %9s %9s  %s" % (
    d, r, calls, float(mpps) * 1e6, cpu, float(wall), calls / cpu, cli, srv, load))
PY
  done
done
