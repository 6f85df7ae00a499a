#!/usr/bin/env bash
# Unpacks the shipped model weights in place: models/**/X.safetensors.xz ->
# models/**/X.safetensors (gitignored). The weights are committed xz-compressed
# so the tracked tree stays small enough to travel to the GPU machine
# (tests/repo/tree_size_test.sh). Idempotent: a target newer than its .xz is
# kept. Writes to a temp file and renames, so an interrupted run leaves no
# truncated shard. Uses xz(1), or Python's lzma where xz is absent.
#   unpack-models.sh [ROOT [DIR]]   ROOT: the repository (default: this script's);
#   DIR: the folder searched instead of ROOT/models (training/device_run.sh
#   unpacks a saved model it carries this way).
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
dir="${2:-$root/models}"
n=0
while IFS= read -r -d '' src; do
  dst="${src%.xz}"
  if [ -f "$dst" ] && [ "$dst" -nt "$src" ]; then continue; fi
  tmp="$dst.tmp.$$"
  if command -v xz >/dev/null 2>&1; then
    xz -dc "$src" >"$tmp"
  else
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$src" "$tmp"
  fi
  mv -f "$tmp" "$dst"
  n=$((n + 1))
done < <(find "$dir" -name '*.safetensors.xz' -print0)
echo "unpack-models: $n shard(s) unpacked under $dir"
