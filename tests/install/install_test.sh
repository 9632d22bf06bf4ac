#!/bin/bash
# coverbs used from outside Bazel: the install step lays out PREFIX, then
# the guide's echo server and client are built against it with pkg-config
# and with CMake (tests/install/CMakeLists.txt), and the client's call to
# the server must come back.
#   install_test.sh <install> <CMakeLists.txt> <guide_echo_server.cc> <guide_echo_client.cc>
set -u
install_bin="$1"
cmakelists="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
server_src="$(cd "$(dirname "$3")" && pwd)/$(basename "$3")"
client_src="$(cd "$(dirname "$4")" && pwd)/$(basename "$4")"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
server=""
trap '[[ -n "$server" ]] && kill -9 $server 2>/dev/null; wait 2>/dev/null' EXIT
fail() { echo "FAIL: $*"; exit 1; }

prefix="$tmp/prefix"
"$install_bin" "$prefix" || fail "install exited $?"
for f in include/coverbs/coverbs.h include/rpc/client_pool.h lib/libcoverbs.a \
  lib/pkgconfig/coverbs.pc lib/cmake/coverbs/coverbsConfig.cmake; do
  [[ -s "$prefix/$f" ]] || fail "$f not installed"
done
# Nothing of the build tree leaks into the layout.
find "$prefix" -name '*.o' -o -name 'BUILD' -o -name '*.cc' | grep -q . &&
  fail "build files in the installed tree"

# pkg-config: one compile and link per program.
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
pkg-config --exists coverbs || fail "pkg-config does not find coverbs"
mkdir -p "$tmp/pc"
for p in server client; do
  src=$server_src
  [[ $p == client ]] && src=$client_src
  # shellcheck disable=SC2046
  g++ -O1 "$src" -o "$tmp/pc/$p" $(pkg-config --cflags --libs coverbs) \
    >"$tmp/pc/$p.log" 2>&1 || { cat "$tmp/pc/$p.log"; fail "pkg-config build of $p"; }
done

# CMake.
mkdir -p "$tmp/cmake/src" "$tmp/cmake/build"
cp "$cmakelists" "$tmp/cmake/src/CMakeLists.txt"
cmake -S "$tmp/cmake/src" -B "$tmp/cmake/build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DGUIDE_DIR="$(dirname "$server_src")" -DCMAKE_BUILD_TYPE=Release \
  >"$tmp/cmake/configure.log" 2>&1 || { cat "$tmp/cmake/configure.log"; fail "cmake configure"; }
cmake --build "$tmp/cmake/build" -j 2 >"$tmp/cmake/build.log" 2>&1 ||
  { cat "$tmp/cmake/build.log"; fail "cmake build"; }

# Each pair serves one typed Echo call. The guide's programs take a fixed
# port: a few tries over random high ports in case one is taken.
run_pair() {  # dir
  local dir=$1 port out
  for _ in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 30000))
    COVERBS_PROVIDER=soft "$dir/$2" "$port" >"$tmp/server.log" 2>&1 &
    server=$!
    for _ in $(seq 100); do
      out=$(COVERBS_PROVIDER=soft timeout 20 "$dir/$3" "$port" 2>"$tmp/client.log") && break
      kill -0 "$server" 2>/dev/null || break
      sleep 0.1
    done
    kill -TERM "$server" 2>/dev/null
    wait "$server"
    local rc=$?
    server=""
    if [[ "$out" == hello ]]; then
      ((rc == 0)) || fail "$dir: server exited $rc after SIGTERM"
      return 0
    fi
  done
  echo "$out"; cat "$tmp/client.log" "$tmp/server.log"
  fail "$dir: no echo"
}
run_pair "$tmp/pc" server client
run_pair "$tmp/cmake/build" echo_server echo_client
echo "PASS: installed, built with pkg-config and CMake, echoed"
