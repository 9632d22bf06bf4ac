#!/bin/bash
# Builds soft_rx_fuzzer.cc and the soft provider as a real libFuzzer binary
# with clang (gcc has no libFuzzer), ASan + UBSan; the fuzz target and the
# code under test get coverage feedback. Run by a genrule, so the build is
# cached and not part of the test's time.
#   usage: build_soft_rx_libfuzzer.sh <output> <source>...
set -euo pipefail
out=$1
shift
CLANG=${CLANG:-/usr/bin/clang++}
if [[ ! -x $CLANG ]]; then
  echo "$CLANG not found; the libFuzzer build needs clang" >&2
  exit 1
fi
objdir=$(mktemp -d)
trap 'rm -rf "$objdir"' EXIT
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I.
       -fsanitize=address,undefined -fno-sanitize-recover=all)
srcs=()
for s in "$@"; do [[ $s == *.cc ]] && srcs+=("$s"); done
printf '%s\n' "${srcs[@]}" | xargs -P 2 -I{} sh -c \
  'exec "$0" "$@" -fsanitize=fuzzer-no-link -c {} -o "'"$objdir"'/$(echo {} | tr / _).o"' \
  "$CLANG" "${flags[@]}"
"$CLANG" "${flags[@]}" -fsanitize=fuzzer "$objdir"/*.o -o "$out" \
  -luring -libverbs -lpthread \
  -labsl_status -labsl_statusor -labsl_strings -labsl_strings_internal \
  -labsl_str_format_internal -labsl_cord -labsl_cord_internal \
  -labsl_cordz_info -labsl_cordz_handle -labsl_cordz_functions \
  -labsl_base -labsl_int128 -labsl_raw_logging_internal \
  -labsl_throw_delegate -labsl_spinlock_wait -labsl_log_severity \
  -labsl_synchronization -labsl_time -labsl_time_zone -labsl_stacktrace \
  -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal \
  -labsl_malloc_internal -labsl_exponential_biased -labsl_strerror \
  -labsl_bad_optional_access -labsl_graphcycles_internal -labsl_civil_time \
  -labsl_raw_hash_set -labsl_hash -labsl_city -labsl_low_level_hash
