#!/bin/bash
# coverbs' echo RPC (examples/echo_server + echo_client) against
# yalantinglibs' coro_rpc over TCP, side by side on this machine: same
# sizes, one connection with 16 calls in flight, every echoed byte checked
# by both clients, interleaved pairs (coverbs, coro_rpc, coverbs, ...) so
# that both see the same load. Prints calls/s, the ratio, and CPU per call
# of both processes (client + server) for each implementation.
#
#   bench/compare_coro_rpc.sh /path/to/yalantinglibs
#
# The argument is a checkout (a work tree with include/ylt, or a bare git
# directory, whose HEAD is exported to a temporary directory). coro_rpc is
# header-only: bench/coro_rpc/coro_rpc_echo.cpp is compiled with g++
# -std=c++20 -O2 against it (about a minute). Not run in CI (no checkout
# there). Run from the repository root; it builds the coverbs examples with
# `bazel build -c opt` unless ECHO_BIN_DIR names a directory holding them.
#
# Environment (defaults in brackets):
#   SIZES ["64 4096 8160 8192 65536 1048576"]  payload bytes
#   CALLS ["20000 20000 20000 20000 5000 500"] calls per size (same order)
#   REPS [3]        pairs per size
#   DEPTH [16]      calls in flight on the one connection
#   THREADS [1]     server threads (coverbs reactors, coro_rpc io threads)
#   PROVIDER [auto] coverbs provider (auto = soft on a host without RDMA)
#   CORO_RPC_ECHO   a coro_rpc_echo binary built before (skips the compile)
#
# CPU per call: each process's whole-life CPU (user + system, all threads,
# from wait4's rusage) for a run of CALLS calls, minus the same for a run of
# 2 * DEPTH calls of 64 B on fresh processes (start-up, connection set-up
# and teardown), divided by the difference in calls.
set -euo pipefail

