#!/usr/bin/env bash
# Runs shellcheck at severity warning over the project's shell scripts: every
# tracked *.sh (training/'s included; model/ holds the C++ engine only). Exit 77 (ctest skip) without shellcheck or outside a git
# checkout; scripts/install-deps.sh installs shellcheck.
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
if ! command -v shellcheck >/dev/null 2>&1; then
  echo "shellcheck_test: shellcheck is not installed; skipped"
  exit 77
fi
if ! git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "shellcheck_test: $root is not a git work tree; skipped"
  exit 77
fi
scripts=()
while IFS= read -r -d '' f; do
  [ -f "$root/$f" ] && scripts+=("$f")
done < <(git -C "$root" ls-files -z -- '*.sh')
echo "shellcheck_test: $(shellcheck --version | sed -n 2p), ${#scripts[@]} scripts"
cd "$root"
shellcheck -S warning -f gcc "${scripts[@]}"
echo "shellcheck_test: clean"
