#!/bin/bash
# tests/vm/run-in-vm.sh [--check] <command> [args...]
#
# Boots Debian's kernel under qemu (TCG unless KVM is usable) with the host's /
# shared read-only over 9p, runs <command> as root in the current directory
# inside the guest, streams its stdout+stderr (merged) and exits with its
# status. Needs tests/vm/setup.sh to have been run.
#
# Env knobs:
#   VM_RDMA=none|rxe|siw     set up a soft-RDMA device first (default none)
#   VM_NETDEV=dummy|veth|lo|wire  netdev for VM_RDMA (default dummy); see vm-rdma-setup.sh
#   VM_WIRE=listen:PORT|connect:PORT  put the guest on a virtual wire: a
#                            virtio NIC on qemu's socket netdev at 127.0.0.1:PORT
#                            (run-in-vms.sh starts the listening side first)
#   VM_WIRE_SIDE=a|b         which end of the wire (sets the NIC's MAC and, with
#                            VM_NETDEV=wire, its addresses)
#   VM_PIDFILE=file          write qemu's pid there once it runs
#   VM_KILL_FLAG=file        if this file exists when qemu ended without an exit
#                            status, the guest was killed on purpose (run-in-vms.sh):
#                            say so and exit 137
#   VM_TIMEOUT=1800          seconds before qemu is killed (exit 124)
#   VM_BOOT_TIMEOUT=120      seconds for the guest to reach stage 2; a boot that
#                            does not is killed and retried once (0: off)
#   VM_SMP=2  VM_MEM=4G      guest CPUs / memory (memory is allocated lazily)
#   VM_TCG_THREAD=multi      multi|single; see README (one vCPU per host thread)
#   VM_ACCEL=auto            auto|tcg|kvm (auto: kvm when /dev/kvm is usable)
#   VM_RW="dir ..."          host dirs to mount writable at the same path
#   VM_RO="dir ..."          host dirs to mount read-only (only needed for dirs
#                            under /tmp, /var/tmp, /run, /dev/shm: the guest
#                            covers those with tmpfs; the cwd is added by itself)
#   VM_ENV="NAME ..."        extra env vars to forward (see below for the default set)
#   VM_LOGDIR=dir            copy console.log, dmesg.txt, rdma-setup.log there
#   VM_KEEP=1                keep the run dir; VM_CONSOLE=1 kernel console on stdout
#   VM_VERBOSE=1             show the RDMA setup log; VM_QUIET=1 no timing line
#   COVERBS_VM_BASE          cache dir of setup.sh (default /var/tmp/coverbs-vm)
#   COVERBS_VM_QEMU          qemu binary (default qemu-system-x86_64 from PATH)
#
# Forwarded into the guest: PATH (less version managers' shim dirs), VM_*,
# COVERBS_*, TEST_*, GTEST_*, RDMA_*, RUNFILES_*, *SAN_OPTIONS, LD_LIBRARY_PATH,
# TZ, TMPDIR (only if inside a VM_RW dir) and VM_ENV. Everything else gets guest defaults (HOME=/tmp, LANG=C.UTF-8).
# The guest sets COVERBS_VM=1, and with VM_RDMA the COVERBS_VM_* variables of
# vm-rdma-setup.sh.
#
# Exit status: the command's own, or
#   77  the harness is unavailable (no qemu, setup not run or stale): nothing booted
#   124 VM_TIMEOUT expired
#   125 the VM failed: no exit status came back (boot failure, guest crash) or
#       the in-guest RDMA setup failed
#   2   usage error
set -uo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
BASE=${COVERBS_VM_BASE:-/var/tmp/coverbs-vm}

unavailable() { echo "run-in-vm: VM harness unavailable: $*" >&2; exit 77; }