if [ $# -ne 1 ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
ylt="$1"
read -r -a sizes <<<"${SIZES:-64 4096 8160 8192 65536 1048576}"
read -r -a calls <<<"${CALLS:-20000 20000 20000 20000 5000 500}"
reps="${REPS:-3}"
depth="${DEPTH:-16}"
threads="${THREADS:-1}"
provider="${PROVIDER:-auto}"
[ "${#sizes[@]}" -eq "${#calls[@]}" ] || { echo "SIZES and CALLS differ in length" >&2; exit 2; }

work="$(mktemp -d)"
spid=""
cleanup() {
  [ -n "$spid" ] && kill -TERM "$spid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# --- the coro_rpc binary
coro="${CORO_RPC_ECHO:-}"
if [ -z "$coro" ]; then
  if [ -d "$ylt/include/ylt" ]; then
    inc="$ylt/include"
  elif git --git-dir="$ylt" rev-parse --verify -q HEAD >/dev/null; then
    mkdir -p "$work/ylt"
    git --git-dir="$ylt" archive HEAD include | tar -x -C "$work/ylt"
    inc="$work/ylt/include"
  else
    echo "compare_coro_rpc: $ylt is neither a yalantinglibs work tree nor a git directory" >&2
    exit 2
  fi
  echo "compiling coro_rpc_echo against $ylt ..." >&2
  coro="$work/coro_rpc_echo"
  g++ -std=c++20 -O2 -DNDEBUG -I "$inc" -I "$inc/ylt/thirdparty" -I "$inc/ylt/standalone" \
    -pthread "$(dirname "$0")/coro_rpc/coro_rpc_echo.cpp" -o "$coro"
fi

# --- the coverbs binaries
bins="${ECHO_BIN_DIR:-}"
if [ -z "$bins" ]; then
  bazel build -c opt //examples:echo_server //examples:echo_client 2>&1 | tail -1 >&2
  bins="bazel-bin/examples"
fi

# cpu_of FILE CMD...: runs CMD and writes its CPU seconds (user + system of
# all its threads, from wait4) to FILE; SIGTERM is passed on to it. A file
# run by python3 directly, so that `cpu_of ... &` leaves its pid in $!.
cat >"$work/cpu_of.py" <<'PY'
import os, signal, sys
out, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.execvp(cmd[0], cmd)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
while True:
    try:
        _, status, ru = os.wait4(pid, 0)
        break
    except InterruptedError:
        continue
with open(out, "w") as f:
    f.write("%.6f\n" % (ru.ru_utime + ru.ru_stime))
code = os.waitstatus_to_exitcode(status)
sys.exit(0 if code == -signal.SIGTERM else code)
PY
cpu_of() { python3 "$work/cpu_of.py" "$@"; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# One pair of fresh processes: run_pair IMPL SIZE CALLS; prints
# "calls_per_s client_cpu_s server_cpu_s".
run_pair() {
  local impl=$1 size=$2 n=$3 port rate
  rm -f "$work/port" "$work/srv.cpu" "$work/cli.cpu"
  if [ "$impl" = coverbs ]; then
    python3 "$work/cpu_of.py" "$work/srv.cpu" "$bins/echo_server" --address=127.0.0.1 --port=0 \
      --port_file="$work/port" --threads="$threads" --provider="$provider" \
      >"$work/srv.out" 2>&1 &
    spid=$!
    for _ in $(seq 1 300); do [ -s "$work/port" ] && break; sleep 0.05; done
    port=$(cat "$work/port")
    cpu_of "$work/cli.cpu" "$bins/echo_client" --server=127.0.0.1 --port="$port" \
      --sizes="$size" --calls="$n" --concurrency="$depth" --connections=1 \
      --provider="$provider" >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; return 1; }
    # The table row: size calls errors elapsed calls/s ...
    rate=$(awk -v s="$size" '$1 == s && $3 == 0 { print $5 }' "$work/cli.out")
  else
    port=$(free_port)
    python3 "$work/cpu_of.py" "$work/srv.cpu" "$coro" server "$port" "$threads" >"$work/srv.out" 2>&1 &
    spid=$!
    cpu_of "$work/cli.cpu" "$coro" client "$port" "$size" "$n" "$depth" \
      >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; return 1; }
    rate=$(sed -n 's/.* errors=0 .*calls_per_s=\([0-9.]*\).*/\1/p' "$work/cli.out")
  fi
  kill -TERM "$spid"
  wait "$spid" || { echo "$impl server exited badly:" >&2; cat "$work/srv.out" >&2; return 1; }
  spid=""
  [ -n "$rate" ] || { echo "$impl: no result:" >&2; cat "$work/cli.out" >&2; return 1; }
  echo "$rate $(cat "$work/cli.cpu") $(cat "$work/srv.cpu")"
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "# $(date -u +%FT%TZ) $(uname -n), load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores;" \
  "1 connection x $depth in flight, server threads $threads, coverbs provider $provider"
results="$work/results"
: >"$results"
for rep in $(seq 1 "$reps"); do
  # Fixed per-process cost (start-up, connect, teardown) of each.
  for impl in coverbs coro_rpc; do
    out=$(run_pair "$impl" 64 $((2 * depth)))
    read -r _ c s <<<"$out"
    echo "$impl base $rep $c $s" >>"$results"
  done
  for k in "${!sizes[@]}"; do
    for impl in coverbs coro_rpc; do
      out=$(run_pair "$impl" "${sizes[$k]}" "${calls[$k]}")
      read -r r c s <<<"$out"
      echo "$impl ${sizes[$k]} $rep $r $c $s" >>"$results"
      printf "rep %d %-8s %8d B: %10.1f calls/s  cpu client %.3f s server %.3f s\n" \
        "$rep" "$impl" "${sizes[$k]}" "$r" "$c" "$s" >&2
    done
  done
done

printf "\n%9s %14s %14s %8s %8s %12s %12s %8s\n" "bytes" "coverbs c/s" "coro_rpc c/s" \
  "ratio" "(range)" "coverbs cpu" "coro cpu" "ratio"
for k in "${!sizes[@]}"; do
  size=${sizes[$k]}
  n=${calls[$k]}
  n0=$((2 * depth))
  # Per rep: rates, ratio, CPU per call (µs, both processes, fixed cost out).
  per_rep=$(for rep in $(seq 1 "$reps"); do
    awk -v s="$size" -v r="$rep" -v n="$n" -v n0="$n0" '
      $2 == "base" && $3 == r { base[$1] = $4 + $5 }
      $2 == s && $3 == r { rate[$1] = $4; cpu[$1] = $5 + $6 }
      END {
        cb = (cpu["coverbs"] - base["coverbs"]) / (n - n0) * 1e6
        cr = (cpu["coro_rpc"] - base["coro_rpc"]) / (n - n0) * 1e6
        print rate["coverbs"], rate["coro_rpc"], rate["coverbs"] / rate["coro_rpc"], cb, cr
      }' "$results"
  done)
  cb_rate=$(awk '{ print $1 }' <<<"$per_rep" | median)
  cr_rate=$(awk '{ print $2 }' <<<"$per_rep" | median)
  ratio=$(awk '{ print $3 }' <<<"$per_rep" | median)
  lo=$(awk '{ print $3 }' <<<"$per_rep" | sort -g | head -1)
  hi=$(awk '{ print $3 }' <<<"$per_rep" | sort -g | tail -1)
  cb_cpu=$(awk '{ print $4 }' <<<"$per_rep" | median)
  cr_cpu=$(awk '{ print $5 }' <<<"$per_rep" | median)
  printf "%9d %14.0f %14.0f %8.2f %8s %9.1f us %9.1f us %8.2f\n" "$size" "$cb_rate" "$cr_rate" \
    "$ratio" "$(printf "%.2f-%.2f" "$lo" "$hi")" "$cb_cpu" "$cr_cpu" \
    "$(awk -v a="$cb_cpu" -v b="$cr_cpu" 'BEGIN { print (b > 0) ? a / b : 0 }')"
done
echo "(medians of $reps interleaved pairs; ratio = coverbs / coro_rpc calls/s, median of" \
  "the per-pair ratios, range over the pairs; cpu = client + server CPU per call)"
