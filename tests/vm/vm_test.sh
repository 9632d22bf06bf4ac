#!/bin/bash
# tests/vm/vm_test.sh <rxe|siw> <dummy|veth|wire> <binary> [args...]
#
# Runs a test binary inside the VM with a kernel soft-RDMA device, for use as a
# Bazel sh_test, e.g.
#   sh_test(name = "foo_rxe_test", srcs = ["//tests/vm:vm_test.sh"],
#           args = ["rxe", "dummy", "$(location :foo_test)"],
#           data = [":foo_test", "//tests/vm:harness"], tags = ["vm", "exclusive"])
# With tests/vm/suites.sh as the binary, one boot runs several suites
# (`suites.sh --suite <name> <binary> [args...] ...`; README.md).
# With netdev "wire" two guests boot on one virtual wire (run-in-vms.sh) and
# the binary runs in both, as server in one and client in the other
# (COVERBS_VM_ROLE); tests/vm/wire/ holds the scripts written for that.
# The binary sees COVERBS_PROVIDER=verbs plus the COVERBS_VM_* variables of
# vm-rdma-setup.sh (device, addresses), and GTEST_*/TEST_* from Bazel.
# $TEST_TMPDIR, $TEST_UNDECLARED_OUTPUTS_DIR and the test log dir (test.xml,
# premature-exit and shard-status files) are writable in the guest; the guest's
# console log and dmesg land in $TEST_UNDECLARED_OUTPUTS_DIR/vm/.
# Under TCG the tests repeat their loops a tenth as often
# (COVERBS_TEST_REPEAT_PERCENT=10 unless set; tests/README.md).
#
# Exit status:
#   0     the binary passed
#   77    SKIPPED-BUT-FAILED: the VM harness cannot run here (no qemu, no kernel,
#         tests/vm/setup.sh not run or stale). Nothing ran; the reason is printed.
#         Bazel shows this as a failure on purpose: a missing harness must not
#         look like a pass. Run tests/vm/setup.sh, or exclude the "vm" tag.
#   124   the VM timed out (VM_TIMEOUT, defaults to Bazel's TEST_TIMEOUT - 10 s)
#   125   the VM itself failed (did not boot, crashed, RDMA setup failed)
#   other the binary's own exit status
set -uo pipefail
HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)

usage() { echo "usage: vm_test.sh <rxe|siw> <dummy|veth|lo|wire> <binary> [args...]" >&2; exit 2; }
[ $# -ge 3 ] || usage
case $1 in rxe|siw) ;; *) usage ;; esac
case $2 in dummy|veth|lo|wire) ;; *) usage ;; esac
export VM_RDMA=$1 VM_NETDEV=$2
shift 2
[ -f "$1" ] || command -v "$1" >/dev/null || { echo "vm_test.sh: test binary '$1' not found (cwd $PWD)" >&2; exit 2; }

# Preflight separately so that 77 can only mean "harness unavailable", never
# the binary's own status.
if ! msg=$("$HERE/run-in-vm.sh" --check 2>&1); then
    echo "vm_test.sh: SKIPPED (reported as failure, exit 77): $msg" >&2
    exit 77
fi

export COVERBS_PROVIDER=verbs
# Emulation (TCG) runs 50-100x slower than the host: repeat each loop a
# tenth as often (same paths; tests/repeat.h has the floors). Under KVM, or
# when set (--test_env=COVERBS_TEST_REPEAT_PERCENT=100), the count is kept.
case $msg in
    *"-accel tcg"*) export COVERBS_TEST_REPEAT_PERCENT=${COVERBS_TEST_REPEAT_PERCENT:-10} ;;
esac
[ -n "${COVERBS_TEST_REPEAT_PERCENT:-}" ] &&
    echo "vm_test.sh: COVERBS_TEST_REPEAT_PERCENT=$COVERBS_TEST_REPEAT_PERCENT (percent of each repetition count run)"
