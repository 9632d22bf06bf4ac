#!/bin/bash
# tests/vm/wire.sh <command> -- runs INSIDE a guest on the wire (VM_NETDEV=wire)
#
# Makes this guest's side of the virtual wire misbehave, for the two-guest
# tests (run-in-vms.sh). vm-rdma-setup.sh loaded the modules and exports the
# path of this script as COVERBS_VM_WIRE_TOOL.
#
#   wire.sh netem <netem args...>  what this guest sends: e.g. `loss 1%`,
#                                  `delay 1ms 500us reorder 25%`, `duplicate 1%`,
#                                  `corrupt 0.1%` (tc-netem(8)); replaces the last
#   wire.sh cut                    drop every frame both ways at this guest (a
#                                  partition: egress netem loss 100%, ingress
#                                  dropped by a matchall filter)
#   wire.sh heal                   undo `cut` and `netem`
#   wire.sh show                   the qdiscs and their counters
#
# One side's netem shapes one direction; a test that wants the whole wire
# lossy runs it on both sides. The NIC keeps its link up throughout: a real
# partition is silence, not a port going down (rxe would report that to
# rdma_cm as a device event, a different failure).
set -euo pipefail
NIC=${COVERBS_VM_NETIF:?wire.sh: not on a wire (COVERBS_VM_NETIF unset)}
case ${1:-} in
    netem) shift
           tc qdisc replace dev "$NIC" root netem "$@" ;;
    cut)   tc qdisc replace dev "$NIC" root netem loss 100%
           tc qdisc replace dev "$NIC" handle ffff: ingress
           tc filter replace dev "$NIC" parent ffff: prio 1 matchall action drop ;;
    heal)  tc qdisc del dev "$NIC" root 2>/dev/null || true
           tc qdisc del dev "$NIC" handle ffff: ingress 2>/dev/null || true ;;
    show)  tc -s qdisc show dev "$NIC" ;;
    *) echo "usage: wire.sh netem <args...> | cut | heal | show" >&2; exit 2 ;;
esac
