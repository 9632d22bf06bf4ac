#!/bin/bash
# tests/vm/setup.sh - prepare the cache that run-in-vm.sh boots from.
#
# The host kernel has no RDMA stack and there is no KVM, so RDMA tests run in a
# qemu/TCG guest booting Debian's own kernel. This script:
#   1. installs the Debian packages of tests/vm/packages.txt that are missing,
#   2. picks the guest kernel (the one linux-image-amd64 depends on),
#   3. builds siw.ko out of tree (Debian ships CONFIG_RDMA_SIW unset),
#   4. builds a small busybox initramfs whose /init mounts the host / over 9p.
#
# Idempotent: every product is keyed by what it was built from and a rerun with
# nothing changed only checks keys (well under a second). Safe to run
# concurrently (flock). Needs root only when something must be apt-installed.
#
# Env: COVERBS_VM_BASE   cache dir (default /var/tmp/coverbs-vm)
#      COVERBS_VM_KVER   force a kernel version, e.g. 6.1.0-56-amd64
#      COVERBS_VM_NO_APT=1  never call apt-get (fail instead)
#      COVERBS_VM_HOST_INITRD=1  let apt build a host initrd for the installed kernel
set -euo pipefail

HERE=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
BASE=${COVERBS_VM_BASE:-/var/tmp/coverbs-vm}
export DEBIAN_FRONTEND=noninteractive