# ---------------------------------------------------------------- preflight
preflight() {
    QEMU=${COVERBS_VM_QEMU:-qemu-system-x86_64}
    QEMU=$(command -v "$QEMU" 2>/dev/null) && [ -x "$QEMU" ] ||
        unavailable "qemu binary '${COVERBS_VM_QEMU:-qemu-system-x86_64}' not found (install qemu-system-x86: tests/vm/setup.sh)"
    [ -r "$BASE/harness.env" ] ||
        unavailable "$BASE/harness.env missing: run tests/vm/setup.sh first"
    # shellcheck source=/dev/null
    . "$BASE/harness.env"
    [ -r "$COVERBS_VM_KERNEL" ] || unavailable "kernel $COVERBS_VM_KERNEL missing or unreadable: rerun tests/vm/setup.sh"
    [ -r "$COVERBS_VM_INITRD" ] || unavailable "initramfs $COVERBS_VM_INITRD missing: rerun tests/vm/setup.sh"
    [ "$(sha256sum < "$HERE/initramfs-init.sh" | cut -c1-64)" = "$COVERBS_VM_INIT_SHA" ] ||
        unavailable "initramfs is stale (tests/vm/initramfs-init.sh changed): rerun tests/vm/setup.sh"
}

# KVM only where a guest really boots on it. The build machines are
# themselves PVM guests (dmesg: "Hypervisor detected: PVM"; no vmx/svm in
# /proc/cpuinfo); where they have a /dev/kvm it is PVM's paravirtual device,
# and with qemu 7.2 every variant tried either aborted (`-cpu host`: "failed
# to set MSR 0x10a" at vCPU reset) or crawled (the kernel's decompressor
# wrote ~10 KB/s; an uncompressed kernel died emulating `lock cmpxchg16b`).
# So: boot the kernel with no root (it panics at once) and look for its
# banner within 10 s; anything else means TCG. The answer is kept per host boot in the cache dir; --check
# (run outside any sandbox, where that dir is writable) finds it out first.
kvm_cpu() {
    local cache="$BASE/kvm-probe.$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)"
    if [ -f "$cache" ]; then
        read -r ans < "$cache"
        [ "$ans" = no ] && return 1
        echo "$ans"; return 0
    fi
    local cpu log ans=no
    log=$(mktemp) || return 1
    for cpu in host host,-arch-capabilities; do
        : > "$log"
        timeout 10 "$QEMU" -nodefaults -no-user-config -accel kvm -cpu "$cpu" \
            -machine pc -smp 1 -m 256 -display none -no-reboot \
            -kernel "$COVERBS_VM_KERNEL" -append "console=ttyS0 panic=-1" \
            -serial "file:$log" </dev/null >/dev/null 2>&1
        if grep -q "Linux version" "$log"; then ans=$cpu; break; fi
    done
    rm -f "$log"
    echo "$ans" > "$cache" 2>/dev/null
    [ "$ans" = no ] && return 1
    echo "$ans"
}
select_accel() {
    TCG=(-accel "tcg,thread=${VM_TCG_THREAD:-multi}" -cpu max)
    case ${VM_ACCEL:-auto} in
        kvm) cpu=$(kvm_cpu) || { echo "run-in-vm: VM_ACCEL=kvm but a guest does not boot on KVM here" >&2; exit 125; }
             ACCEL=(-accel kvm -cpu "$cpu") ;;
        tcg) ACCEL=("${TCG[@]}") ;;
        *) ACCEL=("${TCG[@]}")
           if [ -r /dev/kvm ] && [ -w /dev/kvm ]; then
               if cpu=$(kvm_cpu); then ACCEL=(-accel kvm -cpu "$cpu")
               else echo "run-in-vm: /dev/kvm is there but a guest does not boot on it; using TCG" >&2; fi
           fi ;;
    esac
}

if [ "${1:-}" = --check ]; then
    preflight
    select_accel
    echo "run-in-vm: ready: $QEMU (${ACCEL[*]}), kernel $COVERBS_VM_KVER, $COVERBS_VM_INITRD"
    exit 0
