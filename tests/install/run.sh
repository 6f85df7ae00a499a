#!/usr/bin/env bash
# Installs the build into a temp prefix, builds tests/install (a project that
# uses find_package(ctxcache) and ctxcache::client) against it, and runs it.
# Usage: tests/install/run.sh BUILD_DIR
set -euo pipefail
BUILD="$1"
SRC="$(cd "$(dirname "$0")" && pwd)"
TMP="$(mktemp -d /tmp/ctxcache-install-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
cmake --install "$BUILD" --prefix "$TMP/prefix" >/dev/null
cmake -S "$SRC" -B "$TMP/build" -DCMAKE_PREFIX_PATH="$TMP/prefix" >/dev/null
cmake --build "$TMP/build" >/dev/null
"$TMP/build/consumer"
