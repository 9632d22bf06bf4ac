#!/bin/bash
# coverbs_bench on the soft provider against UCX's own benchmark,
# ucx_perftest, over UCX's tcp transport, on the same loopback: the field's
# standard as the reference for one message's latency and the small-message
# rate. Runs are interleaved (UCX, coverbs busy, coverbs event, UCX, ...) so
# that all see the same load; each run is a fresh pair of processes (server
# and client), as ucx_perftest's.
#
#   bench/compare_ucx.sh
#   REPS=1 LAT_ITERS=200 RATE_ITERS=2000 bench/compare_ucx.sh   # a smoke run
#
# What is compared (UCX busy-polls its worker in ucx_perftest; coverbs runs
# in each of MODES, both processes with the same --poll):
#   latency: ucx_perftest -t $UCX_LAT (tag_lat) p50 against coverbs_bench
#            send_lat p50, at each of LAT_SIZES; both are half the round
#            trip of a ping-pong. Ratio coverbs ÷ UCX (lower is better).
#   rate:    ucx_perftest -t $UCX_RATE (tag_bw) overall message rate with
#            DEPTH sends outstanding against coverbs_bench send_bw Mpps at
#            depth DEPTH, at each of RATE_SIZES. Ratio coverbs ÷ UCX.
#
# Environment (defaults in brackets):
#   REPS [3]                 interleaved pairs of each measurement
#   LAT_SIZES ["64 4096"]    RATE_SIZES ["64"]
#   LAT_ITERS [20000]        RATE_ITERS [200000]   iterations per run
#   DEPTH [16]               MODES ["busy event"]  coverbs --poll modes
#   UCX_LAT [tag_lat]        UCX_RATE [tag_bw]     (am: ucp_am_lat/ucp_am_bw)
#   BENCH [bazel-bin/bench/coverbs_bench, built with -c opt if missing]
#   PORT [18600]             base port; UCX uses PORT, coverbs PORT + 1
#
# Not run in CI. Needs ucx_perftest (Debian's ucx-utils:
# tools/install-deps.sh --tools). UCX is held to its tcp transport on lo
# (UCX_TLS=tcp, UCX_NET_DEVICES=lo) so that both move bytes through the
# same kernel TCP loopback; coverbs uses the soft provider (--provider=soft).
# Absolute figures on a shared machine move with its load: read the ratios,
# and the load printed beside each pair.
set -euo pipefail

reps="${REPS:-3}"
read -r -a lat_sizes <<<"${LAT_SIZES:-64 4096}"
read -r -a rate_sizes <<<"${RATE_SIZES:-64}"
lat_iters="${LAT_ITERS:-20000}"
rate_iters="${RATE_ITERS:-200000}"
depth="${DEPTH:-16}"
read -r -a modes <<<"${MODES:-busy event}"
ucx_lat="${UCX_LAT:-tag_lat}"
ucx_rate="${UCX_RATE:-tag_bw}"
bench="${BENCH:-bazel-bin/bench/coverbs_bench}"
port="${PORT:-18600}"
for m in "${modes[@]}"; do
  case $m in
    busy | event | adaptive) ;;
    *) echo "compare_ucx: MODES takes busy, event and/or adaptive, not '$m'" >&2; exit 2 ;;
  esac
done
command -v ucx_perftest >/dev/null ||
  { echo "compare_ucx: no ucx_perftest (apt-get install ucx-utils, or tools/install-deps.sh --tools)" >&2; exit 2; }
if [ ! -x "$bench" ]; then
  bazel build -c opt //bench:coverbs_bench 2>&1 | tail -1 >&2
  [ -x "$bench" ] || { echo "compare_ucx: //bench:coverbs_bench did not build" >&2; exit 1; }
fi