fi
[ $# -ge 1 ] || { echo "usage: $0 [--check] <command> [args...]" >&2; exit 2; }
preflight

case ${VM_RDMA:=none} in none|rxe|siw) ;; *) echo "run-in-vm: VM_RDMA must be none|rxe|siw" >&2; exit 2 ;; esac
case ${VM_NETDEV:=dummy} in dummy|veth|lo|wire) ;; *) echo "run-in-vm: VM_NETDEV must be dummy|veth|lo|wire" >&2; exit 2 ;; esac
export VM_RDMA VM_NETDEV
# The wire: qemu's socket netdev carries the Ethernet frames of one virtio
# NIC in each guest over a TCP connection on the host's loopback.
WIRE=()
if [ -n "${VM_WIRE:-}" ]; then
    case ${VM_WIRE%%:*}:${VM_WIRE_SIDE:-} in
        listen:[ab] | connect:[ab]) ;;
        *) echo "run-in-vm: VM_WIRE must be listen:PORT or connect:PORT, with VM_WIRE_SIDE=a|b" >&2; exit 2 ;;
    esac
    mac=52:54:00:20:00:01; [ "$VM_WIRE_SIDE" = b ] && mac=52:54:00:20:00:02
    # shellcheck disable=SC2054  # commas belong to qemu option values
    WIRE=(-netdev "socket,id=wire,${VM_WIRE%%:*}=127.0.0.1:${VM_WIRE#*:}"
          -device "virtio-net-pci,netdev=wire,mac=$mac")
elif [ "$VM_NETDEV" = wire ] && [ "$VM_RDMA" != none ]; then
    echo "run-in-vm: VM_NETDEV=wire needs VM_WIRE (run-in-vms.sh sets it)" >&2; exit 2
fi

