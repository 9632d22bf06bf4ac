#!/bin/bash
# tests/vm/vm-rdma-setup.sh <rxe|siw> <dummy|veth|lo|wire> [ENVFILE]  -- runs INSIDE the guest
#
# Loads the kernel RDMA core and one software provider, gives it a netdev with
# an IPv4 and an IPv6 address, names them in the guest's /etc/hosts, and writes `export COVERBS_VM_*=...` lines to ENVFILE (stdout
# if none) describing the result. guest-stage2.sh runs it when VM_RDMA is set.
#
# Netdev choices and why:
#   dummy  dummy0 with 10.11.0.1 and 10.11.0.2 (fd00:11::1, fd00:11::2), one
#          RDMA device. Server and client share the device; traffic is
#          loopback inside the provider.
#   veth   veth0=10.12.0.1 <-> veth1=10.12.0.2 (fd00:12::1, fd00:12::2) in ONE
#          namespace, one RDMA device on each end, policy routing so packets
#          really cross the pair.
#          Separate namespaces do not work on 6.1: rxe is not netns-aware
#          (connections time out) and siw's listen fails with EADDRINUSE.
#   lo     127.0.0.1 and ::1 only. rdma_cm does not work there (siw: zero GID; rxe:
#          rdma_resolve_route ENODEV); only non-CM verbs on rxe. Kept for probing.
#   wire   the guest's virtio NIC on the wire run-in-vms.sh lays between two
#          guests: side a (VM_WIRE_SIDE=a, the server's) is 10.20.0.1 and
#          fd00:20::1, side b 10.20.0.2 and fd00:20::2; one RDMA device per
#          guest, on the NIC. COVERBS_VM_ADDR_A is side a's address in both
#          guests (where a client connects to); COVERBS_VM_ADDR_LOCAL this
#          guest's own. The peer's MAC is a static neighbour (run-in-vm.sh
#          sets both MACs): a partition then cannot leave ARP in a failed
#          state that outlives the heal. VM_WIRE_MTU sets this side's MTU
#          (default 1500).
#
# The IPv6 addresses are ULAs added with `nodad` (usable at once, no 1 s of
# duplicate address detection). The name coverbs-vm-a resolves to both of
# side A's addresses (IPv4 first, then IPv6): /etc/hosts is the host's,
# read-only, so a copy with those lines is bind-mounted over it.
#
# Every process costs 60-100 ms under TCG, so this script batches (modprobe -a,
# ip -batch) and polls sysfs with shell builtins.
set -euo pipefail
TYPE=${1:?usage: vm-rdma-setup.sh rxe|siw dummy|veth|lo [envfile]}
ND=${2:-dummy}
ENVFILE=${3:-/dev/stdout}
SIW_KO=${COVERBS_VM_SIW_KO:-/run/coverbs-vm/siw.ko}   # put there by the initramfs

ulimit -l unlimited
sysctl_w() { echo "$2" > "/proc/sys/${1//.//}"; }     # no procps dependency

case $ND in
    dummy) NETIF_A=dummy0 NETIF_B=dummy0 ADDR_A=10.11.0.1 ADDR_B=10.11.0.2
           ADDR6_A=fd00:11::1 ADDR6_B=fd00:11::2 ;;
    veth)  NETIF_A=veth0 NETIF_B=veth1 ADDR_A=10.12.0.1 ADDR_B=10.12.0.2
           ADDR6_A=fd00:12::1 ADDR6_B=fd00:12::2 ;;
    lo)    NETIF_A=lo NETIF_B=lo ADDR_A=127.0.0.1 ADDR_B=127.0.0.1
           ADDR6_A=::1 ADDR6_B=::1 ;;
    wire)  ADDR_A=10.20.0.1 ADDR_B=10.20.0.2 ADDR6_A=fd00:20::1 ADDR6_B=fd00:20::2
           SIDE=${VM_WIRE_SIDE:-a}
           case $SIDE in
               a) LOCAL=$ADDR_A LOCAL6=$ADDR6_A PEER=$ADDR_B PEER6=$ADDR6_B PEER_MAC=52:54:00:20:00:02 ;;
               b) LOCAL=$ADDR_B LOCAL6=$ADDR6_B PEER=$ADDR_A PEER6=$ADDR6_A PEER_MAC=52:54:00:20:00:01 ;;
               *) echo "vm-rdma-setup: VM_WIRE_SIDE must be a or b, not '$SIDE'" >&2; exit 2 ;;
           esac ;;
    *) echo "vm-rdma-setup: unknown netdev kind '$ND' (dummy|veth|lo|wire)" >&2; exit 2 ;;
esac

