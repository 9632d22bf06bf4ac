#!/bin/bash
# coverbs' echo RPC (examples/echo_server + echo_client) against
# yalantinglibs' coro_rpc over TCP and against a plain TCP echo
# (bench/tcp_echo.cc: the same framing and pipelining, no RPC layer), side
# by side on this machine: same sizes, the same shape (CONNECTIONS
# connections with DEPTH calls in flight on each, 1 x 16 by default; every
# client drives all of its connections from one thread), every echoed byte
# checked by every client, runs interleaved (coverbs, coro_rpc, tcp,
# coverbs, ...) so that all see the same load. Prints calls/s, the ratios,
# CPU per call of both processes (client + server), and each client's call
# latency p50 and p99 with the p99 ratios, for each implementation.
#
#   bench/compare_coro_rpc.sh /path/to/yalantinglibs   # all three
#   bench/compare_coro_rpc.sh -                        # coverbs and tcp only
#
# The argument is a yalantinglibs checkout (a work tree with include/ylt, or
# a bare git directory, whose HEAD is exported to a temporary directory);
# `-`, or NO_CORO_RPC=1 (then the argument may be left out), leaves coro_rpc
# out. coro_rpc is header-only: bench/coro_rpc/coro_rpc_echo.cpp is compiled
# with g++ -std=c++20 -O2 against it (about a minute). Not run in CI. Run
# from the repository root; it builds the coverbs examples and
# //bench:tcp_echo with `bazel build -c opt` unless ECHO_BIN_DIR names a
# directory holding the examples and TCP_ECHO (or ECHO_BIN_DIR/tcp_echo)
# a tcp_echo binary.
#
# Environment (defaults in brackets):
#   SIZES ["64 4096 8160 8192 65536 1048576"]  payload bytes
#   CALLS ["20000 20000 20000 20000 5000 500"] calls per size (same order)
#   REPS [3]        runs of each implementation per size
#   CONNECTIONS [1] connections each client opens (the issue's second
#                   shape: CONNECTIONS=4 DEPTH=64; every CALLS must then
#                   exceed 2 * 4 * 64 = 512, the fixed-cost run below,
#                   which the default 500 for 1 MiB does not)
#   DEPTH [16]      calls in flight on each connection (echo_client gets
#                   --concurrency=CONNECTIONS*DEPTH, which is over all of
#                   its connections)
#   THREADS [1]     server threads (coverbs reactors, coro_rpc io threads,
#                   tcp_echo threads), each serving its share of the
#                   connections
#   PROVIDER [auto] coverbs provider (auto = soft on a host without RDMA)
#   CORO_RPC_ECHO   a coro_rpc_echo binary built before (skips the compile)
#   BASE_BIN_DIR    a directory with another build's echo_server and
#                   echo_client, measured as "base" beside coverbs
#   TCP_ECHO        a tcp_echo binary built before (skips its build)
#   NO_CORO_RPC [0] 1: coverbs and tcp only, as the argument `-`
#   PIN []          pin both processes of every implementation with taskset:
#                   split = server on CPU 1, client on CPU 0; same = both on
#                   CPU 0; empty = the scheduler places them. On a 2-core
#                   host the unpinned TCP echo swings between ~0.3 M and
#                   ~1.2 M calls/s at 64 B depending on whether its two
#                   processes share a core, so pinned runs are the ones
#                   whose ratios repeat.
#
# CPU per call: each process's whole-life CPU (user + system, all threads,
# from wait4's rusage) for a run of CALLS calls, minus the same for a run of
# 2 * CONNECTIONS * DEPTH calls of 64 B on fresh processes (start-up,
# connection set-up and teardown), divided by the difference in calls.
#
# Latency: each client's own, per call, from the call's start (echo_client:
# Call; coro_rpc: send_request; tcp: the request queued for its writev) to
# its response in hand, steady clock; p50 and p99 of all calls of a run
# (nearest rank), then the median over the reps. With DEPTH calls in
# flight it is mostly queueing: about DEPTH * CONNECTIONS / (calls/s).
set -euo pipefail

