#!/usr/bin/env bash
# Writes the reference trace (docs/trace-format.md) that the fidelity and index
# benches and tests/model/trace_test.cc read: tests/data/demo/document.txt with
# BOS (9,516 tokens) through models/ctxcache-ref, layers 3 and 7, both kv heads,
# queries of the last 2,048 positions, bf16 (about 14 MB, 20-40 s on 2 cores).
# Generated, not committed. Usage: scripts/make-ref-trace.sh BIN_DIR OUT_FILE
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:?usage: make-ref-trace.sh BIN_DIR OUT_FILE}"
out="${2:?usage: make-ref-trace.sh BIN_DIR OUT_FILE}"
mkdir -p "$(dirname "$out")"
"$bin/ctxcache-bench" trace --model "$root/models/ctxcache-ref" \
  --text "$root/tests/data/demo/document.txt" --out "$out.tmp" \
  --bos --layers 3,7 --q-last 2048 --dtype bf16
mv -f "$out.tmp" "$out"
