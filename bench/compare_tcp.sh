#!/bin/bash
# coverbs_bench send_bw on the soft provider against a raw TCP pump with the
# same sizes, iterations and process layout (one process, loopback TCP),
# back to back. Prints the ratio coverbs/TCP per size.
#   bazel build -c opt //bench:coverbs_bench //bench:tcp_pump
#   bench/compare_tcp.sh
# Environment: SIZES (default "4096 65536 1048576 4194304"), ITERS (2000),
# DEPTH (16), POLL (event), REPEAT (3: the best of REPEAT runs of each, since
# these machines are shared and noisy).
set -u
SIZES=${SIZES:-"4096 65536 1048576 4194304"}
ITERS=${ITERS:-2000}
DEPTH=${DEPTH:-16}
POLL=${POLL:-event}
REPEAT=${REPEAT:-3}
BIN=${BIN:-bazel-bin/bench}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
best() { sort -g | tail -1; }
echo "# coverbs_bench send_bw (soft, loopback) vs raw TCP pump: iters $ITERS, depth $DEPTH, poll $POLL, best of $REPEAT"
echo "# $(uname -r), $(nproc) CPU(s), $(date -u +%Y-%m-%dT%H:%MZ)"
printf "%10s %12s %12s %8s\n" bytes tcp_MB/s coverbs_MB/s ratio
for size in $SIZES; do
  tcp=$(for _ in $(seq "$REPEAT"); do
          "$BIN/tcp_pump" --sizes="$size" --iters="$ITERS" | awk 'NR == 2 { print $3 }'
        done | best)
  cov=$(for _ in $(seq "$REPEAT"); do
          COVERBS_PROVIDER=soft "$BIN/coverbs_bench" --loopback --provider=soft --test=send_bw \
            --sizes="$size" --iters="$ITERS" --depth="$DEPTH" --poll="$POLL" --progress=off \
            --json="$tmp/r.json" >/dev/null 2>&1 &&
          python3 -c "import json; print(json.load(open('$tmp/r.json'))['results'][0]['bw_mbps'])"
        done | best)
  printf "%10s %12.2f %12.2f %8s\n" "$size" "${tcp:-0}" "${cov:-0}" \
    "$(python3 -c "print('%.2f' % ($cov / $tcp))" 2>/dev/null || echo -)"
done
