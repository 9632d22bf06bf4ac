#!/bin/bash
# coverbs as a dependency of another Bazel workspace, as README.md
# ("Building your own code against coverbs") tells a user to set it up: a
# fresh workspace outside this checkout gets the WORKSPACE lines and
# .bazelrc lines from the README, builds the guide's echo server and client
# and kv_typed's server and client against @coverbs, and runs them (one
# typed call must come back; every kv_typed value must match). Run by
# .ci/run; not a Bazel test (it runs Bazel itself).
#   tests/outoftree/run.sh [WORKDIR]
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
# A fixed place by default: Bazel keys its output base by the workspace's
# path, so one place keeps one output base (no new one per run).
work="${1:-${TMPDIR:-/tmp}/coverbs-outoftree}"
rm -rf "$work/app"
mkdir -p "$work/app"
cd "$work/app"

# The README's lines, with the checkout's path.
sed -n '/^# BEGIN coverbs WORKSPACE/,/^# END coverbs WORKSPACE/p' "$src/README.md" |
  sed "s|/path/to/coverbs|$src|g" | grep -v '^# \(BEGIN\|END\)' >WORKSPACE
sed -n '/^# BEGIN coverbs bazelrc/,/^# END coverbs bazelrc/p' "$src/README.md" |
  grep -v '^# \(BEGIN\|END\)' >.bazelrc
[[ -s WORKSPACE && -s .bazelrc ]] || { echo "outoftree: README has no WORKSPACE/.bazelrc block" >&2; exit 1; }
# CI's disk cache and fixed action environment, when it set them.
[[ -f "$src/user.bazelrc" ]] && cp "$src/user.bazelrc" user.bazelrc && echo 'try-import %workspace%/user.bazelrc' >>.bazelrc
cp "$src/examples/guide_echo_server.cc" "$src/examples/guide_echo_client.cc" .
# kv_typed as well (issue #37): its header where its sources include it.
mkdir -p examples
cp "$src/examples/kv_typed.h" examples/
cp "$src/examples/kv_typed_server.cc" "$src/examples/kv_typed_client.cc" .
cat >BUILD <<'B'
cc_binary(
    name = "server",
    srcs = ["guide_echo_server.cc"],
    deps = ["@coverbs//coverbs"],
)

cc_binary(
    name = "client",
    srcs = ["guide_echo_client.cc"],
    deps = ["@coverbs//coverbs"],
)
cc_library(
    name = "kv_typed",
    hdrs = ["examples/kv_typed.h"],
    deps = ["@coverbs//coverbs"],
)
cc_binary(
    name = "kv_server",
    srcs = ["kv_typed_server.cc"],
    deps = [
        ":kv_typed",
        "@coverbs//coverbs",
        "@coverbs//coverbs:metrics",
        "@system//:absl_flags",
    ],
)
cc_binary(
    name = "kv_client",
    srcs = ["kv_typed_client.cc"],
    deps = [
        ":kv_typed",
        "@coverbs//coverbs",
        "@system//:absl_flags",
        "@system//:absl_strings",
    ],
)
B
status=0
bazel build //:server //:client //:kv_server //:kv_client || status=$?
if ((status == 0)); then
  port=$((20000 + RANDOM % 30000))
  COVERBS_PROVIDER=soft bazel-bin/server "$port" >server.log 2>&1 &
  server=$!
  out=""
  for _ in $(seq 100); do
    out=$(COVERBS_PROVIDER=soft timeout 20 bazel-bin/client "$port" 2>client.log) && break
    sleep 0.1
  done
  kill -TERM "$server"
  wait "$server" || true
  if [[ "$out" != hello ]]; then
    echo "outoftree: the client got '$out'" >&2
    cat client.log server.log >&2
    status=1
  else
    echo "outoftree: built against @coverbs from $work/app and echoed"
  fi
fi
if ((status == 0)); then
  # kv_typed: the client on a ClientPool, its snapshot READ through a lease.
  port=$((20000 + RANDOM % 30000))
  mport=$((port + 1))
  COVERBS_PROVIDER=soft bazel-bin/kv_server --port="$port" --threads=2 \
    --metrics_port="$mport" >kv_server.log 2>&1 &
  server=$!
  ok=""
  for _ in $(seq 100); do
    if COVERBS_PROVIDER=soft timeout 60 bazel-bin/kv_client --port="$port" \
      --keys=200 >kv_client.out 2>&1; then
      ok=1
      break
    fi
    sleep 0.1
  done
  kill -TERM "$server"
  wait "$server" || true
  if [[ -z "$ok" ]] || ! grep -q "200 key(s); 0 mismatch(es)" kv_client.out; then
    echo "outoftree: kv_typed_client failed" >&2
    cat kv_client.out kv_server.log >&2
    status=1
  else
    echo "outoftree: kv_typed built against @coverbs and served: $(tail -1 kv_client.out)"
  fi
fi
bazel shutdown
exit $status
