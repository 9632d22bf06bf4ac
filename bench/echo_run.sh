# Sourced by the echo A/B scripts (cliff_ab.sh, echo_ab.sh): one run of a
# build's echo_server and echo_client on fresh processes.
#
# echo_run DIR SIZES OUT: starts DIR/echo_server on $addr (port 0, one
# reactor, $provider), runs DIR/echo_client with SIZES (comma-separated),
# $calls calls per size and $depth in flight, writes the client's table to
# OUT and stops the server. Uses $work (a scratch directory) and sets
# $spid while the server runs, for the caller's EXIT trap.
echo_run() {
  local d=$1 sizes=$2 out=$3
  rm -f "$work/port"
  "$d/echo_server" --address="$addr" --port=0 --port_file="$work/port" --threads=1 \
    --provider="$provider" >"$work/srv.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 200); do [ -s "$work/port" ] && break; sleep 0.05; done
  timeout 600 "$d/echo_client" --server="$addr" --port="$(cat "$work/port")" \
    --provider="$provider" --sizes="$sizes" --calls="$calls" --concurrency="$depth" \
    >"$out" 2>&1 || tail -3 "$out"
  kill -TERM $spid
  wait $spid 2>/dev/null
  spid=""
}
