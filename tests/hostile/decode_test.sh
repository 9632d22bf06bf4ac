#!/bin/bash
# Issue 36, point 2: typed decoding that cannot amplify, attacked by real
# processes. decode_server serves typed methods on 4 reactors; for each
# attack, 4 connections of a decode_client process send one payload each
# at once (16 MiB: a msgpack array of nils to a two-field struct and to
# vector<string>, an array of empty strings to vector<string>, a protobuf
# batch of empty sub-messages), while a good decode_client makes small
# typed and byte calls and a fresh connection every 20 calls. Asserted:
#   - every attack call fails with INVALID_ARGUMENT or RESOURCE_EXHAUSTED
#     (the client exits non-zero otherwise),
#   - the server's peak RSS (VmHWM) stays under $hwm_bound_mb MiB (before
#     the bound: 1.6-3.6 GiB for these four),
#   - legitimate payloads (vector<float>, vector<string>: 4 x 16 MiB; a
#     protobuf batch of filled items: 2 x 8 MiB) are served,
#   - the good client's every call and connect took under 1 s (2 s under
#     a sanitizer),
#   - no reactor stalled (the server's counter and its log; under a
#     sanitizer, none in a method), and the server is still up.
# On the host: the soft provider on loopback; in the VM (tests/vm,
# COVERBS_PROVIDER=verbs) rxe or siw on the guest's address.
#   decode_test.sh <decode_server> <decode_client>
set -u
server_bin=$1 client_bin=$2
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
log="$tmp/server.log"
fail() {
  echo "FAIL: $*"
  echo "--- server log (last 30 lines)"; tail -30 "$log"
  exit 1
}

provider=${COVERBS_PROVIDER:-soft}
[[ "$provider" == auto ]] && provider=soft
addr=127.0.0.1
[[ "$provider" == verbs ]] && addr=${COVERBS_VM_ADDR_A:?the VM harness sets COVERBS_VM_ADDR_A}
size=$((16 << 20))
# 4 requests of 16 MiB in the server at once are 64 MiB, their rendezvous
# buffers as much again; the decodes may add 8x what they keep, none of
# these keeps anything. Under a sanitizer (shadow memory, quarantine) only
# a gross amplification fails.
hwm_bound_mb=256
bound=1s
# Under a sanitizer everything runs 5-15x slower, the soft transport's
# copies of these payloads included (its 0.5 s retry timer does not
# scale): 4 MiB payloads, and only a stall in a method (a decode on the
# reactor) fails; others are listed.
sanitizer=0
if ldd "$server_bin" 2>/dev/null | grep -q "libasan\|libtsan"; then
  sanitizer=1
  size=$((4 << 20))
  hwm_bound_mb=1536
  bound=2s
fi

"$server_bin" --provider="$provider" --address="$addr" --port=0 --threads=4 \
  --port_file="$tmp/port" ${DECODE_SERVER_FLAGS:-} >"$log" 2>&1 &
server=$!
good=""
trap 'kill -9 $server $good 2>/dev/null; wait $server $good 2>/dev/null' EXIT
for _ in $(seq 200); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
[[ -s "$tmp/port" ]] || fail "server did not start"
port=$(cat "$tmp/port")
alive() { kill -0 "$server" 2>/dev/null || fail "server died ($1)"; }
kb() { awk "/^$1/ {print \$2}" "/proc/$server/status"; }
client() {
  timeout 120 "$client_bin" --provider="$provider" --server="$addr" \
    --port="$port" "$@"
}

echo "server baseline: VmRSS $(($(kb VmRSS) / 1024)) MiB"
client --mode=good --stop_file="$tmp/stop" --bound="$bound" \
  >"$tmp/good.out" 2>&1 &
good=$!

for attack in nils_pair nils_strings empty_strings empty_batch; do
  start=$(date +%s%N)
  client --mode=attack --attack="$attack" --size="$size" --connections=4 \
    >"$tmp/attack.out" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  grep -v "^coverbs\[" "$tmp/attack.out" | cut -c1-220
  ((rc == 0)) || { cat "$tmp/attack.out"; fail "attack $attack: the calls did not all fail"; }
  alive "$attack"
  hwm=$(($(kb VmHWM) / 1024))
  echo "  $attack: 4 x $size bytes refused in $ms ms; server peak RSS so far $hwm MiB"
  ((hwm < hwm_bound_mb)) || fail "peak RSS $hwm MiB after $attack, bound $hwm_bound_mb MiB"
done

# (The protobuf batch on 2 connections of 8 MiB: decoding it is real work,
# on a pool thread, and on a loaded 2-core host the good client's calls
# must still get their turn.)
for legit in floats:4:$size strings:4:$size batch:2:$((size / 2)); do
  IFS=: read -r legit n bytes <<<"$legit"
  client --mode=attack --attack="$legit" --expect=ok --size="$bytes" \
    --connections="$n" >"$tmp/legit.out" 2>&1 ||
    { cat "$tmp/legit.out"; fail "legitimate $legit payloads were not served"; }
  grep -v "^coverbs\[" "$tmp/legit.out" | head -1 | cut -c1-160
  alive "$legit"
done
echo "  server peak RSS with the legitimate ones: $(($(kb VmHWM) / 1024)) MiB"

touch "$tmp/stop"
wait "$good"
rc=$?
good=""
grep "^good" "$tmp/good.out"
((rc == 0)) || { cat "$tmp/good.out"; fail "the good client was not served in time"; }

kill -USR1 "$server"
for _ in $(seq 100); do grep -q "reactor stall" "$log" && break; sleep 0.02; done
counters=$(grep "served .* call(s) on" "$log" | tail -1)
echo "$counters"
method_stall="reactor stalled: task '\(Pair\|Strings\|Floats\|Batch\)'"
if ((sanitizer)); then
  grep "reactor stalled" "$log" | head -5
  if grep -q "$method_stall" "$log"; then
    fail "a reactor stalled in a method: $counters"
  fi
elif [[ "$counters" != *" 0 reactor stall(s)"* ]] || grep -q "reactor stalled" "$log"; then
  grep "reactor stalled" "$log" | head -5
  fail "a reactor stalled: $counters"
fi
echo "PASS"
