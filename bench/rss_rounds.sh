#!/bin/bash
# Server memory over rounds of connections: does echo_server give back what
# its connections used once they closed?
#
# Starts echo_server, then runs ROUNDS rounds; each round starts CLIENTS
# echo_client processes at once (each: CONNECTIONS connections, CALLS calls
# per size of SIZES, CONCURRENCY in flight) and waits for all of them. After
# each round (every client exited 0, so every connection closed) it records
# the server's RSS (VmRSS) and its private dirty memory (Private_Dirty of
# /proc/PID/smaps_rollup); after the last round it waits IDLE seconds and
# records them once more. Prints a table. A client that fails (on a host
# loaded enough to trip the soft transport timer, calls can fail) is
# counted in the round's "failed" column and the rounds go on (its
# connections closed all the same); the script then exits 1, as it does
# when the server dies.
#
#   bench/rss_rounds.sh [flags] <echo_server> <echo_client> [-- server flags...]
#     --rounds=N        (20)     --clients=N      (8)
#     --connections=N   (28)     --calls=N        (4000)
#     --concurrency=N   (56)     --sizes=LIST     (64,65536)
#     --threads=N       (8: the server's reactors)
#     --idle=SECONDS    (30)     --provider=NAME  (soft)
#     --settle=SECONDS  (1: wait after each round before measuring)
#     --check_idle=F    fail (exit 3) unless the idle RSS gave back at least
#                       1 - F of what the rounds added at their peak:
#                       idle - start <= F x (peak - start), peak = VmHWM
# The defaults are issue 25's rounds; a short run:
#   bench/rss_rounds.sh --rounds=5 --clients=4 --calls=500 --idle=5 \
#     bazel-bin/examples/echo_server bazel-bin/examples/echo_client
set -u
rounds=20 clients=8 connections=28 calls=4000 concurrency=56
sizes=64,65536 threads=8 idle=30 provider=soft settle=1 check_idle=
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --rounds=*) rounds=${1#*=} ;;
    --clients=*) clients=${1#*=} ;;
    --connections=*) connections=${1#*=} ;;
    --calls=*) calls=${1#*=} ;;
    --concurrency=*) concurrency=${1#*=} ;;
    --sizes=*) sizes=${1#*=} ;;
    --threads=*) threads=${1#*=} ;;
    --idle=*) idle=${1#*=} ;;
    --provider=*) provider=${1#*=} ;;
    --settle=*) settle=${1#*=} ;;
    --check_idle=*) check_idle=${1#*=} ;;
    *) echo "rss_rounds.sh: unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ $# -lt 2 ]]; then
  echo "usage: rss_rounds.sh [flags] <echo_server> <echo_client> [-- server flags...]" >&2
  exit 2
fi
server=$1 client=$2
shift 2
[[ ${1:-} == -- ]] && shift

tmp=$(mktemp -d)
"$server" --provider="$provider" --address=127.0.0.1 --port=0 \
  --port_file="$tmp/port" --threads="$threads" "$@" >"$tmp/server.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 200); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
if [[ ! -s "$tmp/port" ]]; then
  cat "$tmp/server.log"
  echo "rss_rounds.sh: the server did not start" >&2
  exit 1
fi
port=$(cat "$tmp/port")

mib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$pid/status"; }
hwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$pid/status"; }
dirty_kib() { awk '/^Private_Dirty/ {print $2}' "/proc/$pid/smaps_rollup"; }
open_fds() { ls "/proc/$pid/fd" | wc -l; }
row() {  # label failed-clients
  local r d
  r=$(rss_kib) d=$(dirty_kib)
  printf "%-8s %10s %14s %10s %6s %6s  %s\n" "$1" "$(mib "$r")" "$(mib "$d")" \
    "$(mib "$(hwm_kib)")" "$(open_fds)" "$2" "$(cut -d' ' -f1-3 /proc/loadavg)"
  last_rss=$r
}

echo "rss_rounds: $rounds round(s) of $clients client(s) x $connections connection(s)," \
  "--calls=$calls --sizes=$sizes --concurrency=$concurrency;" \
  "server --threads=$threads --provider=$provider $*"
printf "%-8s %10s %14s %10s %6s %6s  %s\n" round "RSS(MiB)" "PrivDirty(MiB)" \
  "peak(MiB)" fds failed loadavg
sleep "$settle"
row start -
start_rss=$last_rss
failed_total=0
declare -a per_round
for ((r = 1; r <= rounds; ++r)); do
  cpids=()
  for ((c = 0; c < clients; ++c)); do
    "$client" --provider="$provider" --server=127.0.0.1 --port="$port" \
      --calls="$calls" --sizes="$sizes" --connections="$connections" \
      --concurrency="$concurrency" >"$tmp/client.$c.log" 2>&1 &
    cpids+=($!)
  done
  failed=0
  for c in "${!cpids[@]}"; do
    if ! wait "${cpids[$c]}"; then
      ((++failed))
      tail -n 2 "$tmp/client.$c.log" | sed "s/^/  round $r client $c: /" >&2
    fi
  done
  ((failed_total += failed))
  if ! kill -0 $pid 2>/dev/null; then
    cat "$tmp/server.log"
    echo "rss_rounds.sh: the server died in round $r" >&2
    exit 1
  fi
  sleep "$settle"
  row "$r" "$failed"
  per_round[r]=$last_rss
done
sleep "$idle"
row "idle${idle}s" -
if ((rounds >= 4)); then
  awk -v a="${per_round[4]}" -v b="${per_round[rounds]}" -v n="$rounds" \
    'BEGIN {printf "round %d / round 4: %.3f\n", n, b / a}'
fi
if [[ -n $check_idle ]]; then
  peak=$(hwm_kib)
  if ! awk -v s="$start_rss" -v i="$last_rss" -v p="$peak" -v f="$check_idle" \
      'BEGIN {exit !(i - s <= f * (p - s))}'; then
    echo "rss_rounds.sh: idle RSS $(mib "$last_rss") MiB kept more than" \
      "$check_idle of the $(mib $((peak - start_rss))) MiB the rounds added" \
      "at their peak ($(mib "$peak") MiB; start $(mib "$start_rss") MiB)" >&2
    exit 3
  fi
fi
if ((failed_total > 0)); then
  grep -v " I: " "$tmp/server.log" | tail -n 5 >&2
  echo "rss_rounds.sh: $failed_total client(s) failed" >&2
  exit 1
fi
