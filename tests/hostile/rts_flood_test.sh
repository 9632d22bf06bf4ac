#!/bin/bash
# Issue 36: the echo server against rendezvous requests that are never
# finished. A real hostile_client process asks, on one connection, for
# rendezvous of 64 MiB over and over (--mode=rts_flood; rts_flood_touch
# also writes every page of each buffer it is granted) and sends no DONE.
# Before the receiver had a budget every request was granted -- 200 took
# the server to 13 GiB of address space (VmSize), and with the pages
# written, 24 to 1.5 GiB resident -- and nothing was freed until the
# connection closed. This script asserts that
#   - the server grants at most its budget (ConnectionOptions::
#     rendezvous_budget, 256 MiB) per connection, and ends the attacker's
#     connection once it has more requests waiting than a sender may have
#     (4), naming the budget in its log;
#   - its VmSize and RSS peaks (VmPeak, VmHWM in /proc/PID/status) stay
#     within the baseline + the budget per attacking connection + slack;
#   - a connection that got its CTS and sends no DONE ends at the deadline
#     (rendezvous_done_timeout, 30 s), its log line says so;
#   - a good echo_client (64 B and 1 MiB calls, verified) is served
#     during and after each attack, and the server returns to its baseline.
#   rts_flood_test.sh <echo_server> <echo_client> <hostile_client>
# The attack speaks the soft provider's wire (TCP); under the VM harness
# (COVERBS_PROVIDER=verbs) there is nothing to run.
set -u
server_bin=$1 client_bin=$2 hostile_bin=$3
provider=${COVERBS_PROVIDER:-soft}
[[ "$provider" == auto ]] && provider=soft
if [[ "$provider" != soft ]]; then
  echo "SKIP: the RTS flood speaks the soft provider's wire"
  exit 0
fi
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
log="$tmp/server.log"
fail() {
  echo "FAIL: $*"
  echo "--- server log (last 30 lines)"; tail -30 "$log"
  exit 1
}

addr=127.0.0.1
"$server_bin" --provider=soft --address="$addr" --port=0 --threads=2 \
  --port_file="$tmp/port" --metrics_port=0 >"$log" 2>&1 &
server=$!
trap 'kill -9 $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s "$tmp/port" ]] && break; sleep 0.05; done
[[ -s "$tmp/port" ]] || fail "server did not start"
port=$(cat "$tmp/port")

# /proc/PID/status fields, in KiB.
st() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$server/status"; }
alive() { kill -0 "$server" 2>/dev/null || fail "server died ($1)"; }

# A good client: 64 B and 1 MiB echo calls, every byte verified, within
# $1 seconds (connecting included).
good_client() {
  local limit=$1 what=$2 start end
  start=$(date +%s%N)
  timeout 30 "$client_bin" --provider=soft --server="$addr" --port="$port" \
    --calls=100 --concurrency=4 --connections=2 --sizes=64,1048576 --verify \
    >"$tmp/client.out" 2>&1 || { cat "$tmp/client.out"; fail "good client failed ($what)"; }
  end=$(date +%s%N)
  local ms=$(((end - start) / 1000000))
  ((ms < limit * 1000)) || fail "good client took ${ms} ms, bound ${limit} s ($what)"
  echo "  good client served in ${ms} ms ($what)"
}

counters() {
  local before
  before=$(grep -c "served .* call(s) on" "$log")
  kill -USR1 "$server"
  for _ in $(seq 100); do
    (($(grep -c "served .* call(s) on" "$log") > before)) && break
    sleep 0.02
  done
  grep "served .* call(s) on" "$log" | tail -1
}

# Under a sanitizer the address space is the shadow's (terabytes) and
# freed memory stays in quarantine: only RSS is checked there, loosely.
sanitized=0
ldd "$server_bin" 2>/dev/null | grep -q "libasan\|libtsan" && sanitized=1

mib=1024  # KiB
budget=$((256 * mib))
# Slack over the budget per attack: the good client's own 1 MiB calls
# (their rendezvous buffers and the rendezvous cache's idle block, 64 MiB)
# and whatever else the server maps meanwhile.
slack=$((128 * mib))

good_client 30 "warm-up"
base_vm=$(st VmSize)
base_rss=$(st VmRSS)
echo "baseline: VmSize $((base_vm / mib)) MiB, VmRSS $((base_rss / mib)) MiB"

# Peaks so far are the warm-up's; each case compares the peaks after it
# with the baseline (VmPeak and VmHWM only grow, so every case is checked
# against the largest so far -- the bound grows with its attackers).
check_peaks() {
  local attackers=$1 what=$2 vm_peak rss_peak
  vm_peak=$(st VmPeak)
  rss_peak=$(st VmHWM)
  echo "  peaks: VmSize $((vm_peak / mib)) MiB (+$(((vm_peak - base_vm) / mib))), VmRSS $((rss_peak / mib)) MiB (+$(((rss_peak - base_rss) / mib)))"
  local bound=$((attackers * budget + slack))
  if ((sanitized == 0)); then
    ((vm_peak - base_vm <= bound)) ||
      fail "VmSize peaked $(((vm_peak - base_vm) / mib)) MiB above the baseline, bound $((bound / mib)) MiB ($what)"
  fi
  ((rss_peak - base_rss <= bound + sanitized * 512 * mib)) ||
    fail "RSS peaked $(((rss_peak - base_rss) / mib)) MiB above the baseline, bound $((bound / mib)) MiB ($what)"
}