# rdma_ucm pulls in rdma_cm, iw_cm and ib_cm.
MODS=(ib_uverbs rdma_ucm)
[ "$ND" = veth ] && MODS+=(veth)
# netem and the ingress filter let a test make the wire lossy or cut it
# (wire.sh); loaded here, in the same modprobe, as each process is dear.
[ "$ND" = wire ] && MODS+=(virtio_net sch_netem sch_ingress cls_matchall act_gact)
case $TYPE in
    rxe) modprobe -a "${MODS[@]}" rdma_rxe ;;
    siw) # Debian builds no siw; setup.sh compiled this one out of tree, and
         # insmod does not resolve dependencies: load them first.
         modprobe -a "${MODS[@]}" libcrc32c
         modprobe crc32c_generic 2>/dev/null || true
         grep -q '^siw ' /proc/modules || insmod "$SIW_KO" ;;
    *) echo "vm-rdma-setup: unknown provider '$TYPE' (rxe|siw)" >&2; exit 2 ;;
esac

# The veth pair's policy routing for one address family, as `ip -batch`
# lines into the variable named $1 (no subshell: each process costs 60-100
# ms under TCG): rules that send traffic for A ($2) out of veth1 and for B
# ($3) out of veth0, ahead of the "local" table, and static neighbours.
veth_routes() {
    printf -v "$1" '%s\n' \
        "rule add pref 100 lookup local" \
        "rule del pref 0 lookup local" \
        "rule add pref 10 iif lo to $2 lookup 101" \
        "rule add pref 11 iif lo to $3 lookup 102" \
        "route add $2 dev veth1 src $3 table 101" \
        "route add $3 dev veth0 src $2 table 102" \
        "neigh replace $2 lladdr 02:00:0a:0c:00:01 dev veth1 nud permanent" \
        "neigh replace $3 lladdr 02:00:0a:0c:00:02 dev veth0 nud permanent"
}

case $ND in
    dummy)
        # Without numdummies=0 the module creates its own dummy0 first.
        modprobe dummy numdummies=0
        ip -batch - <<EOF
link add dummy0 type dummy
addr add $ADDR_A/24 dev dummy0
addr add $ADDR_B/24 dev dummy0
addr add $ADDR6_A/64 dev dummy0 nodad
addr add $ADDR6_B/64 dev dummy0 nodad
link set dummy0 up
EOF
        ;;
    veth)
        # Both addresses are local, so by default the kernel would deliver
        # A<->B traffic over lo and the veth pair would carry nothing. Move the
        # "local" table behind two rules that send locally generated traffic for
        # A out of veth1 and for B out of veth0; the receiving side must then
        # accept packets whose source is one of its own addresses.
        # ARP works across this too, but costs the first rdma_cm connection ~2 s
        # of address-resolution retries: fixed MACs and static neighbours instead.
        veth_routes ROUTES4 "$ADDR_A" "$ADDR_B"
        veth_routes ROUTES6 "$ADDR6_A" "$ADDR6_B"
        ip -batch - <<EOF
link add veth0 address 02:00:0a:0c:00:01 type veth peer name veth1 address 02:00:0a:0c:00:02
addr add $ADDR_A/24 dev veth0
addr add $ADDR_B/24 dev veth1
addr add $ADDR6_A/64 dev veth0 nodad
addr add $ADDR6_B/64 dev veth1 nodad
link set veth0 up
link set veth1 up
$ROUTES4
EOF
        # The same for IPv6, whose rules are a list of their own. IPv6 has no
        # accept_local: it takes packets from its own addresses as they are.
        ip -6 -batch - <<<"$ROUTES6"
        for k in all default veth0 veth1; do
            sysctl_w net.ipv4.conf.$k.accept_local 1
            sysctl_w net.ipv4.conf.$k.rp_filter 0
        done ;;
    lo) ip link set lo up ;;
    wire)
        # No udev in the guest: the virtio NIC keeps the kernel's name.
        NIC=
        for ((try = 0; try < 100; try++)); do
            for d in /sys/class/net/*; do
                d=${d##*/}
                [ "$d" = lo ] || { NIC=$d; break; }
            done
            [ -n "$NIC" ] && break
            sleep 0.05
        done
        [ -n "$NIC" ] || { echo "vm-rdma-setup: no NIC appeared (is the guest on a wire? VM_WIRE)" >&2; exit 1; }
        NETIF_A=$NIC NETIF_B=$NIC
        ip -batch - <<EOF
link set $NIC mtu ${VM_WIRE_MTU:-1500}
addr add $LOCAL/24 dev $NIC
addr add $LOCAL6/64 dev $NIC nodad
link set $NIC up
neigh replace $PEER lladdr $PEER_MAC dev $NIC nud permanent
neigh replace $PEER6 lladdr $PEER_MAC dev $NIC nud permanent
EOF
        ;;
