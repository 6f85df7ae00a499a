#!/usr/bin/env bash
# Long libFuzzer run of one fuzz target (fuzz/), or of all of them in turn.
#   scripts/fuzz.sh TARGET SECONDS [extra libFuzzer flags...]
#   scripts/fuzz.sh all SECONDS        # every target, SECONDS each
#   scripts/fuzz.sh list               # the target names
# Builds with clang (CTXCACHE_FUZZ=ON: libFuzzer + ASan + UBSan) into
# build-fuzz/, writes the generated seed corpus to build-fuzz/fuzz/seeds/,
# keeps the growing corpus in build-fuzz/fuzz/corpus/TARGET and any crash in
# build-fuzz/fuzz/artifacts/. The final "stat::" lines report the executions
# and peak RSS (docs/reliability.md, "Fuzzing").
#   CTXCACHE_JOBS=N   parallel build jobs (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  sed -n '2,12p' "$0"
  exit 2
fi
target="$1"
seconds="${2:-60}"
shift $(( $# >= 2 ? 2 : 1 ))
JOBS="${CTXCACHE_JOBS:-$(nproc)}"
targets=$(sed -n 's/^  "\(fuzz_[a-z_]*\):.*/\1/p' fuzz/CMakeLists.txt)
if [ "$target" = list ]; then
  echo "$targets"
  exit 0
fi
if [ "$target" != all ] && ! grep -qx "$target" <<<"$targets"; then
  echo "unknown target '$target'; one of:" $targets >&2
  exit 2
fi

cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS=-gline-tables-only -DCTXCACHE_FUZZ=ON \
  -DCTXCACHE_BUILD_TESTS=ON -DCTXCACHE_BUILD_BENCH=OFF >/dev/null
if [ "$target" = all ]; then run=$targets; else run=$target; fi
# shellcheck disable=SC2086
cmake --build build-fuzz -j"$JOBS" --target ctxcache_fuzz_seeds $run
build-fuzz/bin/ctxcache_fuzz_seeds build-fuzz/fuzz/seeds "$PWD"

status=0
for t in $run; do
  corpus=build-fuzz/fuzz/corpus/$t
  mkdir -p "$corpus" build-fuzz/fuzz/artifacts
  seeds=("build-fuzz/fuzz/seeds/$t")
  [ -d "fuzz/seeds/$t" ] && seeds+=("fuzz/seeds/$t")
  echo "== $t for ${seconds}s"
  build-fuzz/bin/$t -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix=build-fuzz/fuzz/artifacts/$t- "$@" \
    "$corpus" "${seeds[@]}" || status=$?
done
exit $status