# Each attacker's connection was ended by the server after at most 9
# requests (4 granted at 64 MiB = the budget, 4 deferred, the fifth
# deferred one is the violation), 4 of them granted.
check_flood_out() {
  local out=$1 sent granted
  sed 's/^/  hostile: /' "$out"
  grep -q "closed by the server after" "$out" || fail "the server did not end the flooding connection"
  sent=$(sed -nE 's/.*requests sent ([0-9]+), granted ([0-9]+).*/\1/p' "$out")
  granted=$(sed -nE 's/.*requests sent ([0-9]+), granted ([0-9]+).*/\2/p' "$out")
  ((granted <= 4)) || fail "the server granted $granted requests of 64 MiB, budget 256 MiB"
  ((sent <= 9)) || fail "the server took $sent requests before ending the connection"
}

# flood <mode> <attackers>: attackers in parallel, 200 requests each,
# while a good client is served.
flood() {
  local mode=$1 n=$2 i pids=()
  echo "case $mode x $n"
  for i in $(seq "$n"); do
    timeout 120 "$hostile_bin" --mode="$mode" --address="$addr" --port="$port" \
      --count=200 --hold_ms=500 >"$tmp/hostile.$i.out" 2>&1 &
    pids+=($!)
  done
  sleep 0.3
  alive "$mode"
  good_client 10 "during $mode"
  for i in $(seq "$n"); do
    wait "${pids[$((i - 1))]}" || { cat "$tmp/hostile.$i.out"; fail "hostile_client $mode exited $?"; }
    check_flood_out "$tmp/hostile.$i.out"
  done
  alive "$mode"
  check_peaks "$n" "$mode x $n"
  good_client 10 "after $mode"
}

flood rts_flood 1
flood rts_flood_touch 1
# Not under TSan: there two attackers writing 2 x 256 MiB into the server
# (each write also TSan's shadow) starved its reactors past the soft
# transport's retry timer, and the good client's connection ended as
# "peer unreachable" (2 of 2 runs, 2026-11-29) -- the instrumentation's
# cost, not the bound's: plain and ASan runs pass it.
if ldd "$server_bin" 2>/dev/null | grep -q libtsan; then
  echo "case rts_flood_touch x 2: not under TSan (see the comment)"
else
  flood rts_flood_touch 2
fi
grep -q "closed: protocol violation by the peer: rendezvous budget" "$log" ||
  fail "no log line naming the rendezvous budget"

# A connection that got its CTS (4 requests, all within the budget) and
# then sends nothing: the server ends it at rendezvous_done_timeout (30 s),
# serving the good client meanwhile.
echo "case withheld DONE"
timeout 120 "$hostile_bin" --mode=rts_flood --address="$addr" --port="$port" \
  --count=4 --hold_ms=34000 >"$tmp/hostile.done.out" 2>&1 &
h=$!
sleep 2
good_client 10 "while the DONE is withheld"
wait $h || { cat "$tmp/hostile.done.out"; fail "hostile_client exited $?"; }
sed 's/^/  hostile: /' "$tmp/hostile.done.out"
after_ms=$(sed -nE 's/.*closed by the server after 4 requests, ([0-9]+) ms after the last.*/\1/p' "$tmp/hostile.done.out")
[[ -n "$after_ms" ]] || fail "the server did not end the connection that withheld its DONE"
((after_ms >= 29000 && after_ms <= 34000)) ||
  fail "the connection that withheld its DONE ended ${after_ms} ms after its last request, deadline 30 s"
grep -q "peer sent no DONE for rendezvous" "$log" ||
  fail "no log line for the withheld DONE"
check_peaks 2 "withheld DONE"
good_client 10 "after the withheld DONE"

# The budgets' counters on /metrics: deferred requests, the connections
# ended for breaking the budget and for withholding a DONE.
mport=$(sed -n 's/^echo_server: metrics on port \([0-9]*\)$/\1/p' "$log")
[[ -n "$mport" ]] || fail "echo_server printed no metrics port"
curl -sS --max-time 10 "http://$addr:$mport/metrics" >"$tmp/scrape" ||
  fail "scraping /metrics failed"
metric() { awk -v k="coverbs_rpc_server_$1" '$1 == k {print int($2)}' "$tmp/scrape"; }
deferred=$(metric rendezvous_deferred_total)
violations=$(metric rendezvous_budget_violations_total)
timeouts=$(metric rendezvous_done_timeouts_total)
echo "  /metrics: rendezvous_deferred_total $deferred, rendezvous_budget_violations_total $violations, rendezvous_done_timeouts_total $timeouts"
((${deferred:-0} > 0 && ${violations:-0} > 0 && ${timeouts:-0} >= 1)) ||
  fail "the budgets' counters did not move on /metrics"

# Back to the baseline: no connection open, memory within the rendezvous
# cache's idle block (64 MiB) and 16 MiB.
open=-1
for _ in $(seq 50); do
  open=$(counters | sed -E 's/.*\(([0-9]+) open,.*/\1/')
  [[ "$open" == 0 ]] && break
  sleep 0.2
done
[[ "$open" == 0 ]] || fail "$open connection(s) still open at the end"
rss=$(st VmRSS)
((rss <= base_rss + 80 * mib + sanitized * 512 * mib)) ||
  fail "RSS $((rss / mib)) MiB at the end, baseline $((base_rss / mib)) MiB"
echo "end: VmSize $(($(st VmSize) / mib)) MiB, VmRSS $((rss / mib)) MiB"

kill -TERM "$server"
wait "$server"
rc=$?
trap - EXIT
((rc == 0)) || fail "server exited $rc on SIGTERM"
echo "PASS"
