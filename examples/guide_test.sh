#!/bin/bash
# The "writing a service" guide's programs (README.md): they build, they do
# what the guide says, and they stay as short as the guide promises --
#   guide_read.cc: the server and the client (an echo, then an RDMA Read of
#     a region the server exposed) in at most 30 lines;
#   guide_echo_server.cc + guide_echo_client.cc: an echo RPC pair in at most
#     25 lines.
# Lines are counted without blank lines and comments.
# Usage: guide_test.sh GUIDE_READ ECHO_SERVER ECHO_CLIENT SRC_DIR
set -euo pipefail
read_bin=$1
server_bin=$2
client_bin=$3
src=$4
fail() { echo "FAIL: $*" >&2; exit 1; }

code_lines() { grep -cvE '^\s*$|^\s*//' "$@" | awk -F: '{ s += $NF } END { print s }'; }
fn_lines() {  # FILE FUNCTION-NAME: lines of that top-level function
  awk -v f="$2" '$0 ~ "^Task<absl::Status> " f "\\(" { on = 1 } on { print } on && /^}/ { on = 0 }' "$1" |
    grep -cvE '^\s*$|^\s*//'
}

n_srv=$(fn_lines "$src/guide_read.cc" Server)
n_cli=$(fn_lines "$src/guide_read.cc" Client)
echo "guide_read.cc: Server $n_srv + Client $n_cli lines; file $(code_lines "$src/guide_read.cc")"
[ "$n_srv" -gt 3 ] && [ "$n_cli" -gt 3 ] || fail "could not find Server/Client in guide_read.cc"
[ $((n_srv + n_cli)) -le 30 ] || fail "server + client take $((n_srv + n_cli)) lines (> 30)"
n_pair=$(code_lines "$src/guide_echo_server.cc" "$src/guide_echo_client.cc")
echo "echo pair: $n_pair lines"
[ "$n_pair" -le 25 ] || fail "the echo RPC pair takes $n_pair lines (> 25)"

out=$(timeout 60 "$read_bin" 2>&1) || fail "guide_read exited non-zero: $out"
echo "$out"
grep -qx "echo: hello, read: bytes the client reads by RDMA" <<<"$out" ||
  fail "guide_read printed something else"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$server_bin" "$port" >"$TEST_TMPDIR/server.log" 2>&1 &
spid=$!
trap 'kill -9 $spid 2>/dev/null || true' EXIT
reply=""
for _ in $(seq 1 100); do
  if reply=$(timeout 20 "$client_bin" "$port" 2>"$TEST_TMPDIR/client.log"); then break; fi
  reply=""
  sleep 0.1
done
[ "$reply" = "hello" ] || { cat "$TEST_TMPDIR"/*.log >&2; fail "echo client got '$reply'"; }
echo "echo pair: $reply"
kill -TERM $spid
wait $spid || { cat "$TEST_TMPDIR/server.log" >&2; fail "server did not exit 0 on SIGTERM"; }
trap - EXIT
echo PASS
