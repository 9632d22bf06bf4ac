# tests/vm/wire/lib.sh: sourced by the two-guest tests (run-in-vms.sh runs
# one script in both guests; COVERBS_VM_ROLE says which side it is).
#
# The guests meet in COVERBS_VM_SHARED, a host directory both mount, in a
# folder named after the script (several scripts can share one boot of the
# pair, one after another: tests/vm/suites.sh in both guests):
#   put NAME [VALUE]   publish NAME (atomically: the peer never sees half)
#   await NAME SECS    wait for the peer's NAME; fails at once when the
#                      peer's guest ended (run-in-vms.sh writes
#                      server-exited / client-exited), and after SECS
#   got NAME           the value the peer put
# The client's script puts "done" when it exits, however it exits.
# And the helpers every script needs:
#   repeat FULL FLOOR  a repetition count scaled by COVERBS_TEST_REPEAT_PERCENT
#                      (10 % under TCG), never below FLOOR
#   serve PORTFILE CMD...  start a server in the background, wait for the
#                      port it writes to PORTFILE (its pid in SERVER_PID,
#                      and added to SERVER_PIDS)
#   serve_until_client_exits [SECS]  wait for the client's "done", then stop
#                      every server with SIGTERM (they drain); fails if one
#                      did not exit 0
#   fail MSG           print, with the tails of the logs in LOGS, and exit 1
#   now_ms             the guest's clock in ms (for durations within a guest)
# The server's address is SERVER (10.20.0.1, name coverbs-vm-a); each side's
# files go under TMP ($TEST_TMPDIR/<role>: both guests share TEST_TMPDIR).
WIRE_DIR=${COVERBS_VM_SHARED:?run by tests/vm/run-in-vms.sh (COVERBS_VM_SHARED unset)}
SHARED=$WIRE_DIR/$(basename "$0" .sh)
mkdir -p "$SHARED"
ROLE=${COVERBS_VM_ROLE:?run by tests/vm/run-in-vms.sh (COVERBS_VM_ROLE unset)}
SERVER=${COVERBS_VM_ADDR_A:?no wire set up (COVERBS_VM_ADDR_A unset)}
TMP=${TEST_TMPDIR:-/tmp}/$ROLE
mkdir -p "$TMP"
LOGS=()
SERVER_PID=
SERVER_PIDS=()

fail() {
  echo "FAIL ($ROLE): $*"
  local f p
  for f in "${LOGS[@]}"; do
    [ -f "$f" ] && { echo "--- $f (last 30 lines)"; tail -30 "$f"; }
  done
  for p in "${SERVER_PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  exit 1
}
put() {
  printf '%s\n' "${2:-}" >"$SHARED/.$1.tmp" && mv "$SHARED/.$1.tmp" "$SHARED/$1"
}
got() { cat "$SHARED/$1"; }
await() {
  local i
  for ((i = 0; i < $2 * 5; i++)); do
    [ -e "$SHARED/$1" ] && return 0
    [ "$ROLE" = client ] && [ -e "$WIRE_DIR/server-exited" ] &&
      fail "the server's guest ended before it put '$1'"
    [ "$ROLE" = server ] && [ -e "$WIRE_DIR/client-exited" ] &&
      fail "the client's guest ended before it put '$1'"
    sleep 0.2
  done
  fail "the peer did not put '$1' within $2 s"
}
percent=${COVERBS_TEST_REPEAT_PERCENT:-100}
[[ "$percent" =~ ^[1-9][0-9]{0,4}$ ]] || fail "COVERBS_TEST_REPEAT_PERCENT=$percent is not a percentage"
repeat() {
  local n=$(($1 * percent / 100))
  echo $((n < $2 ? $2 : n))
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
serve() {
  local portfile=$1 i
  shift
  rm -f "$portfile"
  "$@" &
  SERVER_PID=$!
  SERVER_PIDS+=("$SERVER_PID")
  for ((i = 0; i < 600; i++)); do
    [ -s "$portfile" ] && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || fail "$1 exited before listening"
    sleep 0.1
  done
  fail "$1 did not listen within 60 s"
}
[ "$ROLE" = client ] && trap 'put done $?' EXIT
serve_until_client_exits() {
  await done "${1:-600}"
  local p rc=0
  for p in "${SERVER_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${SERVER_PIDS[@]}"; do
    wait "$p" || { rc=$?; echo "$ROLE: server pid $p exited $rc"; }
  done
  SERVER_PIDS=()
  return $rc
}
