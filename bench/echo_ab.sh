#!/bin/bash
# Echo calls/s of several builds side by side: for each build directory
# (holding echo_server and echo_client), a fresh server and client run
# every size in SIZES (one connection, DEPTH calls in flight, every byte
# verified); builds interleave, REPS rounds. Prints each run, then the mean
# per build and size and its ratio to the first build's.
#
#   bench/echo_ab.sh DIR_A DIR_B ...
#
# Environment: REPS [3], CALLS [20000], SIZES [64,4096,8160,8192],
# DEPTH [16], PROVIDER [soft], ADDR [127.0.0.1].
set -uo pipefail
source "$(dirname "$0")/echo_run.sh"
if [ $# -lt 1 ]; then sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
reps=${REPS:-3} calls=${CALLS:-20000} sizes=${SIZES:-64,4096,8160,8192}
depth=${DEPTH:-16} provider=${PROVIDER:-soft} addr=${ADDR:-127.0.0.1}
work=$(mktemp -d)
spid=""
trap '[ -n "$spid" ] && kill -9 $spid 2>/dev/null; rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg); $provider; sizes $sizes, $calls calls, depth $depth"
for rep in $(seq 1 "$reps"); do
  for d in "$@"; do
    echo_run "$d" "$sizes" "$work/cli.out"
    awk -v d="$d" -v r="$rep" '$1 ~ /^[0-9]+$/ && NF >= 9 {
      printf "%s rep %d  %7d B  %9.0f calls/s%s\n", d, r, $1, $5, ($3 != 0 ? "  ERRORS" : "") }' \
      "$work/cli.out" | tee -a "$work/all"
  done
done
echo "# end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
awk -v first="$1" '{ k = $1 SUBSEP $4; s[k] += $6; n[k]++; if (!($4 in seen)) { seen[$4]; order[++ns] = $4 }
                     if (!($1 in bs)) { bs[$1]; border[++nb] = $1 } }
  END { for (i = 1; i <= nb; i++) for (j = 1; j <= ns; j++) {
          b = border[i]; z = order[j]; m = s[b, z] / n[b, z]; f = s[first, z] / n[first, z]
          printf "mean %s %7d B  %9.0f calls/s  %.2fx %s\n", b, z, m, m / f, first } }' "$work/all"
