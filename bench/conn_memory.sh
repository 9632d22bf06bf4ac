#!/bin/bash
# Memory per idle connection of echo_server: the server's RSS before and
# while one echo_client holds N idle connections (after one call each),
# divided by N. RSS counts the pages the connections touched -- on rxe/siw
# every registered receive buffer is pinned, hence resident; on soft only
# what was used -- but not the kernel's own objects (rxe/siw QP and CQ
# rings, sockets).
#   bench/conn_memory.sh <echo_server> <echo_client> <provider> <address> <N> [server flags...]
# Example (host, soft):   bench/conn_memory.sh bazel-bin/examples/echo_server \
#   bazel-bin/examples/echo_client soft 127.0.0.1 1000
# In the VM: VM_RDMA=rxe tests/vm/run-in-vm.sh bench/conn_memory.sh ... verbs '$COVERBS_VM_ADDR_A' 1000
# SIZE (default 64): the payload of each connection's one call; above the
# server's eager limit it makes the server keep landing buffers for it.
set -u
server=$1 client=$2 provider=$3 addr=$4 n=$5
shift 5
tmp=$(mktemp -d)
"$server" --provider="$provider" --address="$addr" --port=0 --port_file="$tmp/port" "$@" \
  >"$tmp/server.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 200); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
[[ -s "$tmp/port" ]] || { cat "$tmp/server.log"; echo "server did not start"; exit 1; }
rss() { awk '/^VmRSS/ {print $2}' "/proc/$pid/status"; }
# Warm up with one connection, so that pools and CQs that every server
# allocates once are in the baseline.
"$client" --provider="$provider" --server="$addr" --port="$(cat "$tmp/port")" \
  --calls=100 --concurrency=1 --connections=1 --size=64 >/dev/null || exit 1
sleep 0.5
rss0=$(rss)
"$client" --provider="$provider" --server="$addr" --port="$(cat "$tmp/port")" \
  --calls="$n" --concurrency=1 --connections="$n" --size="${SIZE:-64}" --hold=60s \
  >"$tmp/client.log" 2>&1 &
cpid=$!
for _ in $(seq 6000); do grep -q "holding" "$tmp/client.log" && break; sleep 0.1; done
grep -q "holding" "$tmp/client.log" || { cat "$tmp/client.log"; echo "client did not connect"; exit 1; }
sleep 1
rss1=$(rss)
kill $cpid 2>/dev/null
echo "provider $provider, $n idle connections after a ${SIZE:-64} B call, server flags: ${*:-(defaults)}"
echo "server RSS: $rss0 KiB -> $rss1 KiB: $(((rss1 - rss0) / n)) KiB per connection"