RW=()
add_rw() { [ -n "${1:-}" ] && [ -d "$1" ] && RW+=("$1"); }
add_rw "${TEST_TMPDIR:-}"
add_rw "${TEST_UNDECLARED_OUTPUTS_DIR:-}"
for f in "${XML_OUTPUT_FILE:-}" "${TEST_PREMATURE_EXIT_FILE:-}" "${TEST_SHARD_STATUS_FILE:-}"; do
    [ -n "$f" ] && add_rw "$(dirname "$f")"
done
# Drop duplicates and dirs inside another one: one 9p mount each is enough.
if [ ${#RW[@]} -gt 0 ]; then
    mapfile -t RW < <(for d in "${RW[@]}"; do readlink -f "$d"; done | sort -u |
                      awk '{ for (p in keep) if (index($0 "/", p "/") == 1) next; keep[$0]; print }')
fi
export VM_RW="${VM_RW:-} ${RW[*]}"
# The guest sees the host's / except /tmp, /var/tmp, /run and /dev/shm (tmpfs
# there). A workspace or a Bazel output root under one of those (e.g.
# --output_user_root=/tmp/x) would leave the runfiles symlinks dangling in the
# guest: share read-only whatever they point to there. A target inside a
# Bazel output base (.../<hash>/execroot/..., also reached from a sandbox)
# shares that output base once; anything else its own directory.
masked() { case "$1/" in /tmp/*|/var/tmp/*|/run/*|/dev/shm/*) return 0 ;; esac; return 1; }
share_root() {  # the directory to share for masked path $1
    local p=$1
    case $p in
        */execroot/*) p=${p%%/execroot/*}
                      case $p in */sandbox/*) p=${p%%/sandbox/*} ;; esac ;;
        *) [ -d "$p" ] || p=$(dirname "$p") ;;
    esac
    echo "$p"
}
RO=()
add_ro() { masked "$1" && RO+=("$(share_root "$1")"); }
add_ro "$(cd "$HERE/../.." && pwd -P)"
add_ro "$(pwd -P)"
add_ro "$(readlink -f "$(command -v "$1" 2>/dev/null || echo "$1")")"
# Each symlink of the runfiles tree (Bazel's, or <binary>.runfiles by hand).
for tree in "${RUNFILES_DIR:-${TEST_SRCDIR:-}}" "$1.runfiles"; do
    [ -n "$tree" ] && [ -d "$tree" ] || continue
    while IFS= read -r -d '' target; do
        add_ro "$target"
    done < <(readlink -fz "$tree"
             find "$tree" -type l -print0 2>/dev/null | xargs -0 -r readlink -fz)
done
if [ ${#RO[@]} -gt 0 ]; then
    mapfile -t RO < <(printf '%s\n' "${RO[@]}" | sort -u |
                      awk '{ for (p in keep) if (index($0 "/", p "/") == 1) next; keep[$0]; print }')
fi
export VM_RO="${VM_RO:-} ${RO[*]}"
# XML_OUTPUT_FILE is what Bazel's GTEST_OUTPUT points at; pass it along.
export VM_ENV="${VM_ENV:-} XML_OUTPUT_FILE"
if [ -n "${TEST_UNDECLARED_OUTPUTS_DIR:-}" ] && [ -z "${VM_LOGDIR:-}" ]; then
    export VM_LOGDIR=$TEST_UNDECLARED_OUTPUTS_DIR/vm
fi
# Stop the VM ourselves before Bazel's timeout kills us: we then still print
# the kernel console tail.
if [ -z "${VM_TIMEOUT:-}" ] && [ -n "${TEST_TIMEOUT:-}" ] && [ "$TEST_TIMEOUT" -gt 30 ]; then
    export VM_TIMEOUT=$((TEST_TIMEOUT - 10))
fi

[ "$VM_NETDEV" = wire ] && exec "$HERE/run-in-vms.sh" "$@"
exec "$HERE/run-in-vm.sh" "$@"
