#!/bin/bash
# Exposures and landing grants stay with their connection across two
# kernels (tests/vm/run-in-vms.sh; tests/hostile/scope_test.sh is the
# one-kernel version with the full list of what is asserted): scope_server
# in one guest; in the other a victim scope_client gets its token and
# grants and leaks them to a file, and an attacker scope_client (another
# process, its own connections) uses them, guesses keys and uses its tokens
# after close and Revoke. Every attack must fail on the attacker's own
# connection, the victim's bytes and connection stay intact, and the
# server's check of every region it made finds 0 changed bytes. On siw
# (no memory windows) Expose refuses and the token attacks are skipped
# with that reason, as on one kernel.
#   scope_wire_test.sh <scope_server> <scope_client>
set -u
. "$(dirname "$0")/lib.sh"
server_bin=$1 client_bin=$2

if [ "$ROLE" = server ]; then
  log="$TMP/server.log"
  LOGS=("$log")
  serve "$TMP/port" "$server_bin" --provider=verbs --address="$SERVER" --port=0 \
    --port_file="$TMP/port" >"$log" 2>&1
  put port "$(cat "$TMP/port")"
  await done 600
  grep -q "check: [0-9]* region(s), 0 mismatch(es)" "$log" || fail "no clean check in the server's log"
  # Every connection the clients opened has ended here too.
  line=
  for _ in $(seq 50); do
    kill -USR1 "$SERVER_PID"
    sleep 0.2
    line=$(grep "served .* call(s) on" "$log" | tail -1)
    [[ "$line" == *"(0 open,"* ]] && break
  done
  echo "server: $line"
  [[ "$line" == *"(0 open,"* ]] || fail "connections still open on the server"
  serve_until_client_exits 1 || fail "scope_server did not exit 0"
  exit 0
fi

LOGS=("$TMP/victim.out" "$TMP/attacker.out")
await port 120
port=$(got port)
client() {
  timeout "$1" "$client_bin" --provider=verbs --server="$SERVER" --port="$port" "${@:2}"
}
client 300 --mode=victim --victim_file="$TMP/leak" --go_file="$TMP/go" >"$TMP/victim.out" 2>&1 &
victim=$!
for _ in $(seq 600); do
  [[ -s "$TMP/leak" ]] && break
  kill -0 "$victim" 2>/dev/null || break
  sleep 0.1
done
[[ -s "$TMP/leak" ]] || fail "the victim wrote no victim file"
sed 's/^/  /' "$TMP/victim.out"
client 300 --mode=attacker --victim_file="$TMP/leak" --wire_guesses=12 >"$TMP/attacker.out" 2>&1
rc=$?
sed 's/^/  /' "$TMP/attacker.out"
((rc == 0)) || fail "the attacker exited $rc: an attack did not fail as it must"
touch "$TMP/go"
wait "$victim"
rc=$?
((rc == 0)) || fail "the victim exited $rc: its data or connection suffered"
grep -q "^victim: intact" "$TMP/victim.out" || fail "the victim did not report itself intact"
client 60 --mode=check >"$TMP/check.out" 2>&1 || { cat "$TMP/check.out"; fail "the server's regions changed"; }
sed 's/^/  /' "$TMP/check.out"
if grep -q "memory windows: no" "$TMP/attacker.out"; then
  grep -q "^attacker: skip (a)" "$TMP/attacker.out" ||
    fail "the attacker did not say why it skipped the token attacks"
fi
echo "PASS ($(grep -c "^attacker: ok" "$TMP/attacker.out") attacker checks passed across the wire)"
