#!/usr/bin/env bash
# The Python package's tests (python/tests) against the real ctxcached, as a
# ctest: creates a venv with --system-site-packages (Debian's python3-grpcio,
# python3-protobuf, python3-numpy, python3-pytest; scripts/install-deps.sh),
# installs ./python into it without any index (pip --no-index
# --no-build-isolation: the build generates the protobuf stubs from proto/),
# then runs pytest. ctxcached must already be built in <build dir>/bin (the
# README's test command builds everything before ctest).
#   usage: tests/python/run.sh [SOURCE_DIR] [BUILD_DIR]
#   PYTHON=...  interpreter for the venv (default: Debian's /usr/bin/python3,
#               whose dist-packages hold the python3-* packages)
set -euo pipefail
src="$(cd "${1:-$(dirname "$0")/../..}" && pwd)"
build="$(mkdir -p "${2:-$src/build}" && cd "${2:-$src/build}" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x /usr/bin/python3 ]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
venv="$build/python-venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONDONTWRITEBYTECODE=1
export CTXCACHE_BIN_DIR="${CTXCACHE_BIN_DIR:-$build/bin}"
export CTXCACHE_MODEL_DIR="${CTXCACHE_MODEL_DIR:-$src/tests/data/golden}"

echo "== venv $venv ($("$PYTHON" --version 2>&1), system site packages)"
"$PYTHON" -m venv --clear --system-site-packages "$venv"
echo "== pip install --no-index --no-build-isolation $src/python"
# setuptools keeps stale modules in build/lib and stale file lists in *.egg-info
rm -rf "$src/python/build" "$src/python/ctxcache.egg-info"
# What the install writes into the checkout (build/, *.egg-info, the generated
# stubs) must be ignored: git sees no new file (python/.gitignore).
untracked() { git -C "$src" ls-files --others --exclude-standard -- python | sort; }
in_git=0
if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then in_git=1; fi
[ "$in_git" = 1 ] && untracked > "$build/python-untracked.before"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation --no-cache-dir \
  "$src/python"
if [ "$in_git" = 1 ]; then
  new="$(untracked | comm -13 "$build/python-untracked.before" -)"
  if [ -n "$new" ]; then
    echo "pip install ./python left files git does not ignore:"
    echo "$new"
    exit 1
  fi
fi
"$venv/bin/python" -c 'import ctxcache, google.protobuf, grpc, sys
print("ctxcache from", ctxcache.__file__)
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "python", sys.version.split()[0])'
echo "== pytest python/tests (CTXCACHE_BIN_DIR=$CTXCACHE_BIN_DIR)"
cd "$src"
exec "$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider \
  --model-dir "$CTXCACHE_MODEL_DIR"
