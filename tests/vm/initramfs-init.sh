#!/bin/busybox sh
# tests/vm/initramfs-init.sh - /init of the guest initramfs (busybox only).
#
# The guest has no disk: its root is the host's / exported read-only over 9p,
# so host binaries, libraries, kernel modules and Bazel runfiles (absolute
# symlinks included) are all visible at the same paths as on the host. This
# stage mounts that root, puts tmpfs over the places programs expect to write,
# mounts the writable shares run-in-vm.sh asked for, then switch_root's into the
# host root and hands over to guest-stage2.sh (run by the host's bash).
#
# switch_root rather than chroot: the kernel's module auto-loader runs
# /sbin/modprobe of the *current root*, which must be the host's.
#
# Kernel command line (written by run-in-vm.sh):
#   coverbs.run=/path      run dir (also shared under the 9p tag "run")
#   coverbs.shares=tag:/path,...   extra shares; tag rwN = writable, roN = read-only
#   coverbs.msize=N        9p message size
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null

fail() {
    echo "coverbs-vm init: $*" > /dev/console
    # No status file is written: the host reports "guest did not report an exit status".
    poweroff -f
}

for m in $(cat /lib/modules/order); do
    insmod "/lib/modules/$m" || fail "insmod $m failed"
done

RUN='' SHARES='' MSIZE=524288
for kv in $(cat /proc/cmdline); do
    case "$kv" in
        coverbs.run=*) RUN=${kv#*=} ;;
        coverbs.shares=*) SHARES=${kv#*=} ;;
        coverbs.msize=*) MSIZE=${kv#*=} ;;
    esac
done
[ -n "$RUN" ] || fail "no coverbs.run= on the kernel command line"
O9P="trans=virtio,version=9p2000.L,msize=$MSIZE"

R=/newroot
# cache=loose: the host root does not change under a test run, and caching
# makes exec-ing binaries and reading libraries much cheaper under TCG.
mount -t 9p -o "ro,$O9P,cache=loose" hostroot $R || fail "mounting the host root failed"

mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev    # creates /dev/infiniband/* with usable modes, no udev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
# The root is read-only: give the usual scratch places fresh tmpfs. This hides
# the host's /tmp, /var/tmp and /run inside the guest (run-in-vm.sh shares what
# it needs from there explicitly).
mount -t tmpfs -o mode=1777 tmpfs $R/tmp
mount -t tmpfs -o mode=1777 tmpfs $R/var/tmp
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
mount -t tmpfs -o mode=755 tmpfs $R/run

mount_share() {  # tag path
    case "$1" in ro*) o="ro,$O9P,cache=loose" ;; *) o="rw,$O9P,cache=none" ;; esac
    # mkdir only succeeds under one of the tmpfs above; elsewhere the directory
    # already exists in the read-only host view.
    mkdir -p "$R$2" 2>/dev/null
    mount -t 9p -o "$o" "$1" "$R$2" || fail "mounting share $1 on $2 failed"
}
# run-in-vm.sh orders shares parent-first.
IFS=,
for e in $SHARES; do mount_share "${e%%:*}" "${e#*:}"; done
unset IFS
mount_share run "$RUN"

mkdir -p $R/run/coverbs-vm
cp /lib/modules/siw.ko.extra $R/run/coverbs-vm/siw.ko

umount /dev /sys /proc 2>/dev/null
# shellcheck disable=SC2093  # the line after only runs if switch_root fails
exec switch_root $R /bin/bash "$RUN/guest-stage2.sh" "$RUN"
fail "switch_root failed"
