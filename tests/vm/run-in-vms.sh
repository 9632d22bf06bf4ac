#!/bin/bash
# tests/vm/run-in-vms.sh <command> [args...]
#
# Two kernels on one wire: boots two guests with run-in-vm.sh, joined by a
# virtual Ethernet wire (qemu's socket netdev over the host's loopback, a
# virtio NIC in each), and runs the same <command> in both, as root, in the
# current directory. In guest a COVERBS_VM_ROLE=server, in guest b
# COVERBS_VM_ROLE=client: the command branches on it. With VM_RDMA=rxe|siw
# each guest gets one RDMA device on its NIC (VM_NETDEV=wire in
# vm-rdma-setup.sh): the server's address is COVERBS_VM_ADDR_A (10.20.0.1)
# and its name coverbs-vm-a in both guests, the client's 10.20.0.2
# (coverbs-vm-b).
#
# The two commands meet in COVERBS_VM_SHARED, a host directory both guests
# mount writable (tests/vm/wire/lib.sh has the helpers). This script reads
# three names there:
#   kill-server, kill-client  SIGKILL that guest's qemu at once: a host that
#                             dies (no FIN, no DREQ, nothing more on the wire)
#   client-exited             written by this script when the client's guest
#                             has ended; the server's command should end then
# and writes server-exited when the server's guest ended first.
# Each guest's output is streamed with a "[server] " or "[client] " prefix.
#
# Env knobs: those of run-in-vm.sh (VM_SMP defaults to 1 here: two TCG
# guests on a 2-core host), and
#   VM_WIRE_MTU_A, VM_WIRE_MTU_B  each side's NIC MTU (default 1500)
#   VM_SERVER_GRACE=30  seconds the server may take to end after the client
#                       did; then its guest is killed and that is a failure
#   VM_LOGDIR=dir       each guest's logs go to dir/server and dir/client
#
# Exit status: the client's if it is not 0, else the server's (a guest
# killed through kill-* counts as 0 for its side); 77 when the harness is
# unavailable, 2 on a usage error, 125 when the wire could not be laid.
set -uo pipefail
HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 <command> [args...]" >&2; exit 2; }
msg=$("$HERE/run-in-vm.sh" --check 2>&1) || { echo "$msg" >&2; exit 77; }

SHARED=$(mktemp -d "${TMPDIR:-${TEST_TMPDIR:-/tmp}}/coverbs-wire.XXXXXX") ||
    { echo "run-in-vms: cannot create the shared dir" >&2; exit 125; }
SHARED=$(readlink -f "$SHARED")
SPID='' CPID=''
cleanup() {
    local p
    for p in "$SPID" "$CPID"; do [ -n "$p" ] && kill -TERM "$p" 2>/dev/null; done
    wait 2>/dev/null
    [ "${VM_KEEP:-0}" = 1 ] || rm -rf "$SHARED"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# A free port for the wire: qemu's listening side takes the first
# connection as its peer, so the port is checked in /proc, never probed.
listening() {  # port: is it in LISTEN state on the host?
    local hex
    printf -v hex '%04X' "$1"
    grep -q ":$hex [0-9A-F:]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
PORT=
for _ in $(seq 1 50); do
    p=$((20000 + RANDOM % 30000))
    listening "$p" || { PORT=$p; break; }
done
[ -n "$PORT" ] || { echo "run-in-vms: no free port for the wire" >&2; exit 125; }

export VM_SMP=${VM_SMP:-1} VM_NETDEV=wire COVERBS_VM_SHARED=$SHARED
export VM_RW="${VM_RW:-} $SHARED"
LOGDIR=${VM_LOGDIR:-}
# start side role mode mtu <command...>: one guest, in the background
start() {
    local side=$1 role=$2 mode=$3 mtu=$4
    shift 4
    VM_WIRE="$mode:$PORT" VM_WIRE_SIDE=$side VM_WIRE_MTU=$mtu COVERBS_VM_ROLE=$role \
        VM_PIDFILE="$SHARED/.qemu-$role.pid" VM_KILL_FLAG="$SHARED/.killed-$role" \
        VM_LOGDIR=${LOGDIR:+$LOGDIR/$role} \
        "$HERE/run-in-vm.sh" "$@" > >(exec sed -u "s/^/[$role] /") 2>&1 &
}
kill_guest() {  # role: SIGKILL its qemu, as a host that loses power
    local pid child
    [ -e "$SHARED/.killed-$1" ] && return
    : > "$SHARED/.killed-$1"
    read -r pid < "$SHARED/.qemu-$1.pid" 2>/dev/null || return
    # The pid is timeout(1)'s; qemu is its only child.
    read -r child < "/proc/$pid/task/$pid/children" 2>/dev/null
    kill -KILL ${child:+"$child"} 2>/dev/null
    echo "run-in-vms: killed the $1's guest (qemu pid ${child:-?}) on request" >&2
}

start a server listen "${VM_WIRE_MTU_A:-1500}" "$@"
SPID=$!
# qemu listens before the guest boots; the client's qemu must find it there.
for _ in $(seq 1 300); do
    listening "$PORT" && break
    kill -0 "$SPID" 2>/dev/null || break
    sleep 0.1
done
if ! listening "$PORT"; then
    echo "run-in-vms: the server's qemu did not listen on 127.0.0.1:$PORT" >&2
    exit 125
fi
start b client connect "${VM_WIRE_MTU_B:-1500}" "$@"
CPID=$!

SRC='' CRC=''
while [ -z "$CRC" ]; do
    [ -e "$SHARED/kill-server" ] && kill_guest server
    [ -e "$SHARED/kill-client" ] && kill_guest client
    if [ -z "$SRC" ] && ! kill -0 "$SPID" 2>/dev/null; then
        wait "$SPID"; SRC=$?; SPID=
        : > "$SHARED/server-exited"
    fi
    if ! kill -0 "$CPID" 2>/dev/null; then
        wait "$CPID"; CRC=$?; CPID=
    fi
    sleep 0.2
done
: > "$SHARED/client-exited"
if [ -z "$SRC" ]; then
    grace=${VM_SERVER_GRACE:-30}
    for _ in $(seq 1 $((grace * 5))); do
        kill -0 "$SPID" 2>/dev/null || break
        sleep 0.2
    done
    if kill -0 "$SPID" 2>/dev/null; then
        echo "run-in-vms: the server did not end within ${grace}s of the client (VM_SERVER_GRACE)" >&2
        kill_guest server
        wait "$SPID"; SPID=
        SRC=124
    else
        wait "$SPID"; SRC=$?; SPID=
    fi
fi
killed() { [ -e "$SHARED/.killed-$1" ] && [ "$2" = 137 ]; }
killed server "$SRC" && SRC=0
killed client "$CRC" && CRC=0
echo "run-in-vms: server exit $SRC, client exit $CRC (wire 127.0.0.1:$PORT)" >&2
[ "$CRC" != 0 ] && exit "$CRC"
exit "$SRC"
