#!/bin/bash
# The rendezvous cliff of several builds side by side: for each build
# directory (holding echo_server and echo_client), one server and one client
# whose run alternates the largest eager size and the first landed size
# PAIRS times (CALLS calls each) on one connection, so that a load burst
# hits both sizes alike; builds interleave, REPS rounds. Prints calls/s per
# size (total calls / total time), the ratio and the landed call's extra
# time (1/landed - 1/eager calls/s, in us) for each run, then each build's
# means. The extra time is the landing path's own cost; the ratio also
# falls when only the eager call gets faster.
#
#   bench/cliff_ab.sh DIR_A DIR_B ...
#   (in the VM: PROVIDER=verbs ADDR='$COVERBS_VM_ADDR_A' tests/vm/run-in-vm.sh bench/cliff_ab.sh ...;
#    the directories must be under the work tree for the VM to see them)
#
# Environment: REPS [3], CALLS [5000], PAIRS [6], DEPTH [16],
# PROVIDER [soft], ADDR [127.0.0.1], EAGER [8160], LANDED [8192].
set -uo pipefail
source "$(dirname "$0")/echo_run.sh"
if [ $# -lt 1 ]; then sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
reps=${REPS:-3} calls=${CALLS:-5000} depth=${DEPTH:-16} pairs=${PAIRS:-6}
provider=${PROVIDER:-soft} addr=${ADDR:-127.0.0.1}
eager=${EAGER:-8160} landed=${LANDED:-8192}
sizes=$(for _ in $(seq 1 "$pairs"); do printf "%s,%s," "$eager" "$landed"; done)
sizes=${sizes%,}
work=$(mktemp -d)
spid=""
trap '[ -n "$spid" ] && kill -9 $spid 2>/dev/null; rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg); $provider; $pairs pairs x $calls calls, depth $depth"
for rep in $(seq 1 "$reps"); do
  for d in "$@"; do
    echo_run "$d" "$sizes" "$work/cli.out"
    awk -v d="$d" -v r="$rep" -v e="$eager" -v l="$landed" '
      $1 ~ /^[0-9]+$/ && NF >= 9 { if ($3 != 0) print "ERRORS"; n[$1] += $2; t[$1] += $4 }
      END { a = n[e] / t[e]; b = n[l] / t[l];
            printf "%s rep %d  %d %8.0f  %d %8.0f  ratio %.3f  extra %.2f us\n",
                   d, r, e, a, l, b, b / a, 1e6 / b - 1e6 / a }' \
      "$work/cli.out" | tee -a "$work/runs"
  done
done
awk '$2 == "rep" { n[$1]++; r[$1] += $9; x[$1] += $11 }
     END { for (d in n) printf "# %s: %d runs, mean ratio %.3f, mean extra %.2f us\n",
                                d, n[d], r[d] / n[d], x[d] / n[d] }' "$work/runs" | sort
echo "# end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