SMP=${VM_SMP:-2} MEM=${VM_MEM:-4G} TIMEOUT=${VM_TIMEOUT:-1800}
select_accel
# ---------------------------------------------------------------- run dir
# Per-boot directory, shared writable with the guest. Under TMPDIR (else Bazel's
# TEST_TMPDIR): in a Bazel sandbox those are writable, the cache dir is not.
RUN=$(mktemp -d "${TMPDIR:-${TEST_TMPDIR:-/tmp}}/coverbs-vm.XXXXXX") || { echo "run-in-vm: cannot create a run dir" >&2; exit 125; }
RUN=$(readlink -f "$RUN")
QEMU_PID='' CAT_PID=''
cleanup() {
    [ -n "$QEMU_PID" ] && kill -TERM "$QEMU_PID" 2>/dev/null
    [ "${VM_KEEP:-0}" = 1 ] || rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

cp "$HERE/guest-stage2.sh" "$HERE/vm-rdma-setup.sh" "$HERE/wire.sh" "$RUN/"
{ printf '%q ' "$@"; echo; } > "$RUN/cmd"
echo "$PWD" > "$RUN/cwd"

# ---------------------------------------------------------------- shares
# Paths travel on the kernel command line: refuse what would break its parsing.
SHARES=() QEMU_SHARES=() RW_DIRS=() ALL_DIRS=()
masked() {  # is $1 hidden in the guest by one of initramfs-init.sh's tmpfs?
    case "$1/" in /tmp/*|/var/tmp/*|/run/*|/dev/shm/*) return 0 ;; esac; return 1
}
add_share() {  # rw|ro path
    local d n
    d=$(readlink -f "$2") && [ -d "$d" ] || { echo "run-in-vm: VM_${1^^} entry '$2' is not a directory" >&2; exit 2; }
    case "$d" in *[[:space:],]*) echo "run-in-vm: cannot share '$d' (whitespace or comma)" >&2; exit 2 ;; esac
    n=${#QEMU_SHARES[@]}
    SHARES+=("$d $1$n")
    [ "$1" = rw ] && RW_DIRS+=("$d")
    ALL_DIRS+=("$d")
    local ro=; [ "$1" = ro ] && ro=,readonly=on
    QEMU_SHARES+=(-virtfs "local,path=$d,mount_tag=$1$n,security_model=none,multidevs=remap$ro")
}
for d in ${VM_RW:-}; do add_share rw "$d"; done
for d in ${VM_RO:-}; do add_share ro "$d"; done
under() {  # is path $1 at or below one of the dirs "${@:2}"?
    local p=$1 d; shift
    for d in "$@"; do case "$p/" in "$d"/*) return 0 ;; esac; done; return 1
}
CWD_P=$(pwd -P)
if masked "$CWD_P" && ! under "$CWD_P" "${ALL_DIRS[@]}"; then add_share ro "$CWD_P"; fi
# Parents before children, so a nested share is not hidden by its parent's mount.
SHARELIST=
[ ${#SHARES[@]} -eq 0 ] ||
    SHARELIST=$(printf '%s\n' "${SHARES[@]}" | sort | awk '{ printf "%s%s:%s", sep, $2, $1; sep="," }')

# ---------------------------------------------------------------- env
{
    for v in $(compgen -e); do
        case $v in
            VM_*|COVERBS_*|TEST_*|GTEST_*|RDMA_*|RUNFILES_*|*SAN_OPTIONS|LD_LIBRARY_PATH|TZ) ;;
            TMPDIR) under "$(readlink -f "$TMPDIR")" "${RW_DIRS[@]}" || continue ;;
            *) case " ${VM_ENV:-} " in *" $v "*) ;; *) continue ;; esac ;;
        esac
        printf 'export %s=%q\n' "$v" "${!v}"
    done
    # The guest sees the host's files, so the host PATH finds the same tools;
    # sbin dirs are appended for the guest-side setup (modprobe, ip, rdma).
    # Version managers' shim dirs (pyenv, rbenv, asdf: .../shims) are left
    # out: a shim is a bash script that forks ~30 processes per call, and one
    # `python3` through pyenv's took 10-20 s under TCG at load 5-10 (the
    # guest then runs the system's python3, which tools/install-deps.sh
    # installs).
    guest_path=
    IFS=: read -ra path_dirs <<<"$PATH"
    for d in "${path_dirs[@]}"; do
        case $d in */shims) continue ;; esac
        guest_path+=${guest_path:+:}$d
    done
    printf 'export PATH=%q\n' "$guest_path:/usr/local/sbin:/usr/sbin:/sbin"
    echo "export COVERBS_VM=1"
} > "$RUN/env"

