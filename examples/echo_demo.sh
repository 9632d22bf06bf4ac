#!/bin/bash
# The main job: starts echo_server on a free port, runs echo_client against
# it (two processes, the provider picked by --provider / auto on both) and
# stops the server. Arguments are passed to echo_client; with none, a size
# sweep is run.
#
#   bazel run -c opt //examples:echo_demo
#   bazel run -c opt //examples:echo_demo -- --sizes=64,1048576 --calls=5000
#
# Environment: ECHO_ADDRESS (default 127.0.0.1; in the soft-RDMA VM the
# rxe/siw netdev's address), ECHO_SERVER_FLAGS (extra echo_server flags).
set -u
here="$(dirname "$0")"
find_bin() {
  for c in "$here/$1" "$here/examples/$1" "examples/$1"; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  echo "echo_demo: cannot find $1 next to $0" >&2
  exit 2
}
server="${ECHO_SERVER_BIN:-$(find_bin echo_server)}"
client="${ECHO_CLIENT_BIN:-$(find_bin echo_client)}"
addr="${ECHO_ADDRESS:-${COVERBS_VM_ADDR_A:-127.0.0.1}}"
if [ $# -eq 0 ]; then
  set -- --sizes=0,64,4096,65536,1048576 --calls=2000 --concurrency=16
fi

dir="$(mktemp -d)"
pid=""
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

# shellcheck disable=SC2086
"$server" --address="$addr" --port=0 --port_file="$dir/port" ${ECHO_SERVER_FLAGS:-} &
pid=$!
for _ in $(seq 1 300); do
  [ -s "$dir/port" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "echo_demo: echo_server exited before listening" >&2
    exit 1
  fi
  sleep 0.1
done
if [ ! -s "$dir/port" ]; then
  echo "echo_demo: echo_server did not listen within 30 s" >&2
  exit 1
fi

"$client" --server="$addr" --port="$(cat "$dir/port")" "$@"
rc=$?
kill -TERM "$pid"
wait "$pid"
src=$?
pid=""
if [ $rc -ne 0 ]; then exit $rc; fi
exit $src
