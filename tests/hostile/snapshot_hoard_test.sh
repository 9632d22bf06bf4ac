#!/bin/bash
# Issue 37, bounded exposure per connection: snapshot_hoarder takes 3,000
# kv_typed snapshots (500 keys, ~55 KB each) on one connection and releases
# none. Before the bound every one was granted and kept until the
# connection closed (20,000 of them: server RSS 24 -> 38 MB and growing,
# no error). Now:
#  - the server grants ConnectionOptions::max_exposures (1,024) and refuses
#    the rest with RESOURCE_EXHAUSTED naming the bound;
#  - its RSS grows by at most what 1,024 snapshots hold (+ slack), and
#    falls back once the hoarder lets go;
#  - a good kv_typed_client is served meanwhile;
#  - a hoarder that releases gets new snapshots again.
#   snapshot_hoard_test.sh <kv_typed_server> <kv_typed_client> <snapshot_hoarder>
set -u
server_bin=$1 client_bin=$2 hoarder_bin=$3
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
log="$tmp/server.log"
fail() {
  echo "FAIL: $*"
  echo "--- server log (last 20 lines)"; tail -20 "$log"
  exit 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
mport=$(free_port)
"$server_bin" --address=127.0.0.1 --port="$port" --threads=2 \
  --metrics_port="$mport" >"$log" 2>&1 &
server=$!
hoarder=""
trap 'kill -9 $server $hoarder 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 100); do
  grep -q "listening" "$log" 2>/dev/null && break
  sleep 0.05
done
rss() { awk '$1 == "VmRSS:" {print $2}' "/proc/$server/status"; }
mib=1024
base=$(rss)
echo "server RSS at start: $((base / mib)) MiB"

# Snapshots of a 500-key store, none released, held for 4 s.
"$hoarder_bin" --server=127.0.0.1 --port="$port" --keys=500 --snapshots=3000 \
  --hold_ms=4000 >"$tmp/hoarder.out" 2>&1 &
hoarder=$!
for _ in $(seq 600); do
  grep -q "^hoarder: granted" "$tmp/hoarder.out" && break
  kill -0 "$hoarder" 2>/dev/null || break
  sleep 0.1
done
cat "$tmp/hoarder.out"
line=$(grep "^hoarder: granted" "$tmp/hoarder.out") || fail "the hoarder did not finish its snapshots"
granted=$(sed -E 's/^hoarder: granted ([0-9]+) .*/\1/' <<<"$line")
refused=$(sed -E 's/.* refused ([0-9]+) .*/\1/' <<<"$line")
((granted == 1024)) || fail "granted $granted snapshots, expected max_exposures = 1024"
((refused == 3000 - 1024)) || fail "refused $refused, expected $((3000 - 1024))"
grep -q "first refusal: RESOURCE_EXHAUSTED: .*ConnectionOptions::max_exposures" <<<"$line" ||
  fail "the refusal does not name the bound"
held=$(rss)
echo "server RSS while 1024 snapshots are held: $((held / mib)) MiB (+$(((held - base) / mib)) MiB)"
# A snapshot of 500 keys x (key + 100 B) is ~55 KB; 1,024 of them ~56 MiB,
# plus their registrations' bookkeeping. Sanitizers keep freed memory in
# quarantine: looser there.
slack=40
ldd "$server_bin" 2>/dev/null | grep -q "libasan\|libtsan" && slack=400
((held - base <= (64 + slack) * mib)) ||
  fail "server RSS grew by $(((held - base) / mib)) MiB holding 1024 snapshots"
# Another client is served meanwhile (its own connection, its own bound).
timeout 60 "$client_bin" --server=127.0.0.1 --port="$port" --keys=200 >"$tmp/client.out" 2>&1 ||
  { cat "$tmp/client.out"; fail "a good client failed while the hoarder held its snapshots"; }
grep -q "0 mismatch(es)" "$tmp/client.out" || fail "the good client saw mismatches"
echo "good client served while the hoarder held 1024 snapshots"
wait "$hoarder" || fail "the hoarder exited $?"
hoarder=""
# Its connection closed: the exposures and their bytes went with it.
curl -sS --max-time 10 "http://127.0.0.1:$mport/metrics" >"$tmp/scrape" || fail "scrape failed"
refused_metric=$(awk '$1 == "coverbs_rpc_server_exposures_refused_total" {print int($2)}' "$tmp/scrape")
echo "/metrics: exposures_refused_total $refused_metric"
((refused_metric == 3000 - 1024)) || fail "exposures_refused_total is '$refused_metric'"

# A hoarder that releases: 1,024 granted, released, a new one granted.
"$hoarder_bin" --server=127.0.0.1 --port="$port" --keys=10 --snapshots=1100 \
  --release >"$tmp/hoarder2.out" 2>&1 || { cat "$tmp/hoarder2.out"; fail "the releasing hoarder failed"; }
cat "$tmp/hoarder2.out"
grep -q "released 1024; a new snapshot was granted" "$tmp/hoarder2.out" ||
  fail "release did not make room"
end=$(rss)
echo "server RSS at the end: $((end / mib)) MiB"
kill -TERM "$server"
wait "$server" || fail "kv_typed_server exited $? on SIGTERM"
trap - EXIT
echo PASS
