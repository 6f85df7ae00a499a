#!/usr/bin/env bash
# The README's main command: on a fresh Debian 12 machine, installs the
# dependencies, builds ctxcache, starts ctxcached on embedded defaults (its
# own RocksDB in a temp data dir), checks its health with the CLI and stops
# it cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${CTXCACHE_JOBS:-$(nproc)}"

echo "== installing dependencies"
./scripts/install-deps.sh
echo "== building (Release)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCTXCACHE_BUILD_TESTS=OFF -DCTXCACHE_BUILD_BENCH=OFF >/dev/null
cmake --build build -j"$JOBS" --target ctxcached ctxcache

WORK="$(mktemp -d /tmp/ctxcache-demo-XXXXXX)"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== starting ctxcached (data dir $WORK/data, log $WORK/ctxcached.log)"
./build/bin/ctxcached --data-dir "$WORK/data" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --port-file "$WORK/ports" >"$WORK/ctxcached.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  [ -s "$WORK/ports" ] && break
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "ctxcached exited early:"; cat "$WORK/ctxcached.log"; exit 1
  fi
  sleep 0.1
done
[ -s "$WORK/ports" ] || { echo "ctxcached did not start in 30 s"; cat "$WORK/ctxcached.log"; exit 1; }
PORT="$(sed -n 1p "$WORK/ports")"
SERVER="127.0.0.1:$PORT"
echo "== ctxcached is listening on $SERVER"

echo "== ctxcache health --server $SERVER"
./build/bin/ctxcache health --server "$SERVER"

echo "== stopping ctxcached (SIGTERM)"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
echo "ctxcached exited with status $?"
SERVER_PID=""
echo "== done"