esac

DEV_A=${TYPE}0
rdma link add "$DEV_A" type "$TYPE" netdev "$NETIF_A"
if [ "$NETIF_B" = "$NETIF_A" ]; then DEV_B=$DEV_A
else DEV_B=${TYPE}1; rdma link add "$DEV_B" type "$TYPE" netdev "$NETIF_B"; fi

port_active() {
    local s=
    read -r s < "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null || true
    [[ $s == *ACTIVE* ]]
}
# Index of the IPv4-mapped GID (::ffff:a.b.c.d): RoCE verbs without rdma_cm
# must address the peer through it (ibv_rc_pingpong -g, perftest -x). Those sit
# at the low indices; siw has a single MAC-based GID at index 0.
ipv4_gid_index() {  # dev addr
    local want i g
    printf -v want '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${2//./ }
    for ((i = 0; i < 16; i++)); do
        read -r g < "/sys/class/infiniband/$1/ports/1/gids/$i" 2>/dev/null || return 1
        [ "$g" = "$want" ] && { echo "$i"; return 0; }
    done
    return 1
}
need_gid() { [ "$TYPE" = rxe ] && [ "$ND" != lo ]; }
# Port state and the GID table follow the netdev asynchronously. On the wire
# the device has only this side's address; the peer's GID sits at the same
# index in its own table (the same setup ran there).
GID_A=0 GID_B=0
GADDR_A=$ADDR_A GADDR_B=$ADDR_B
[ "$ND" = wire ] && GADDR_A=$LOCAL GADDR_B=$LOCAL
for ((try = 0; try < 100; try++)); do
    if port_active "$DEV_A" && port_active "$DEV_B"; then
        need_gid || break
        GID_A=$(ipv4_gid_index "$DEV_A" "$GADDR_A") && GID_B=$(ipv4_gid_index "$DEV_B" "$GADDR_B") && break
    fi
    sleep 0.05
done
port_active "$DEV_A" && port_active "$DEV_B" ||
    { echo "vm-rdma-setup: ports of $DEV_A/$DEV_B not ACTIVE" >&2; rdma link show >&2; exit 1; }
if need_gid && { [ -z "$GID_A" ] || [ -z "$GID_B" ]; }; then
    echo "vm-rdma-setup: no IPv4 GID for $ADDR_A/$ADDR_B on $DEV_A/$DEV_B" >&2; exit 1
fi

# A host name for side A in both families (the guest's / is the host's,
# read-only: a copy of /etc/hosts with the name goes over it); on the wire
# side B's too.
HOSTS=/run/coverbs-vm/hosts
[ -d /run/coverbs-vm ] || mkdir -p /run/coverbs-vm
{ [ -r /etc/hosts ] && echo "$(< /etc/hosts)"
  echo "$ADDR_A coverbs-vm-a"
  echo "$ADDR6_A coverbs-vm-a"
  if [ "$ND" = wire ]; then
      echo "$ADDR_B coverbs-vm-b"
      echo "$ADDR6_B coverbs-vm-b"
  fi; } > "$HOSTS"
mount --bind "$HOSTS" /etc/hosts

rdma link show
ip -brief addr show

cat > "$ENVFILE" <<EOF
export COVERBS_VM_RDMA=$TYPE
export COVERBS_VM_NETDEV=$ND
export COVERBS_VM_DEV=$DEV_A
export COVERBS_VM_DEV_B=$DEV_B
export COVERBS_VM_NETIF_A=$NETIF_A
export COVERBS_VM_NETIF_B=$NETIF_B
export COVERBS_VM_ADDR_A=$ADDR_A
export COVERBS_VM_ADDR_B=$ADDR_B
export COVERBS_VM_ADDR6_A=$ADDR6_A
export COVERBS_VM_ADDR6_B=$ADDR6_B
export COVERBS_VM_NAME_A=coverbs-vm-a
export COVERBS_VM_GID_INDEX_A=$GID_A
export COVERBS_VM_GID_INDEX_B=$GID_B
EOF
[ "$ND" = wire ] && cat >> "$ENVFILE" <<EOF
export COVERBS_VM_NAME_B=coverbs-vm-b
export COVERBS_VM_WIRE_SIDE=$SIDE
export COVERBS_VM_ADDR_LOCAL=$LOCAL
export COVERBS_VM_ADDR6_LOCAL=$LOCAL6
export COVERBS_VM_NETIF=$NIC
export COVERBS_VM_WIRE_TOOL=$(cd "$(dirname "$0")" && pwd)/wire.sh
EOF
exit 0
