#!/bin/bash
# Per-call counts behind the rendezvous cliff, in the VM: for each build
# directory (echo_server + echo_client) and each size (EAGER, LANDED), one
# server and one client doing N calls of that size, with the RDMA device's
# hw_counters before and after (packets, SENDs; on a loopback link both ends
# count into one set), and then the same under `strace -c -f` (NST calls:
# ptrace under TCG is very slow) for the syscalls of each process.
#
#   VM_RDMA=rxe VM_NETDEV=dummy tests/vm/run-in-vm.sh bench/cliff_counts.sh DIR_A DIR_B ...
#
# Environment: N [3000], NST [300], MODES ["plain strace"], EAGER [8160],
# LANDED [8192], DEPTH [16]. Needs $COVERBS_VM_ADDR_A (the VM harness).
set -uo pipefail
if [ $# -lt 1 ]; then sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
A=${COVERBS_VM_ADDR_A:?run in the VM harness}
DEV=$(ls /sys/class/infiniband | head -1)
HC=/sys/class/infiniband/$DEV/ports/1/hw_counters
N=${N:-3000} depth=${DEPTH:-16}
work=$(mktemp -d)
spid=""
trap '[ -n "$spid" ] && kill -9 $spid 2>/dev/null; rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) dev $DEV load $(cut -d' ' -f1-3 /proc/loadavg) N=$N"
ibv_devinfo -d "$DEV" -v 2>/dev/null | grep -E "active_mtu" | head -1
snap() { for f in "$HC"/*; do printf "%s %s\n" "$(basename "$f")" "$(cat "$f")"; done; }
for d in "$@"; do
  for S in "${EAGER:-8160}" "${LANDED:-8192}"; do
    for mode in ${MODES:-plain strace}; do
      n=$N SP="" CP=""
      if [ "$mode" = strace ]; then
        n=${NST:-300}
        SP="timeout 200 strace -c -f -o $work/srv.st"
        CP="timeout 150 strace -c -f -o $work/cli.st"
      fi
      rm -f "$work/port"
      $SP "$d/echo_server" --address="$A" --port=0 --port_file="$work/port" --threads=1 \
        --provider=verbs >"$work/srv.log" 2>&1 &
      spid=$!
      for _ in $(seq 1 400); do [ -s "$work/port" ] && break; sleep 0.05; done
      snap >"$work/c0"
      $CP "$d/echo_client" --server="$A" --port="$(cat "$work/port")" --provider=verbs \
        --sizes="$S" --calls="$n" --concurrency="$depth" >"$work/cli.out" 2>&1
      snap >"$work/c1"
      kill -TERM $spid; wait $spid 2>/dev/null; spid=""
      echo "== $d size $S $mode ($n calls)"
      grep -E "^ *[0-9]+ " "$work/cli.out" | head -3
      join "$work/c0" "$work/c1" | awk -v n="$n" '{ d = $3 - $2;
        if (d) printf "  %-22s %10d  %.3f/call\n", $1, d, d / n }'
      if [ "$mode" = strace ]; then
        for w in srv cli; do
          echo " -- $w syscalls"
          awk -v n="$n" 'NR > 2 && $4 ~ /^[0-9]+$/ && $NF != "total" {
            printf "  %-16s %8d %.3f/call\n", $NF, $4, $4 / n }' "$work/$w.st" |
            sort -k2 -nr | head -8
        done
      fi
    done
  done
done
