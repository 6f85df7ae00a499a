#!/usr/bin/env bash
# The cluster tests (tests/cluster) as a ctest: a venv of their own (like
# tests/python/run.sh, which may run at the same time) with ./python
# installed without any index, then pytest with a real etcd (Debian's
# etcd-server, /usr/bin/etcd) and real ctxcached processes on loopback.
#   usage: tests/cluster/run.sh SOURCE_DIR BUILD_DIR [pytest args...]
#   default pytest args: -m "not long and not load" (ctest cluster);
#   ctest cluster_long: -m long; ctest cluster_load: -m load
set -euo pipefail
src="$(cd "$1" && pwd)"
build="$(mkdir -p "$2" && cd "$2" && pwd)"
shift 2
if [ ! -x /usr/bin/etcd ]; then
  echo "tests/cluster: /usr/bin/etcd missing: apt-get install etcd-server (scripts/install-deps.sh)" >&2
  exit 1
fi
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3
venv="$build/cluster-venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONDONTWRITEBYTECODE=1
export CTXCACHE_BIN_DIR="${CTXCACHE_BIN_DIR:-$build/bin}"
export CTXCACHE_MODEL_DIR="${CTXCACHE_MODEL_DIR:-$src/tests/data/golden}"
"$PYTHON" -m venv --clear --system-site-packages "$venv"
# Build from a copy: tests/python/run.sh may be building ./python right now.
pkg="$build/cluster-venv/src-python"
rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$src/python/." "$pkg/"
rm -rf "$pkg/build" "$pkg/ctxcache.egg-info"
export CTXCACHE_PROTO_DIR="$src/proto"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation --no-cache-dir "$pkg"
cd "$src/tests/cluster"
if [ $# -eq 0 ]; then set -- -m "not long and not load"; fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
