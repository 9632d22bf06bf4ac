#!/bin/bash
# coverbs_bench against perftest on the same RDMA device, back to back in
# the same boot, with the same sizes, iterations and depth, like with like:
# coverbs_bench --poll=busy against perftest busy-polling its CQ (its
# default), and coverbs_bench --poll=event against perftest -e (sleeping on
# CQ events). Prints one table with the ratio coverbs/perftest per mode,
# test and size. perftest has no event mode for WRITE: the event write_bw
# row shows coverbs alone (perftest "n/a").
#
# Run inside the soft-RDMA VM (see tests/vm/README.md), e.g.
#   bazel build -c opt //bench:coverbs_bench
#   VM_RDMA=rxe VM_NETDEV=dummy tests/vm/run-in-vm.sh bench/compare_perftest.sh
#   VM_RDMA=siw VM_NETDEV=dummy tests/vm/run-in-vm.sh bench/compare_perftest.sh
# or on any host with an RDMA device: DEV=mlx5_0 ADDR=10.0.0.1 bench/compare_perftest.sh
#
# Environment: DEV, ADDR (default: COVERBS_VM_DEV / COVERBS_VM_ADDR_A),
# SIZES (default "64 4096 65536 1048576"), ITERS (1000), DEPTH (16),
# TESTS (default "send_bw write_bw read_bw send_lat"), BENCH (the
# coverbs_bench binary, default bazel-bin/bench/coverbs_bench), MODES
# (default "busy event": both pairings, each test and size run in each mode
# back to back; "busy" or "event" alone; POLL=busy|event is read as MODES
# when MODES is not set).
#
# Both tools run as two processes (server and client) connected by rdma_cm
# (perftest -R, needed on iWARP). Bandwidth: perftest's BW average vs
# coverbs_bench's BW (MB/s); latency: perftest's t_typical (median) vs
# coverbs_bench's p50, both half the round trip.
set -u
DEV=${DEV:-${COVERBS_VM_DEV:-}}
ADDR=${ADDR:-${COVERBS_VM_ADDR_A:-}}
SIZES=${SIZES:-"64 4096 65536 1048576"}
ITERS=${ITERS:-1000}
DEPTH=${DEPTH:-16}
TESTS=${TESTS:-"send_bw write_bw read_bw send_lat"}
BENCH=${BENCH:-bazel-bin/bench/coverbs_bench}
MODES=${MODES:-${POLL:-busy event}}
for mode in $MODES; do
  case $mode in
    busy | event) ;;
    *) echo "compare_perftest.sh: MODES takes busy and/or event, not '$mode'" >&2; exit 2 ;;
  esac
done
PORT=${PORT:-18515}
if [ -z "$DEV" ] || [ -z "$ADDR" ]; then
  echo "compare_perftest.sh: set DEV and ADDR (or run in the VM harness)" >&2
  exit 2
fi
[ -x "$BENCH" ] || { echo "compare_perftest.sh: no $BENCH (bazel build -c opt //bench:coverbs_bench)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; kill $(jobs -p) 2>/dev/null' EXIT

# Waits up to $2 seconds for server process $1 to exit, then kills it and
# says so on stderr: a server that hangs must not hang the whole comparison.
wait_server() {
  local pid=$1 secs=$2 what=$3
  for _ in $(seq 1 $((secs * 10))); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; return; }
    sleep 0.1
  done
  echo "compare_perftest.sh: $what server did not exit within ${secs}s; killed" >&2
  kill -9 "$pid" 2>/dev/null
  wait "$pid"
}

