#!/bin/bash
# echo_server --metrics_port: after echo_client's calls, /metrics (scraped
# with curl) counts them in the Echo latency histogram and the server's
# counters, and `promtool check metrics` (Debian's prometheus package)
# finds nothing wrong with the exposition.
#   metrics_test.sh <echo_server> <echo_client>
set -u
server_bin="$1" client_bin="$2"
dir="${TEST_TMPDIR:-$(mktemp -d)}"
out="$dir/server.txt" scrape="$dir/metrics.txt" log="$dir/client.txt"
server=""
cleanup() { [[ -n "$server" ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; echo "--- server:"; cat "$out"; echo "--- scrape:"; cat "$scrape" 2>/dev/null; exit 1; }
command -v curl >/dev/null || fail "curl is missing (tools/install-deps.sh installs it)"
command -v promtool >/dev/null || fail "promtool is missing (tools/install-deps.sh installs prometheus)"

"$server_bin" --provider=soft --address=127.0.0.1 --port=0 --port_file="$dir/port" \
  --metrics_port=0 --threads=2 --run_for=50s >"$out" 2>&1 &
server=$!
for _ in $(seq 200); do [[ -s "$dir/port" ]] && break; sleep 0.05; done
[[ -s "$dir/port" ]] || fail "echo_server did not start"
port=$(cat "$dir/port")
mport=$(sed -n 's/^echo_server: metrics on port \([0-9]*\)$/\1/p' "$out")
[[ -n "$mport" ]] || fail "echo_server printed no metrics port"

"$client_bin" --provider=soft --server=127.0.0.1 --port="$port" --calls=40 --size=64 \
  --concurrency=4 >"$log" 2>&1 || { cat "$log"; fail "echo_client exited $?"; }

# The observer runs once a response is posted: poll until all 40 are in.
for _ in $(seq 100); do
  curl -sS --max-time 5 "http://127.0.0.1:$mport/metrics" >"$scrape" || fail "curl failed"
  grep -q '^coverbs_rpc_server_call_duration_seconds_count{method="Echo"} 40$' "$scrape" && break
  sleep 0.05
done
grep -q '^coverbs_rpc_server_call_duration_seconds_count{method="Echo"} 40$' "$scrape" ||
  fail "no Echo histogram with 40 calls"
grep -q '^coverbs_rpc_server_method_calls_total{code="OK",method="Echo"} 40$' "$scrape" ||
  fail "no OK count of 40 for Echo"
grep -q '^coverbs_rpc_server_calls_total 40$' "$scrape" || fail "calls_total is not 40"
grep -q '^coverbs_rpc_server_request_bytes_total 2560$' "$scrape" ||
  fail "request_bytes_total is not 40 x 64"
grep -q '^# TYPE coverbs_rpc_server_open_connections gauge$' "$scrape" ||
  fail "open_connections is not a gauge"
promtool check metrics <"$scrape" >"$dir/promtool.txt" 2>&1 ||
  { cat "$dir/promtool.txt"; fail "promtool check metrics found problems"; }

kill -TERM "$server"
wait "$server" || fail "echo_server exited $? on SIGTERM"
server=""
echo "PASS"
