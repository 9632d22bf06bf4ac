#!/bin/bash
# interleaved base/now echo at 8160 and 8192 alternating on one connection (verbs)
A=$COVERBS_VM_ADDR_A
reps=${REPS:-3}; calls=${CALLS:-2000}; pairs=${PAIRS:-4}
sizes=$(for i in $(seq 1 $pairs); do printf "8160,8192,"; done); sizes=${sizes%,}
work=$(mktemp -d)
for rep in $(seq 1 $reps); do for d in abbin/base abbin/now; do
  rm -f $work/port
  $d/echo_server --address=$A --port=0 --port_file=$work/port --threads=1 --provider=verbs >$work/srv.log 2>&1 & spid=$!
  for _ in $(seq 1 200); do [ -s $work/port ] && break; sleep 0.05; done
  timeout 300 $d/echo_client --server=$A --port=$(cat $work/port) --provider=verbs --sizes=$sizes --calls=$calls --concurrency=16 >$work/cli.out 2>&1 || tail -3 $work/cli.out
  kill -TERM $spid; wait $spid 2>/dev/null
  awk -v d=$d -v r=$rep '$1 ~ /^[0-9]+$/ && NF >= 9 { if ($3 != 0) print "ERRORS"; n[$1]+=$2; t[$1]+=$4 } END { a=n[8160]/t[8160]; b=n[8192]/t[8192]; printf "%s rep %d  8160 %8.0f  8192 %8.0f  ratio %.3f\n", d, r, a, b, b/a }' $work/cli.out
done; done