log() { echo "setup: $*" >&2; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

mkdir -p "$BASE"
exec 9>"$BASE/.lock"
flock 9

# ---------------------------------------------------------------- packages
# One dpkg-query for the whole list keeps the warm path fast.
installed() {  # prints the subset of "$@" that is installed
    # dpkg-query exits 1 when any name is unknown: that is not an error here.
    { dpkg-query -W -f='${Package} ${db:Status-Status}\n' "$@" 2>/dev/null || true; } |
        awk '$2 == "installed" { sub(/:.*/, "", $1); print $1 }'
}
missing() {
    local have
    have=$(installed "$@" | sort -u)
    for p in "$@"; do grep -qxF "$p" <<<"$have" || echo "$p"; done
}
apt_install() {
    [ "${COVERBS_VM_NO_APT:-0}" = 1 ] && die "missing packages: $* (COVERBS_VM_NO_APT=1)"
    [ "$(id -u)" = 0 ] || die "missing packages: $* -- run as root, or tools/install-deps.sh --vm"
    log "apt-get install $*"
    # Installing linux-image-* normally builds a host initrd for it (update-initramfs,
    # ~1.5 min, twice with the trigger) that the VM never uses: our guest boots
    # with its own initramfs. Skip it, but only where the host does not boot
    # kernels from /boot (container, CI VM with an external kernel): on a real
    # Debian host a new kernel without an initrd could become unbootable.
    if [ ! -e "/boot/vmlinuz-$(uname -r)" ] && [ "${COVERBS_VM_HOST_INITRD:-0}" != 1 ]; then
        export INITRD=No
    fi
    # A stale or empty package index is the usual failure: refresh once, retry.
    apt-get install -y -q --no-install-recommends "$@" ||
        { apt-get update -q && apt-get install -y -q --no-install-recommends "$@"; }
}

mapfile -t PKGS < <(grep -v '^[[:space:]]*$' "$HERE/packages.txt")
mapfile -t MISSING < <(missing "${PKGS[@]}")
[ ${#MISSING[@]} -eq 0 ] || apt_install "${MISSING[@]}"

# ---------------------------------------------------------------- kernel
# Default to the kernel the linux-image-amd64 metapackage points at rather than
# the newest under /lib/modules: that is what a fresh CI machine gets, so local
# runs and CI runs boot the same thing.
KVER=${COVERBS_VM_KVER:-}
if [ -z "$KVER" ]; then
    KVER=$(dpkg-query -W -f='${Depends}' linux-image-amd64 | grep -oE 'linux-image-[0-9][^ ,]*' | head -1)
    KVER=${KVER#linux-image-}
fi
[ -n "$KVER" ] || die "cannot tell which kernel linux-image-amd64 installs"
KERNEL=/boot/vmlinuz-$KVER
[ -r "$KERNEL" ] || die "$KERNEL missing or unreadable"
[ -d "/lib/modules/$KVER/kernel" ] || die "/lib/modules/$KVER missing"
# linux-image-X is built from linux-signed-amd64 (source version 6.1.192+2),
# but its own version (6.1.192-2) is that of the linux tree linux-source has.
KPKG_VER=$(dpkg-query -W -f='${Version}' "linux-image-$KVER" 2>/dev/null || echo unknown)
KDIR=$BASE/kernels/$KVER
mkdir -p "$KDIR"

# ---------------------------------------------------------------- siw.ko
# Keyed by kernel package version: a rebuilt linux-image with the same ABI name
# still gets a fresh module.
SIW=$KDIR/siw.ko
SIW_KEY="$KVER $KPKG_VER"
if [ ! -s "$SIW" ] || [ "$(cat "$KDIR/siw.key" 2>/dev/null)" != "$SIW_KEY" ]; then
    t0=$SECONDS
    mapfile -t MISSING < <(missing "linux-headers-$KVER")
    [ ${#MISSING[@]} -eq 0 ] || apt_install "${MISSING[@]}"
    SRCPKG=linux-source-$(echo "$KVER" | cut -d. -f1,2)      # 6.1.0-56-amd64 -> 6.1
    WORK=$(mktemp -d "$BASE/siw-build.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    # apt-get download runs as _apt when it can; a world-writable dir avoids the
    # "unsandboxed download" warning.
    chmod 1777 "$WORK"
    download() { (cd "$WORK" && apt-get download -q "$1"); }
    log "downloading $SRCPKG=$KPKG_VER to build siw.ko"
    # The exact version matches the kernel; if the mirror dropped it, any
    # source of the same ABI name builds a loadable module (vermagic checked below).
    download "$SRCPKG=$KPKG_VER" ||
        { apt-get update -q && download "$SRCPKG=$KPKG_VER"; } ||
        { log "WARNING: $SRCPKG=$KPKG_VER unavailable, using the candidate version"; download "$SRCPKG"; }
    mkdir "$WORK/siw"
    # Only drivers/infiniband/sw/siw is needed out of the ~140 MB tarball.
    dpkg-deb --fsys-tarfile "$WORK"/"${SRCPKG}"_*.deb |
        tar -xO "./usr/src/$SRCPKG.tar.xz" |
        tar -xJ -C "$WORK/siw" --strip-components=5 "$SRCPKG/drivers/infiniband/sw/siw"
    make -s -C "/lib/modules/$KVER/build" M="$WORK/siw" CONFIG_RDMA_SIW=m modules >&2
    modinfo -F vermagic "$WORK/siw/siw.ko" | grep -q "^$KVER " ||
        die "siw.ko vermagic does not match $KVER"
    strip --strip-debug -o "$SIW.tmp" "$WORK/siw/siw.ko"
    mv "$SIW.tmp" "$SIW"
    echo "$SIW_KEY" > "$KDIR/siw.key"
    rm -rf "$WORK"; trap - EXIT
    log "built siw.ko for $KVER in $((SECONDS - t0))s"
fi

# ---------------------------------------------------------------- initramfs
# The key covers everything that goes into the image. run-in-vm.sh separately
# refuses an image whose /init differs from the checked-out initramfs-init.sh.
BUSYBOX=/bin/busybox
INIT_SHA=$(sha256sum < "$HERE/initramfs-init.sh" | cut -c1-64)
IR_KEY=$( { cat "$HERE/setup.sh" "$HERE/initramfs-init.sh"
            echo "$KVER $KPKG_VER"; sha256sum < "$SIW"; sha256sum < "$BUSYBOX"; } |
          sha256sum | cut -c1-16)
INITRD=$KDIR/initramfs-$IR_KEY.cpio.gz
if [ ! -s "$INITRD" ]; then
    t0=$SECONDS
    IR=$(mktemp -d "$BASE/initramfs.XXXXXX")
    trap 'rm -rf "$IR"' EXIT
    mkdir -p "$IR"/{bin,dev,proc,sys,newroot,run-share,lib/modules}
    cp "$BUSYBOX" "$IR/bin/busybox"
    # Just enough to mount 9p over virtio-pci; everything else the guest loads
    # later from the host's /lib/modules through the 9p root. Builtins show up
    # as "builtin ..." and are skipped.
    for m in virtio_pci 9pnet_virtio 9p; do
        modprobe -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" { print $2 }'
    done | awk '!seen[$0]++' | while read -r ko; do
        cp "$ko" "$IR/lib/modules/"
        basename "$ko" >> "$IR/lib/modules/order"
    done
    # siw.ko travels in the image: the cache dir is usually under /var/tmp,
    # which the guest covers with a tmpfs.
    cp "$SIW" "$IR/lib/modules/siw.ko.extra"
    install -m 755 "$HERE/initramfs-init.sh" "$IR/init"
    (cd "$IR" && find . | sort | cpio -o -H newc --quiet -R 0:0 | gzip -1) > "$INITRD.tmp"
    mv "$INITRD.tmp" "$INITRD"
    rm -rf "$IR"; trap - EXIT
    find "$KDIR" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "${INITRD##*/}" -delete
    log "built ${INITRD##*/} ($(du -k "$INITRD" | cut -f1) KiB) in $((SECONDS - t0))s"
fi

# ---------------------------------------------------------------- result
# run-in-vm.sh sources this; write it atomically so a concurrent reader never
# sees half a file.
cat > "$BASE/harness.env.tmp" <<EOF
COVERBS_VM_KVER=$KVER
COVERBS_VM_KERNEL=$KERNEL
COVERBS_VM_INITRD=$INITRD
COVERBS_VM_INIT_SHA=$INIT_SHA
EOF
if cmp -s "$BASE/harness.env.tmp" "$BASE/harness.env"; then rm "$BASE/harness.env.tmp"
else mv "$BASE/harness.env.tmp" "$BASE/harness.env"; fi
log "ready: kernel $KVER, ${INITRD#"$BASE"/} (cache $BASE)"
