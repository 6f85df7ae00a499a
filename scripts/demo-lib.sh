# shellcheck shell=bash
# Shared by the README's example scripts (scripts/demo.sh,
# scripts/secure-demo.sh): source it from the repository root.
#   demo_build                 install dependencies and build (Release), unless
#                              CTXCACHE_DEMO_SKIP_BUILD=1 (the ctests set it)
#   demo_start_server ARGS...  start build/bin/ctxcached in $WORK with ARGS on
#                              an ephemeral port of $DEMO_LISTEN's host
#                              (default 127.0.0.1); sets SERVER_PID and PORT
# $WORK (a temp dir) is removed and the server stopped (SIGTERM) on exit.

demo_build() {
  if [ "${CTXCACHE_DEMO_SKIP_BUILD:-0}" != "1" ]; then
    echo "== installing dependencies"
    ./scripts/install-deps.sh
    echo "== building (Release)"
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build -j"${CTXCACHE_JOBS:-$(nproc)}" --target ctxcached ctxcache ctxcache_spm
  fi
}

WORK="$(mktemp -d /tmp/ctxcache-demo-XXXXXX)"
SERVER_PID=""
demo_cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap demo_cleanup EXIT

demo_start_server() {
  ./build/bin/ctxcached --data-dir "$WORK/data" --listen "${DEMO_LISTEN:-127.0.0.1:0}" --port-file "$WORK/ports" \
    "$@" >"$WORK/ctxcached.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    [ -s "$WORK/ports" ] && break
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "ctxcached exited early:"; cat "$WORK/ctxcached.log"; exit 1
    fi
    sleep 0.1
  done
  [ -s "$WORK/ports" ] || { echo "ctxcached did not start in 30 s"; cat "$WORK/ctxcached.log"; exit 1; }
  # shellcheck disable=SC2034  # PORT is read by the scripts that source this file
  PORT="$(sed -n 1p "$WORK/ports")"
}
