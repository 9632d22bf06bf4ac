#!/bin/bash
# The examples' command lines: bad flags, bad values and stray arguments
# exit 2 with a message naming them; --help exits 0; an empty address is
# refused (listening everywhere needs an explicit 0.0.0.0); echo_client
# refuses a concurrency x size that would not fit in --max_memory_mb
# instead of dying in bad_alloc.
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
exit $fail