# perftest MODE TEST SIZE: prints "<value>" (MB/s, or usec for latency).
# Event mode adds -e (wait for a CQ event instead of busy-polling).
# ib_write_bw has no event mode ("Events feature not available on WRITE
# verb"): event write_bw prints "n/a" and coverbs runs alone.
perftest() {
  local mode=$1 test=$2 size=$3 tool extra=() col
  if [ "$mode" = event ] && [ "$test" = write_bw ]; then
    echo "n/a"
    return
  fi
  case $test in
    send_bw) tool=ib_send_bw; extra=(-t "$DEPTH"); col=4 ;;
    write_bw) tool=ib_write_bw; extra=(-t "$DEPTH"); col=4 ;;
    read_bw) tool=ib_read_bw; extra=(-t "$DEPTH"); col=4 ;;
    send_lat) tool=ib_send_lat; extra=(); col=5 ;;
  esac
  [ "$mode" = event ] && extra+=(-e)
  "$tool" -d "$DEV" -R -F -s "$size" -n "$ITERS" "${extra[@]}" -p "$PORT" \
    >"$tmp/ps.out" 2>&1 &
  local spid=$!
  sleep 1
  timeout 300 "$tool" -d "$DEV" -R -F -s "$size" -n "$ITERS" "${extra[@]}" -p "$PORT" "$ADDR" \
    >"$tmp/pc.out" 2>&1
  local rc=$?
  wait_server $spid 30 "perftest $tool -s $size ($mode)"
  if [ $rc -ne 0 ]; then
    echo "perftest $tool -s $size ($mode) failed:" >&2
    cat "$tmp/pc.out" "$tmp/ps.out" >&2
    echo "-"
    return
  fi
  # The result row starts with the size.
  awk -v s="$size" -v c="$col" '$1 == s && NF >= c { v = $c } END { print (v == "" ? "-" : v) }' \
    "$tmp/pc.out"
}

# coverbs_bench server + client, both with --poll=MODE:
# coverbs MODE TEST SIZE prints "<MB/s> <p50 us>".
coverbs() {
  local mode=$1 test=$2 size=$3
  "$BENCH" --server --address="$ADDR" --port=$((PORT + 2)) --poll="$mode" \
    >"$tmp/cs.out" 2>&1 &
  local spid=$!
  for _ in $(seq 1 50); do grep -q "cm port" "$tmp/cs.out" && break; sleep 0.1; done
  timeout 300 "$BENCH" --client="$ADDR" --port=$((PORT + 2)) --test="$test" --sizes="$size" \
    --iters="$ITERS" --depth="$DEPTH" --poll="$mode" --progress=off --json="$tmp/c.json" \
    >"$tmp/cc.out" 2>&1
  local rc=$?
  kill -TERM $spid
  wait_server $spid 30 "coverbs_bench $test $size ($mode)"
  if [ $rc -ne 0 ]; then
    echo "coverbs_bench $test $size ($mode) failed:" >&2
    cat "$tmp/cc.out" >&2
    echo "- -"
    return
  fi
  python3 -c "
import json; r = json.load(open('$tmp/c.json'))['results'][0]
print('%.2f %.2f' % (r['bw_mbps'], r['lat_us']['p50']))"
}

ratio() {
  python3 -c "
a, b = '$1', '$2'
try: print('%.2f' % (float(a) / float(b)))
except Exception: print('-')"
}

echo "# coverbs_bench vs perftest on $DEV ($ADDR): iters $ITERS, depth $DEPTH, modes $MODES" \
  "(busy: coverbs --poll=busy vs perftest; event: coverbs --poll=event vs perftest -e)"
echo "# $(uname -r), $(nproc) CPU(s), $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-5s %-9s %9s %14s %14s %8s  %s\n" mode test bytes perftest coverbs ratio unit
for test in $TESTS; do
  for size in $SIZES; do
    for mode in $MODES; do
      p=$(perftest "$mode" "$test" "$size")
      read -r c_bw c_lat <<<"$(coverbs "$mode" "$test" "$size")"
      if [ "$test" = send_lat ]; then
        c=$c_lat
        unit="usec p50 (lower is better; ratio = perftest/coverbs)"
        r=$(ratio "$p" "$c")
      else
        c=$c_bw
        unit="MB/s (ratio = coverbs/perftest)"
        r=$(ratio "$c" "$p")
      fi
      printf "%-5s %-9s %9s %14s %14s %8s  %s\n" "$mode" "$test" "$size" "$p" "$c" "$r" "$unit"
    done
  done
done
