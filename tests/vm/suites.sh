#!/bin/bash
# tests/vm/suites.sh --suite <name> <command> [args...] [--suite <name> <command> [args...]]...
#
# Runs several test suites one after another, for one VM boot to serve them
# all: vm_test.sh runs this script in the guest in place of a single test
# binary, e.g.
#   vm_test.sh rxe dummy tests/vm/suites.sh \
#       --suite conformance bazel-bin/tests/transport/conformance_test \
#       --suite kv examples/kv_test.sh bazel-bin/examples/kv_server bazel-bin/examples/kv_client
# A boot with its RDMA setup and power-off costs ~17 s of host time under
# TCG, more than many suites take to run (README.md, "How the targets are
# grouped").
#
# Each suite runs as if it had the VM to itself:
#   - its own TEST_TMPDIR, $TEST_TMPDIR/<name> (the scripts keep fixed names
#     such as port files there);
#   - its own gtest XML report, GTEST_OUTPUT=xml:$TEST_UNDECLARED_OUTPUTS_DIR/<name>.xml,
#     with XML_OUTPUT_FILE unset: the suites would otherwise overwrite each
#     other's report at Bazel's test.xml. Nothing writes test.xml then, and
#     Bazel writes one from this script's exit status;
#   - in its own session (setsid): processes it leaves behind are killed
#     before the next suite starts, and named.
# Everything else (COVERBS_*, the RDMA variables, GTEST_* sharding, cwd) is
# what vm_test.sh gives a single suite. A suite's command cannot take
# "--suite" as an argument.
#
# Every suite runs, also after one failed, so that one run shows every
# failing suite. Each prints a banner when it starts and one with its exit
# status and duration when it ends; a summary follows the last.
# Exit status: 0 if every suite passed, else the first failing suite's
# status; 2 on a usage error.
set -uo pipefail

usage() { echo "suites.sh: $*" >&2; echo "usage: suites.sh --suite <name> <command> [args...] [--suite ...]..." >&2; exit 2; }

# The suites, flattened: NAMES[i], and ARGS[FIRST[i]] .. ARGS[FIRST[i] + COUNT[i] - 1].
NAMES=() FIRST=() COUNT=() ARGS=()
while [ $# -gt 0 ]; do
    [ "$1" = --suite ] || usage "expected --suite, got '$1'"
    if [ $# -lt 3 ] || [ "$3" = --suite ]; then usage "suite '${2:-}' has no command"; fi
    case $2 in
        '' | *[!A-Za-z0-9_.-]*) usage "suite name '$2' is not [A-Za-z0-9_.-]+" ;;
    esac
    for n in "${NAMES[@]}"; do [ "$n" != "$2" ] || usage "suite '$2' given twice"; done
    NAMES+=("$2") FIRST+=(${#ARGS[@]})
    shift 2
    n=0
    while [ $# -gt 0 ] && [ "$1" != --suite ]; do ARGS+=("$1"); n=$((n + 1)); shift; done
    COUNT+=("$n")
done
[ ${#NAMES[@]} -gt 0 ] || usage "no suite given"

# REPLY: seconds with a tenth between two $EPOCHREALTIME readings. Builtins
# only: a process costs 60-100 ms under TCG.
seconds() {
    local a=${1/./} b=${2/./}
    local d=$(((10#$b - 10#$a + 50000) / 100000))
    REPLY=$((d / 10)).$((d % 10))
}

TMP_ROOT=${TEST_TMPDIR:-}
XML_DIR=${TEST_UNDECLARED_OUTPUTS_DIR:-}
total=${#NAMES[@]} rc=0 failed=() summary=()
t_all=$EPOCHREALTIME
for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]}
    cmd=("${ARGS[@]:${FIRST[$i]}:${COUNT[$i]}}")
    echo "==== suite $name ($((i + 1))/$total) start: ${cmd[*]}"
    t0=$EPOCHREALTIME
    (
        unset XML_OUTPUT_FILE
        if [ -n "$TMP_ROOT" ]; then
            export TEST_TMPDIR=$TMP_ROOT/$name
            mkdir -p "$TEST_TMPDIR" || exit 125
        fi
        [ -z "$XML_DIR" ] || export GTEST_OUTPUT=xml:$XML_DIR/$name.xml
        exec setsid "${cmd[@]}" < /dev/null
    ) &
    pid=$!
    wait $pid
    status=$?
    t1=$EPOCHREALTIME
    # setsid made the suite's first process its session's leader; what is
    # left in that process group now is left over.
    if kill -0 -- -$pid 2>/dev/null; then
        echo "==== suite $name left processes behind; killing them"
        kill -KILL -- -$pid 2>/dev/null
    fi
    seconds "$t0" "$t1"
    took=$REPLY
    if [ $status -eq 0 ]; then
        word=PASSED
    else
        word=FAILED failed+=("$name")
        [ $rc -ne 0 ] || rc=$status
    fi
    echo "==== suite $name ($((i + 1))/$total) $word: exit $status after ${took}s"
    printf -v line '  %-16s %-6s exit %3d %7ss' "$name" "$word" "$status" "$took"
    summary+=("$line")
done
seconds "$t_all" "$EPOCHREALTIME"
echo "==== suites: $((total - ${#failed[@]})) of $total passed in ${REPLY}s${failed:+; failed: ${failed[*]}}"
printf '%s\n' "${summary[@]}"
exit $rc
