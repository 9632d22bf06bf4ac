#!/bin/bash
# The examples' command lines: bad flags, bad values and stray arguments
# exit 2 with a message naming them; --help exits 0; an empty address is
# refused (listening everywhere needs an explicit 0.0.0.0); echo_client
# refuses a concurrency x size that would not fit in --max_memory_mb
# instead of dying in bad_alloc; every numeric flag out of its range exits 2
# naming the flag and the range; a --port_file in a missing directory is
# refused before anything starts; the client's messages use client wording.
set -uo pipefail
echo_server=$1 echo_client=$2 kv_server=$3 kv_client=$4
fail=0
expect() {  # expect <code> <stderr substring> <command...>
  local want=$1 text=$2
  shift 2
  local err rc
  err=$(timeout 20 "$@" 2>&1 >/dev/null)
  rc=$?
  if [[ $rc -ne $want ]]; then
    echo "FAIL: exit $rc, want $want: $*"; echo "$err" | head -5; fail=1
  elif [[ -n "$text" && "$err" != *"$text"* ]]; then
    echo "FAIL: stderr lacks '$text': $*"; echo "$err" | head -5; fail=1
  else
    echo "ok   ($rc) $*"
  fi
}
expect_lacks() {  # expect_lacks <stderr substring> <command...>
  local text=$1
  shift
  local err
  err=$(timeout 20 "$@" 2>&1 >/dev/null)
  if [[ "$err" == *"$text"* ]]; then
    echo "FAIL: stderr has '$text': $*"; echo "$err" | head -5; fail=1
  else
    echo "ok   (lacks '$text') $*"
  fi
}
for p in "$echo_server" "$echo_client" "$kv_server" "$kv_client"; do
  expect 2 "bogus" "$p" --bogus=1
  expect 2 "port" "$p" --port=notanumber
  expect 2 "stray" "$p" stray
  expect 2 "--provider" "$p" --provider=bogus
  expect 0 "" "$p" --help
  # The help text itself reaches a pipe (stdout), naming the flags.
  if [[ "$(timeout 20 "$p" --help 2>/dev/null)" != *"--port"* ]]; then
    echo "FAIL: $p --help printed no flag list on stdout"; fail=1
  fi
done
expect 2 "--address is empty" "$echo_server" --address=
expect 2 "--address is empty" "$kv_server" --address=
expect 2 "--server is empty" "$echo_client" --server=
expect 2 "--server is empty" "$kv_client" --server=
expect 2 "--max_memory_mb" "$echo_client" --concurrency=1000 --size=67108832
expect 2 "size" "$echo_client" --size=99999999999
expect 2 "--srq_initial_credits must be >= 2" "$echo_server" --srq_initial_credits=1
expect 2 "--eager_size" "$echo_server" --eager_size=10
# Ranges: the flag, its value and the range are named.
expect 2 "--max_concurrent_calls=0 is out of range: it must be in [1, 1048576]" \
  "$echo_server" --max_concurrent_calls=0
expect 2 "--max_concurrent_calls=-1 is out of range" "$echo_server" --max_concurrent_calls=-1
expect 2 "--threads=0 is out of range: it must be in [1, 1024]" "$echo_server" --threads=0
expect 2 "--run_for=-1s is out of range" "$echo_server" --run_for=-1s
expect 2 "or inf (forever)" "$echo_server" --run_for=0s
expect 2 "--accept_timeout=0 is out of range" "$echo_server" --accept_timeout=0s
expect 2 "--srq_depth=-1 is out of range: it must be in [0, 1048576]" "$echo_server" --srq_depth=-1
expect 2 "--eager_size=10 is out of range: it must be in [64, 1048576] bytes" \
  "$echo_server" --eager_size=10
expect 2 "--port_file=/nonexistent-coverbs-dir/port: directory '/nonexistent-coverbs-dir' does not exist" \
  "$echo_server" --port_file=/nonexistent-coverbs-dir/port
expect 2 "--concurrency=0 is out of range: it must be in [1, 1048576]" "$echo_client" --concurrency=0
expect 2 "--connections=0 is out of range" "$echo_client" --connections=0
expect 2 "--calls=-1 is out of range" "$echo_client" --calls=-1
expect 2 "--size=-1 is out of range: it must be in [0, 67108832] bytes" "$echo_client" --size=-1
expect 2 "--sizes=-5 is out of range" "$echo_client" --sizes=64,-5
expect 2 "--deadline=0 is out of range" "$echo_client" --deadline=0s
expect 2 "--max_memory_mb=0 is out of range" "$echo_client" --max_memory_mb=0
# The client's wording: nothing about listening.
expect 2 "give the server's address" "$echo_client" --server=
expect_lacks "listen" "$echo_client" --server=
# A name that does not resolve: the reason names the name and the
# resolver's answer (.invalid never resolves, RFC 2606).
expect 1 "address resolution failed: 'no-such-host.invalid'" \
  "$echo_client" --provider=soft --server=no-such-host.invalid --port=9 --calls=1
exit $fail