APPEND="console=ttyS0 panic=-1 quiet loglevel=4 mitigations=off coverbs.run=$RUN"
[ -n "$SHARELIST" ] && APPEND+=" coverbs.shares=$SHARELIST"
[ ${#APPEND} -lt 2000 ] || { echo "run-in-vm: kernel command line too long (shared paths too long)" >&2; exit 2; }

# shellcheck disable=SC2054  # commas belong to qemu option values
if [ "${VM_CONSOLE:-0}" = 1 ]; then CONSOLE=(-chardev stdio,id=con,signal=off -serial chardev:con)
else CONSOLE=(-serial "file:$RUN/console.log"); fi

# ---------------------------------------------------------------- boot
# ttyS1 carries the command's output. qemu's file chardev *opens* its path; on
# /proc/self/fd/3 that yields the same pipe when fd 3 is a pipe, whereas
# reopening a regular file (Bazel's test.log) would truncate it and write at
# its own offset. Hence the pipe through cat.
exec 3> >(exec cat)
CAT_PID=$!
# A guest reaches stage 2 in 5-9 s of its uptime under TCG. Rarely (once in
# a few hundred boots, at host load 5) it never does: nothing on the
# console, no stage 2, and the test used to wait out its whole VM_TIMEOUT.
# Such a boot is killed after VM_BOOT_TIMEOUT seconds and booted once more;
# the command has not started then, so running it on the second boot is
# safe. A hang after stage 2 is the command's own and is not retried.
BOOT_TIMEOUT=${VM_BOOT_TIMEOUT:-120}
t0=$(date +%s.%N)
boot() {  # $1: seconds left
    timeout -k 10 "$1" "$QEMU" -nodefaults -no-user-config -nic none -no-reboot \
        -machine pc "${ACCEL[@]}" -smp "$SMP" -m "$MEM" -display none -vga none \
        "${CONSOLE[@]}" -chardev file,id=out,path=/proc/self/fd/3 -serial chardev:out \
        -kernel "$COVERBS_VM_KERNEL" -initrd "$COVERBS_VM_INITRD" -append "$APPEND" \
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
        -virtfs "local,path=$RUN,mount_tag=run,security_model=none,multidevs=remap" \
        "${QEMU_SHARES[@]}" "${WIRE[@]}" < /dev/null &
    QEMU_PID=$!
    [ -z "${VM_PIDFILE:-}" ] || echo "$QEMU_PID" > "$VM_PIDFILE"
}
elapsed() { awk "BEGIN { printf \"%d\", $(date +%s.%N) - $t0 }"; }
for attempt in 1 2; do
    boot $((TIMEOUT - $(elapsed)))
    if [ "$attempt" = 1 ] && [ "$BOOT_TIMEOUT" -gt 0 ] && [ "$BOOT_TIMEOUT" -lt "$TIMEOUT" ]; then
        start=$SECONDS
        while kill -0 "$QEMU_PID" 2>/dev/null && [ ! -e "$RUN/uptime.stage2" ] &&
            ((SECONDS - start < BOOT_TIMEOUT)); do
            sleep 0.5
        done
        # Still running without stage 2: the boot hung.
        if kill -0 "$QEMU_PID" 2>/dev/null && [ ! -e "$RUN/uptime.stage2" ]; then
            echo "run-in-vm: the guest did not reach stage 2 in ${BOOT_TIMEOUT}s (VM_BOOT_TIMEOUT); booting once more. Console tail:" >&2
            tail -n 20 "$RUN/console.log" >&2 2>/dev/null
            kill -TERM "$QEMU_PID" 2>/dev/null  # timeout passes it on to qemu
            wait "$QEMU_PID" 2>/dev/null
            [ -f "$RUN/console.log" ] && mv "$RUN/console.log" "$RUN/console.boot1.log"
            continue
        fi
    fi
    wait "$QEMU_PID"; qrc=$?
    break
done
QEMU_PID=
t1=$(date +%s.%N)
exec 3>&-
wait "$CAT_PID" 2>/dev/null

up() { cut -d' ' -f1 "$RUN/uptime.$1" 2>/dev/null || echo '?'; }
if [ -f "$RUN/rc" ]; then
    rc=$(cat "$RUN/rc")
elif [ -n "${VM_KILL_FLAG:-}" ] && [ -e "$VM_KILL_FLAG" ]; then
    echo "run-in-vm: the guest was killed on request (VM_KILL_FLAG)" >&2
    rc=137
elif [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
    echo "run-in-vm: timed out after ${TIMEOUT}s (VM_TIMEOUT); kernel console tail:" >&2
    tail -n 20 "$RUN/console.log" >&2 2>/dev/null
    rc=124
else
    echo "run-in-vm: the guest did not report an exit status (qemu exit $qrc); kernel console tail:" >&2
    tail -n 30 "$RUN/console.log" >&2 2>/dev/null
    rc=125
fi
if [ -n "${VM_LOGDIR:-}" ]; then
    mkdir -p "$VM_LOGDIR" &&
        for f in console.log dmesg.txt rdma-setup.log; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$VM_LOGDIR/"; done
fi
[ "${VM_QUIET:-0}" = 1 ] ||
    printf 'run-in-vm: exit %s, host wall %.1fs (%s); guest uptime: stage2 %ss, command start %ss, end %ss\n' \
        "$rc" "$(awk "BEGIN { print $t1 - $t0 }")" "${ACCEL[*]}" "$(up stage2)" "$(up cmd)" "$(up end)" >&2
exit "$rc"
