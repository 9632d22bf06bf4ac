#!/bin/bash
# The rendezvous cliff, with and without landing buffers, side by side:
# echo_server + echo_client (1 connection, DEPTH calls in flight, every byte
# verified) at the last eager size, the first sizes above it, and around
# landing_buffer_size; runs with landing buffers (the default) and without
# (--landing_buffers=0 on both sides: every medium message by rendezvous)
# interleave on, off, on, off, ... on fresh processes.
#
#   bench/landing_cliff.sh ECHO_SERVER ECHO_CLIENT PROVIDER ADDRESS
#   (in the VM: VM_RDMA=rxe tests/vm/run-in-vm.sh bench/landing_cliff.sh \
#      bazel-bin/examples/echo_server bazel-bin/examples/echo_client verbs \
#      '$COVERBS_VM_ADDR_A')
#
# Environment: SIZES ["8160 8192 16384 65536 131040 131072"] payload bytes,
# CALLS [5000], REPS [3], DEPTH [16].
set -euo pipefail
if [ $# -ne 4 ]; then sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
server=$1 client=$2 provider=$3 addr=$4
sizes=${SIZES:-8160 8192 16384 65536 131040 131072}
calls=${CALLS:-5000}
reps=${REPS:-3}
depth=${DEPTH:-16}
work=$(mktemp -d)
spid=""
trap '[ -n "$spid" ] && kill -9 $spid 2>/dev/null; rm -rf "$work"' EXIT
csv=$(tr ' ' ',' <<<"$sizes")

run() {  # run on|off REP: one server, one client over every size
  local mode=$1 rep=$2 flag=""
  [ "$mode" = off ] && flag="--landing_buffers=0"
  rm -f "$work/port"
  "$server" --address="$addr" --port=0 --port_file="$work/port" --threads=1 \
    --provider="$provider" $flag >"$work/srv.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 200); do [ -s "$work/port" ] && break; sleep 0.05; done
  "$client" --server="$addr" --port="$(cat "$work/port")" --provider="$provider" \
    --sizes="$csv" --calls="$calls" --concurrency="$depth" $flag >"$work/cli.out" 2>&1 ||
    { cat "$work/cli.out" "$work/srv.log" >&2; exit 1; }
  kill -TERM $spid; wait $spid || true; spid=""
  awk -v m="$mode" -v r="$rep" '$1 ~ /^[0-9]+$/ && NF >= 9 { if ($3 != 0) exit 1; print m, r, $1, $5, $7 }' \
    "$work/cli.out" >>"$work/results" || { echo "errors:" >&2; cat "$work/cli.out" >&2; exit 1; }
}

echo "# $(date -u +%FT%TZ) $(uname -n), load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cpus;" \
  "provider $provider, 1 connection x $depth in flight, $calls calls per size"
: >"$work/results"
for rep in $(seq 1 "$reps"); do
  run on "$rep"
  run off "$rep"
done
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
printf "%9s %14s %14s %8s %10s %10s\n" bytes "landing c/s" "rendezvous c/s" ratio "p50 on us" "p50 off us"
for s in $sizes; do
  on=$(awk -v s="$s" '$1 == "on" && $3 == s { print $4 }' "$work/results" | median)
  off=$(awk -v s="$s" '$1 == "off" && $3 == s { print $4 }' "$work/results" | median)
  lon=$(awk -v s="$s" '$1 == "on" && $3 == s { print $5 }' "$work/results" | median)
  loff=$(awk -v s="$s" '$1 == "off" && $3 == s { print $5 }' "$work/results" | median)
  printf "%9d %14.0f %14.0f %8.2f %10.1f %10.1f\n" "$s" "$on" "$off" \
    "$(awk -v a="$on" -v b="$off" 'BEGIN { print a / b }')" "$lon" "$loff"
done
echo "(medians of $reps interleaved runs; ratio = with landing buffers / without)"
