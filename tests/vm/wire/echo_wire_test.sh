#!/bin/bash
# The echo example across two kernels (tests/vm/run-in-vms.sh): echo_server
# in one guest, echo_client in the other, rxe or siw on each guest's NIC,
# one virtual Ethernet wire between them. The client verifies every echoed
# byte; rows must show 0 errors. Reached five ways: the IPv4 address, the
# server's host name (the guests' /etc/hosts), its IPv6 address, its IPv6
# link-local address (fe80::...%<nic>), and 256 calls in flight over two
# connections. Its BUILD target gives the server's NIC an MTU of 9000 and
# the client's 1500 (VM_WIRE_MTU_A): rxe's ports report 4096 and 1024
# active MTU, and every echo must still pass both ways.
#   echo_wire_test.sh <echo_server> <echo_client>
set -u
. "$(dirname "$0")/lib.sh"
server_bin=$1 client_bin=$2

if [ "$ROLE" = server ]; then
  LOGS=("$TMP/server.log" "$TMP/server6.log")
  echo "server: NIC MTU $(cat "/sys/class/net/$COVERBS_VM_NETIF/mtu")"
  # One server per family: siw (6.1) resets an IPv4 client of a "::"
  # listener (tests/cm/names_test.cc); IPv6 clients of "::" are fine.
  serve "$TMP/port" "$server_bin" --address="$SERVER" --port=0 --port_file="$TMP/port" \
    >"$TMP/server.log" 2>&1
  serve "$TMP/port6" "$server_bin" --address=:: --port=0 \
    --port_file="$TMP/port6" >"$TMP/server6.log" 2>&1
  put port "$(cat "$TMP/port") $(cat "$TMP/port6")"
  serve_until_client_exits || fail "an echo_server did not exit 0"
  want=$(got served 2>/dev/null) || fail "the client did not say how many calls it made"
  read -r v4 v6 <<<"$want"; set -- "$v4" "$v6"
  grep -q "served $1 call(s)" "$TMP/server.log" || fail "the IPv4 server did not report $1 calls"
  grep -q "served $2 call(s)" "$TMP/server6.log" || fail "the IPv6 server did not report $2 calls"
  echo "server: served $1 calls over IPv4, $2 over IPv6"
  exit 0
fi

LOGS=("$TMP/out")
echo "client: NIC MTU $(cat "/sys/class/net/$COVERBS_VM_NETIF/mtu")"
await port 120
read -r port port6 <"$SHARED/port"
calls=$(repeat 24 4)
total=0
run() {  # what, then echo_client flags
  local what=$1
  shift
  "$client_bin" "$@" >"$TMP/out" 2>&1 || fail "$what: echo_client exited $?"
  sed "s/^/  $what: /" "$TMP/out" | grep -E "^  $what: +[0-9]+ " || true
}
sizes=0,1,8159,8160,8161,65536,1048576,4194304
run ipv4 --server="$SERVER" --port="$port" --sizes=$sizes --calls="$calls" --concurrency=4
for size in ${sizes//,/ }; do
  grep -Eq "^ +$size +$calls +0 " "$TMP/out" || fail "ipv4: no clean row for size $size"
done
total=$((total + 8 * calls))
run name --server="$COVERBS_VM_NAME_A" --port="$port" --sizes=64,1048576 --calls="$calls" --concurrency=4
grep -Eq "^ +1048576 +$calls +0 " "$TMP/out" || fail "by name: no clean row"
total=$((total + 2 * calls))
run ipv6 --server="$COVERBS_VM_ADDR6_A" --port="$port6" --sizes=64,1048576 --calls="$calls" --concurrency=4
grep -Eq "^ +1048576 +$calls +0 " "$TMP/out" || fail "ipv6: no clean row"
run link-local --server="fe80::5054:ff:fe20:1%$COVERBS_VM_NETIF" --port="$port6" \
  --sizes=64,1048576 --calls="$calls" --concurrency=4
grep -Eq "^ +1048576 +$calls +0 " "$TMP/out" || fail "link-local: no clean row"
v6=$((4 * calls))
piped=$(repeat 10000 1024)
run pipelined --server="$SERVER" --port="$port" --size=64 --calls="$piped" --concurrency=256 --connections=2
grep -Eq "^ +64 +$piped +0 " "$TMP/out" || fail "pipelined: no clean row"
total=$((total + piped))
put served "$total $v6"
echo "PASS ($((total + v6)) calls across the wire)"