work="$(mktemp -d)"
spid=""
cleanup() {
  if [ -n "$spid" ]; then kill -TERM "$spid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
export UCX_TLS=tcp UCX_NET_DEVICES=lo

load() { cut -d' ' -f1 /proc/loadavg; }

# Waits for server $spid to exit (killed after 30 s: a hung server must not
# hang the comparison).
reap() {
  local what=$1
  for _ in $(seq 1 300); do
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$spid" 2>/dev/null; then
    echo "compare_ucx: $what server did not exit within 30 s; killed" >&2
    kill -KILL "$spid" 2>/dev/null || true
  fi
  wait "$spid" 2>/dev/null || true
  spid=""
}

# ucx TEST SIZE ITERS COLUMN: one ucx_perftest pair; prints the CSV column
# (2 = p50 latency in µs, 8 = overall message rate in msg/s).
ucx() {
  local test=$1 size=$2 n=$3 col=$4 v extra=()
  [ "$col" = 8 ] && extra=(-O "$depth")
  ucx_perftest -p "$port" >"$work/us.out" 2>&1 &
  spid=$!
  sleep 0.5 # the server has no ready signal; the client retries its connect
  timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" -n "$n" \
    -w $((n / 10)) "${extra[@]}" -v -f >"$work/uc.out" 2>&1 ||
    { echo "compare_ucx: ucx_perftest -t $test -s $size failed:" >&2; cat "$work/uc.out" "$work/us.out" >&2; }
  reap "ucx_perftest"
  # The CSV row (-v -f) may be padded with spaces.
  v=$(awk -F, -v c="$col" '{ gsub(/ /, "") } $1 ~ /^[0-9]+$/ { v = $c } END { print v }' "$work/uc.out")
  echo "${v:--}"
}

# coverbs MODE TEST SIZE ITERS FIELD: one coverbs_bench pair on soft;
# prints FIELD of its JSON result (p50 = latency p50 in µs, mpps).
coverbs() {
  local mode=$1 test=$2 size=$3 n=$4 field=$5 cport=$((port + 1))
  rm -f "$work/c.json"
  "$bench" --server --address=127.0.0.1 --port="$cport" --poll="$mode" --provider=soft \
    >"$work/cs.out" 2>&1 &
  spid=$!
  for _ in $(seq 1 100); do grep -q "cm port" "$work/cs.out" && break; sleep 0.05; done
  timeout 120 "$bench" --client=127.0.0.1 --port="$cport" --test="$test" --sizes="$size" \
    --iters="$n" --depth="$depth" --poll="$mode" --provider=soft --progress=off \
    --json="$work/c.json" >"$work/cc.out" 2>&1 ||
    { echo "compare_ucx: coverbs_bench $test $size ($mode) failed:" >&2; cat "$work/cc.out" >&2; }
  kill -TERM "$spid" 2>/dev/null || true
  reap "coverbs_bench"
  [ -s "$work/c.json" ] || { echo "-"; return; }
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['results'][0]
print('%.3f' % (r['lat_us']['p50'] if sys.argv[2] == 'p50' else r['mpps'] * 1e6))" \
    "$work/c.json" "$field"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "-" }'; }

echo "# $(date -u +%FT%TZ) $(uname -n), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg);" \
  "UCX $(ucx_info -v 2>/dev/null | sed -n 's/^# Version *//p' | head -1)" \
  "UCX_TLS=$UCX_TLS ($ucx_lat / $ucx_rate) vs coverbs_bench soft (${modes[*]}), depth $depth"
results="$work/results"
: >"$results"
for rep in $(seq 1 "$reps"); do
  for size in "${lat_sizes[@]}"; do
    u=$(ucx "$ucx_lat" "$size" "$lat_iters" 2)
    c=""
    for m in "${modes[@]}"; do c+=" $(coverbs "$m" send_lat "$size" "$lat_iters" p50)"; done
    echo "lat $size $rep $(load) $u$c" >>"$results"
    echo "rep $rep latency p50 $size B: ucx $u us, coverbs (${modes[*]})$c us, load $(load)" >&2
  done
  for size in "${rate_sizes[@]}"; do
    u=$(ucx "$ucx_rate" "$size" "$rate_iters" 8)
    c=""
    for m in "${modes[@]}"; do c+=" $(coverbs "$m" send_bw "$size" "$rate_iters" mpps)"; done
    echo "rate $size $rep $(load) $u$c" >>"$results"
    echo "rep $rep msg/s $size B: ucx $u, coverbs (${modes[*]})$c, load $(load)" >&2
  done
done

# One row per pair: the figures and coverbs ÷ UCX per mode.
hdr=$(printf "%-4s %7s %3s %5s %12s" kind bytes rep load ucx)
for m in "${modes[@]}"; do hdr+=$(printf " %12s %6s" "coverbs $m" ratio); done
printf "\n%s\n" "$hdr"
while read -r kind size rep l u rest; do
  read -r -a cs <<<"$rest"
  row=$(printf "%-4s %7s %3s %5s %12s" "$kind" "$size" "$rep" "$l" "$u")
  for i in "${!modes[@]}"; do row+=$(printf " %12s %6s" "${cs[$i]}" "$(ratio "${cs[$i]}" "$u")"); done
  echo "$row"
done <"$results"
echo "(lat: p50 in us, half the round trip, ratio = coverbs / ucx, lower is better;" \
  "rate: messages/s, ratio = coverbs / ucx, higher is better); load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