usage() {
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
no_coro="${NO_CORO_RPC:-0}"
if [ $# -eq 1 ]; then
  ylt="$1"
  [ "$ylt" = - ] && no_coro=1
elif [ $# -eq 0 ] && [ "$no_coro" = 1 ]; then
  ylt=-
else
  usage
fi
if [ "$no_coro" = 1 ]; then impls=(coverbs tcp); else impls=(coverbs coro_rpc tcp); fi
# BASE_BIN_DIR: another coverbs build (echo_server, echo_client) run as a
# fourth implementation, "base", so that a change is measured against its
# parent in the same window.
base_bins="${BASE_BIN_DIR:-}"
[ -n "$base_bins" ] && impls=(coverbs base "${impls[@]:1}")
read -r -a sizes <<<"${SIZES:-64 4096 8160 8192 65536 1048576}"
read -r -a calls <<<"${CALLS:-20000 20000 20000 20000 5000 500}"
reps="${REPS:-3}"
conns="${CONNECTIONS:-1}"
depth="${DEPTH:-16}"
threads="${THREADS:-1}"
provider="${PROVIDER:-auto}"
[ "${#sizes[@]}" -eq "${#calls[@]}" ] || { echo "SIZES and CALLS differ in length" >&2; exit 2; }
for v in "$conns" "$depth"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "CONNECTIONS and DEPTH must be positive integers" >&2; exit 2; }
done
# The fixed-cost run: two windows on every connection.
n0=$((2 * conns * depth))
for n in "${calls[@]}"; do
  [ "$n" -gt "$n0" ] || { echo "every CALLS must exceed 2 * CONNECTIONS * DEPTH = $n0" >&2; exit 2; }
done
case "${PIN:-}" in
  split) srv_pin=(taskset -c 1) cli_pin=(taskset -c 0) ;;
  same) srv_pin=(taskset -c 0) cli_pin=(taskset -c 0) ;;
  "") srv_pin=() cli_pin=() ;;
  *) echo "PIN must be split, same or empty" >&2; exit 2 ;;
esac

