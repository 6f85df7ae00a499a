#!/usr/bin/env bash
# The README's test command: installs dependencies, builds everything
# (Release), runs the whole ctest suite, then builds the unit tests with
# AddressSanitizer + UndefinedBehaviorSanitizer and runs them too.
# Works on a fresh Debian 12 machine (as root, or with sudo).
#   CTXCACHE_SKIP_ASAN=1  skip the sanitizer pass (local iteration only)
#   CTXCACHE_JOBS=N       parallel build jobs (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${CTXCACHE_JOBS:-$(nproc)}"

# Compile time: a new build tree gets Ninja (an existing one keeps the
# generator it was made with), and the multi-file gRPC/protobuf targets compile
# as unity batches (CTXCACHE_UNITY_BUILD, CMakeLists.txt).
generator_for() {
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    echo "-GNinja"
  fi
}

echo "== [1/4] dependencies"
./scripts/install-deps.sh

echo "== [2/4] build (Release) into build/"
# shellcheck disable=SC2046  # an empty generator_for is no argument
cmake -S . -B build $(generator_for build) -DCMAKE_BUILD_TYPE=Release -DCTXCACHE_UNITY_BUILD=ON \
  -DCTXCACHE_BUILD_TESTS=ON -DCTXCACHE_BUILD_BENCH=ON
cmake --build build -j"$JOBS"

echo "== [3/4] ctest (all labels: unit, integration, crash, bench, golden)"
ctest --test-dir build --output-on-failure -j2 --timeout 600

if [ "${CTXCACHE_SKIP_ASAN:-0}" = "1" ]; then
  echo "== [4/4] sanitizers skipped (CTXCACHE_SKIP_ASAN=1)"
  exit 0
fi
echo "== [4/4] unit tests under ASan+UBSan into build-asan/"
# shellcheck disable=SC2046  # an empty generator_for is no argument
cmake -S . -B build-asan $(generator_for build-asan) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCTXCACHE_SANITIZE=address,undefined -DCTXCACHE_UNITY_BUILD=ON \
  -DCTXCACHE_BUILD_TESTS=ON -DCTXCACHE_BUILD_BENCH=OFF
cmake --build build-asan --target unit_tests -j"$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -L unit --output-on-failure -j2 --timeout 600
echo "== all tests passed"
