#!/bin/bash
# tests/vm/smoke/run-matrix.sh [OUTDIR]
#
# Builds verbs_smoke with plain g++ and runs it in the VM on every provider x
# netdev combination (one boot each), printing one summary line per run.
# Exit status: the number of failed combinations (77 if the harness is unavailable).
# Env: MATRIX="rxe/dummy rxe/veth siw/dummy siw/veth" to choose combinations;
#      run-in-vm.sh's VM_* knobs apply.
set -uo pipefail
HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
VM=$HERE/../run-in-vm.sh

"$VM" --check >/dev/null || exit 77
OUT=${1:-$(mktemp -d "${TMPDIR:-/tmp}/verbs-smoke.XXXXXX")}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd -P)
g++ -std=c++20 -O2 -Wall -Wextra "$HERE/verbs_smoke.cc" -o "$OUT/verbs_smoke" -libverbs -lrdmacm -pthread ||
    { echo "run-matrix: building verbs_smoke failed" >&2; exit 1; }
# run-in-vm.sh shares the cwd with the guest when it lies under /tmp & co.
cd "$OUT" || exit 1

fails=0
for combo in ${MATRIX:-rxe/dummy rxe/veth siw/dummy siw/veth}; do
    log=$OUT/${combo/\//-}.log
    VM_RDMA=${combo%/*} VM_NETDEV=${combo#*/} "$VM" ./verbs_smoke > "$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || fails=$((fails + 1))
    # verbs_smoke's last line carries its own elapsed time; run-in-vm.sh's its timings.
    smoke=$(grep -oE '^\[ *[0-9.]+ ms\] verbs_smoke: OK' "$log" | grep -oE '[0-9.]+ ms')
    vm=$(grep -E '^run-in-vm: exit' "$log" | sed 's/^run-in-vm: //')
    printf '%-10s rc=%-3s smoke=%-9s %s  (log %s)\n' "$combo" "$rc" "${smoke:-n/a}" "$vm" "$log"
done
exit $fails