work="$(mktemp -d)"
spid=""
cleanup() {
  [ -n "$spid" ] && kill -TERM "$spid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# --- the coro_rpc binary
coro="${CORO_RPC_ECHO:-}"
if [ "$no_coro" = 1 ]; then
  coro=""
elif [ -z "$coro" ]; then
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

# --- the coverbs binaries and tcp_echo, built in one bazel call if needed
bins="${ECHO_BIN_DIR:-}"
tcp="${TCP_ECHO:-}"
[ -z "$tcp" ] && [ -n "$bins" ] && [ -x "$bins/tcp_echo" ] && tcp="$bins/tcp_echo"
targets=()
[ -z "$bins" ] && targets+=(//examples:echo_server //examples:echo_client)
[ -z "$tcp" ] && targets+=(//bench:tcp_echo)
if [ "${#targets[@]}" -gt 0 ]; then
  bazel build -c opt "${targets[@]}" 2>&1 | tail -1 >&2
  # Fail here, not in the first run, when the build did not succeed.
  for t in "${targets[@]}"; do
    f="bazel-bin/$(echo "${t#//}" | tr : /)"
    [ -x "$f" ] || { echo "compare_coro_rpc: $t did not build" >&2; exit 1; }
  done
fi
[ -n "$bins" ] || bins="bazel-bin/examples"
[ -n "$tcp" ] || tcp="bazel-bin/bench/tcp_echo"

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

# The figures of coro_rpc_echo's and tcp_echo's result line:
# "calls_per_s p50_us p99_us", nothing unless errors=0.
ref_result() {
  sed -n 's/.* errors=0 .*calls_per_s=\([0-9.]*\) p50_us=\([0-9.]*\) p99_us=\([0-9.]*\).*/\1 \2 \3/p' "$1"
}

# One pair of fresh processes: run_pair IMPL SIZE CALLS; prints
# "calls_per_s client_cpu_s server_cpu_s p50_us p99_us".
run_pair() {
  local impl=$1 size=$2 n=$3 port rate="" p50="" p99=""
  rm -f "$work/port" "$work/srv.cpu" "$work/cli.cpu"
  if [ "$impl" = coverbs ] || [ "$impl" = base ]; then
    local b="$bins"
    [ "$impl" = base ] && b="$base_bins"
    python3 "$work/cpu_of.py" "$work/srv.cpu" "${srv_pin[@]}" "$b/echo_server" --address=127.0.0.1 --port=0 \
      --port_file="$work/port" --threads="$threads" --provider="$provider" \
      >"$work/srv.out" 2>&1 &
    spid=$!
    for _ in $(seq 1 300); do [ -s "$work/port" ] && break; sleep 0.05; done
    port=$(cat "$work/port")
    cpu_of "$work/cli.cpu" "${cli_pin[@]}" "$b/echo_client" --server=127.0.0.1 --port="$port" \
      --sizes="$size" --calls="$n" --concurrency=$((conns * depth)) --connections="$conns" \
      --provider="$provider" >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; return 1; }
    # The table row: size calls errors elapsed calls/s MB/s p50 p99 p999
    read -r rate p50 p99 < <(awk -v s="$size" '$1 == s && $3 == 0 { print $5, $7, $8 }' "$work/cli.out") || true
  elif [ "$impl" = coro_rpc ]; then
    port=$(free_port)
    python3 "$work/cpu_of.py" "$work/srv.cpu" "${srv_pin[@]}" "$coro" server "$port" "$threads" >"$work/srv.out" 2>&1 &
    spid=$!
    cpu_of "$work/cli.cpu" "${cli_pin[@]}" "$coro" client "$port" "$size" "$n" "$depth" "$conns" \
      >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; return 1; }
    read -r rate p50 p99 < <(ref_result "$work/cli.out") || true
  else
    # tcp_echo binds port 0 and prints "port=N" once it listens.
    python3 "$work/cpu_of.py" "$work/srv.cpu" "${srv_pin[@]}" "$tcp" server 0 "$threads" >"$work/srv.out" 2>&1 &
    spid=$!
    port=""
    for _ in $(seq 1 300); do
      port=$(sed -n 's/^port=\([0-9]*\)$/\1/p' "$work/srv.out")
      [ -n "$port" ] && break
      sleep 0.05
    done
    [ -n "$port" ] || { echo "tcp_echo server printed no port:" >&2; cat "$work/srv.out" >&2; return 1; }
    cpu_of "$work/cli.cpu" "${cli_pin[@]}" "$tcp" client "$port" "$size" "$n" "$depth" "$conns" \
      >"$work/cli.out" 2>&1 || { cat "$work/cli.out" >&2; return 1; }
    read -r rate p50 p99 < <(ref_result "$work/cli.out") || true
  fi
  kill -TERM "$spid"
  wait "$spid" || { echo "$impl server exited badly:" >&2; cat "$work/srv.out" >&2; return 1; }
  spid=""
  # A coro_rpc_echo or tcp_echo built before they printed percentiles
  # gives calls/s but no p99: refused rather than shown as 0.
  [ -n "$rate" ] && [ -n "$p99" ] || {
    echo "$impl: no result (calls/s, p50 and p99):" >&2
    cat "$work/cli.out" >&2
    return 1
  }
  echo "$rate $(cat "$work/cli.cpu") $(cat "$work/srv.cpu") $p50 $p99"
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "# $(date -u +%FT%TZ) $(uname -n), load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores;" \
  "$conns connection(s) x $depth in flight each, server threads $threads, coverbs provider $provider," \
  "pin ${PIN:-none};" \
  "${impls[*]}"
results="$work/results"
: >"$results"
for rep in $(seq 1 "$reps"); do
  # Fixed per-process cost (start-up, connect, teardown) of each.
  for impl in "${impls[@]}"; do
    out=$(run_pair "$impl" 64 "$n0")
    read -r _ c s <<<"$out"
    echo "$impl base $rep $c $s" >>"$results"
  done
  for k in "${!sizes[@]}"; do
    for impl in "${impls[@]}"; do
      out=$(run_pair "$impl" "${sizes[$k]}" "${calls[$k]}")
      read -r r c s p50 p99 <<<"$out"
      echo "$impl ${sizes[$k]} $rep $r $c $s $p50 $p99" >>"$results"
      printf "rep %d %-8s %8d B: %10.1f calls/s  cpu client %.3f s server %.3f s  p50 %.1f us p99 %.1f us\n" \
        "$rep" "$impl" "${sizes[$k]}" "$r" "$c" "$s" "$p50" "$p99" >&2
    done
  done
done

# Two tables. Throughput: coverbs, then each reference with its calls/s,
# coverbs ÷ it (median and range of the per-rep ratios), and CPU per call
# with coverbs ÷ it. Latency: each implementation's p50 and p99, and
# coverbs' p99 ÷ each reference's (median and range of the per-rep ratios).
refs=("${impls[@]:1}")
# range: "lo-hi" of the numbers on stdin, one a line.
range() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.2f-%.2f", lo, hi }'; }
hdr=$(printf "%9s %13s" "bytes" "coverbs c/s")
for ref in "${refs[@]}"; do
  hdr+=$(printf " %13s %6s %11s" "$ref c/s" "ratio" "(range)")
done
hdr+=$(printf " %12s" "coverbs cpu")
for ref in "${refs[@]}"; do hdr+=$(printf " %12s %6s" "$ref cpu" "ratio"); done
lat_hdr=$(printf "%9s %11s %11s" "bytes" "coverbs p50" "coverbs p99")
for ref in "${refs[@]}"; do
  lat_hdr+=$(printf " %12s %12s %6s %11s" "$ref p50" "$ref p99" "ratio" "(range)")
done
printf "\n%s\n" "$hdr"
lat_lines=()
for k in "${!sizes[@]}"; do
  size=${sizes[$k]}
  n=${calls[$k]}
  # Per rep and implementation: "impl rep rate cpu_us_per_call p50 p99"
  # (cpu: both processes, fixed cost out).
  per_rep=$(for rep in $(seq 1 "$reps"); do
    awk -v s="$size" -v r="$rep" -v n="$n" -v n0="$n0" '
      $2 == "base" && $3 == r { base[$1] = $4 + $5 }
      $2 == s && $3 == r { rate[$1] = $4; cpu[$1] = $5 + $6; p50[$1] = $7; p99[$1] = $8 }
      END { for (i in rate) print i, r, rate[i], (cpu[i] - base[i]) / (n - n0) * 1e6, p50[i], p99[i] }' "$results"
  done)
  col() { awk -v i="$1" -v c="$2" '$1 == i { print $c }' <<<"$per_rep"; }
  # ratio IMPL COL: coverbs ÷ IMPL in column COL, one line per rep.
  ratio() {
    awk -v i="$1" -v c="$2" '$1 == "coverbs" { cb[$2] = $c } $1 == i { x[$2] = $c }
      END { for (r in x) print (x[r] > 0) ? cb[r] / x[r] : 0 }' <<<"$per_rep"
  }
  cb_cpu=$(col coverbs 4 | median)
  line=$(printf "%9d %13.0f" "$size" "$(col coverbs 3 | median)")
  for ref in "${refs[@]}"; do
    rs=$(ratio "$ref" 3)
    line+=$(printf " %13.0f %6.2f %11s" "$(col "$ref" 3 | median)" "$(median <<<"$rs")" \
      "$(range <<<"$rs")")
  done
  line+=$(printf " %9.1f us" "$cb_cpu")
  for ref in "${refs[@]}"; do
    c=$(col "$ref" 4 | median)
    line+=$(printf " %9.1f us %6.2f" "$c" "$(awk -v a="$cb_cpu" -v b="$c" 'BEGIN { print (b > 0) ? a / b : 0 }')")
  done
  echo "$line"
  line=$(printf "%9d %11.1f %11.1f" "$size" "$(col coverbs 5 | median)" "$(col coverbs 6 | median)")
  for ref in "${refs[@]}"; do
    rs=$(ratio "$ref" 6)
    line+=$(printf " %12.1f %12.1f %6.2f %11s" "$(col "$ref" 5 | median)" "$(col "$ref" 6 | median)" \
      "$(median <<<"$rs")" "$(range <<<"$rs")")
  done
  lat_lines+=("$line")
done
echo "(medians of $reps interleaved runs of each; ratio = coverbs / that implementation:" \
  "calls/s, median of the per-rep ratios and their range; cpu = client + server CPU" \
  "per call, ratio of the medians)"
printf "\n%s\n" "$lat_hdr"
printf "%s\n" "${lat_lines[@]}"
echo "(call latency in us as each client measures it, $conns connection(s) x $depth in flight;" \
  "medians of the $reps runs' p50 and p99; ratio = coverbs p99 / that implementation's p99," \
  "median of the per-rep ratios and their range: above 1, coverbs' tail is longer)"
