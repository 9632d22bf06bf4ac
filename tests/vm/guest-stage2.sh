# tests/vm/guest-stage2.sh <run-dir> - PID 1 of the guest after switch_root.
#
# Interpreted by the host's /bin/bash (the root is the host's / over 9p).
# run-in-vm.sh copies this file into the run dir for every boot, so editing it
# needs no setup.sh rerun. Deliberately no `set -e`/`set -u`: if PID 1 exits
# the kernel panics, and the host would only see "no exit status".
#
# Protocol with run-in-vm.sh (all files in the run dir):
#   in:  cmd (bash-quoted command line), cwd, env (export lines)
#   out: rc (exit status, written last), uptime.*, rdma-setup.log, dmesg.txt
#   the command's stdout+stderr go to /dev/ttyS1, which qemu pipes to the host.
RUN=$1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8
[ -w /root ] || HOME=/tmp
OUT=/dev/ttyS1

finish() {  # status
    dmesg > "$RUN/dmesg.txt" 2>/dev/null
    cat /proc/uptime > "$RUN/uptime.end" 2>/dev/null
    # rc is the host's signal that the guest finished: write it last, atomically.
    echo "$1" > "$RUN/rc.tmp" && mv "$RUN/rc.tmp" "$RUN/rc"
    sync
    exec /bin/busybox poweroff -f
}

cat /proc/uptime > "$RUN/uptime.stage2" 2>/dev/null
hostname coverbs-vm 2>/dev/null
ip link set lo up
# RDMA memory registration pins pages; the default 8 MiB memlock limit makes
# ibv_reg_mr fail with ENOMEM on anything non-trivial.
ulimit -l unlimited 2>/dev/null || echo "stage2: ulimit -l unlimited failed" >/dev/console
ulimit -n 65536 2>/dev/null
# raw: no \n -> \r\n translation on the way out.
stty -F $OUT raw -echo 2>/dev/null

. "$RUN/env"

if [ "${VM_RDMA:-none}" != none ]; then
    if ! bash "$RUN/vm-rdma-setup.sh" "$VM_RDMA" "${VM_NETDEV:-dummy}" "$RUN/rdma.env" \
            > "$RUN/rdma-setup.log" 2>&1; then
        { cat "$RUN/rdma-setup.log"
          echo "run-in-vm: RDMA setup ($VM_RDMA on ${VM_NETDEV:-dummy}) failed in the guest"; } > $OUT
        finish 125
    fi
    . "$RUN/rdma.env"
    [ "${VM_VERBOSE:-0}" = 1 ] && cat "$RUN/rdma-setup.log" > $OUT
fi

cd "$(cat "$RUN/cwd")" 2>/dev/null || { echo "run-in-vm: cwd $(cat "$RUN/cwd") not visible in the guest" > $OUT; finish 125; }
cat /proc/uptime > "$RUN/uptime.cmd" 2>/dev/null
# Output goes straight to the serial port (no pipe): a daemon the command
# leaves behind cannot keep us waiting for EOF.
bash "$RUN/cmd" < /dev/null > $OUT 2>&1
finish $?
