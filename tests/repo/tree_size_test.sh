#!/usr/bin/env bash
# The tracked tree must fit, with the server bundle, in the 64 MiB that one
# call to the GPU machine may carry: at most 50 MiB of tracked files (working
# tree sizes of `git ls-files`). Generated data (traces) and unpacked model
# shards are gitignored and do not count. Exit 77 (ctest skip) outside a git
# checkout.
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
limit=$((50 * 1024 * 1024))
if ! git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "tree_size_test: $root is not a git work tree; skipped"
  exit 77
fi
total=0
while IFS= read -r -d '' f; do
  [ -f "$root/$f" ] || continue
  total=$((total + $(stat -c %s "$root/$f")))
done < <(git -C "$root" ls-files -z)
awk -v t="$total" -v l="$limit" \
  'BEGIN { printf "tracked tree: %d bytes (%.2f MiB), limit %.2f MiB\n", t, t / 1048576, l / 1048576 }'
if [ "$total" -gt "$limit" ]; then
  echo "FAIL: the tracked tree is over 50 MiB; largest tracked files:" >&2
  git -C "$root" ls-files -z | (cd "$root" && xargs -0 stat -c '%s %n') | sort -rn | head -10 >&2
  exit 1
fi
