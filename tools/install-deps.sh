#!/bin/bash
# Installs every Debian 12 package coverbs needs, and nothing else.
# Idempotent: when everything is present it only checks (no apt-get update).
#
#   tools/install-deps.sh          build + test dependencies
#   tools/install-deps.sh --vm     also the VM harness (qemu, kernel, rdma-core
#                                  tools, perftest) used by tests/vm and bench
#   tools/install-deps.sh --tools  also valgrind (callgrind instruction counts)
#                                  and ucx-utils (ucx_perftest: UCX's tcp
#                                  transport as the latency reference in
#                                  bench/compare_ucx.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(
  bazel-bootstrap    # Bazel 4.2.3 (brings a headless JDK)
  g++ pkg-config
  libibverbs-dev librdmacm-dev ibverbs-providers
  liburing-dev
  libboost-dev       # header-only Boost.Asio (1.74)
  libabsl-dev
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  clang libclang-rt-14-dev     # the rpc wire decoder's libFuzzer target
  python3            # coverbs_bench_test checks the JSON output
  libmsgpack-cxx-dev # rpc/codec.h: typed methods' plain structs (msgpack-c++)
  libprotobuf-dev protobuf-compiler  # typed methods with protobuf messages
  prometheus-cpp-dev # //rpc:metrics: Prometheus export (optional target)
  cmake make         # tests/install: a service built with CMake against the
                     # installed tree (bazel run //:install)
  curl prometheus    # the metrics tests scrape /metrics (curl) and lint it (promtool)
)
for arg in "$@"; do
  case "$arg" in
    --vm)
      while read -r p _; do
        [[ -z "$p" || "$p" == \#* ]] && continue
        PKGS+=("$p")
      done < tests/vm/packages.txt
      ;;
    # valgrind: callgrind counts instructions per op (bench/callgrind_cost.sh).
    # ucx-utils: ucx_perftest, UCX's own benchmark, which bench/compare_ucx.sh
    # runs over UCX's tcp transport as the field's reference for latency and
    # message rate on the same loopback as the soft provider.
    --tools) PKGS+=(valgrind ucx-utils) ;;
    *) echo "usage: $0 [--vm] [--tools]" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' ||
    missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "install-deps: installing ${#missing[@]} package(s) and what they depend on: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # linux-image-amd64 (--vm) is the kernel the VM boots with its own
  # initramfs; apt would also build a host initrd for it (twice, ~1.5 min
  # each, 31 MB in /boot) that nothing uses. Skip that, as tests/vm/setup.sh
  # does, where the host does not boot kernels from /boot (container, CI VM);
  # on a real Debian host a kernel without an initrd may not boot.
  if [[ ! -e "/boot/vmlinuz-$(uname -r)" && "${COVERBS_VM_HOST_INITRD:-0}" != 1 ]]; then
    export INITRD=No
    echo "install-deps: INITRD=No (this host does not boot from /boot): no host initrd is built"
  fi
  apt-get update -qq
  # Debian's bazel-rules-* packages do not fit Bazel 4.2.3: no recommends.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install-deps: installed ${missing[*]}"
else
  echo "install-deps: all ${#PKGS[@]} package(s) present"
fi
