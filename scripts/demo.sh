#!/usr/bin/env bash
# The README's main command: on a fresh Debian 12 machine it
#   1. installs the dependencies, builds ctxcache and starts ctxcached on its
#      embedded defaults (its own RocksDB in a temp data dir, the reference
#      model from models/);
#   2. builds a context from a bundled ~9.5K-token document (held-out text of
#      the reference model's corpus) with a progress bar;
#   3. gives a continuation prompt and generates with sparse attention (csa,
#      5% of the context per step) and with full attention side by side;
#   4. prints both outputs, the greedy agreement, mean KL, bytes fetched per
#      step against dense, latency and wall time;
#   5. stops the server (SIGTERM: drain, close RocksDB, exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/demo-lib.sh
demo_build

echo "== starting ctxcached (data dir $WORK/data, log $WORK/ctxcached.log)"
START=$(date +%s)
demo_start_server --metrics-listen 127.0.0.1:0 --model-dir models --default-model ctxcache-ref
SERVER="127.0.0.1:$PORT"
echo "== ctxcached is listening on $SERVER"

echo "== ctxcache health --server $SERVER"
./build/bin/ctxcache health --server "$SERVER"

DOC=tests/data/demo/document.txt
echo "== ctxcache build --file $DOC (reference model ctxcache-ref, CSAttention index)"
BUILD_OUT="$(./build/bin/ctxcache --server "$SERVER" build --file "$DOC" --name demo-os-module \
  --label source=python3.11-doc --index csa)"
echo "$BUILD_OUT"
CONTEXT_ID="$(echo "$BUILD_OUT" | sed -n 's/^\(built\|reused existing\) context \([0-9a-f]\{32\}\):.*/\2/p')"
[ -n "$CONTEXT_ID" ] || { echo "could not read the context id"; exit 1; }
./build/bin/ctxcache --server "$SERVER" show "$CONTEXT_ID"

PROMPT=$'\n\n   Truncate the file corresponding to file descriptor'
echo "== ctxcache generate --method csa --compare full (prompt: \"Truncate the file corresponding to file descriptor\")"
./build/bin/ctxcache --server "$SERVER" --timeout 120 generate --context "$CONTEXT_ID" \
  --prompt "$PROMPT" --method csa --rho 0.05 --max-tokens 64 --compare full --model-dir models

echo "== stopping ctxcached (SIGTERM)"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
echo "ctxcached exited with status $?"
SERVER_PID=""
echo "== done in $(( $(date +%s) - START )) s"
