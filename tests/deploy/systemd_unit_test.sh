#!/usr/bin/env bash
# deploy/ctxcached.service is sandboxed: `systemd-analyze security` rates it
# at most 2.0 ("OK"; it was 8.7 EXPOSED). Exit 77 (ctest skip) without a
# systemd-analyze that has --offline (systemd 250 and later).
#   usage: systemd_unit_test.sh SOURCE_DIR
set -euo pipefail
src="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
threshold=20  # systemd-analyze scale: 20 = 2.0
if ! command -v systemd-analyze >/dev/null 2>&1 ||
   ! systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
  echo "systemd_unit_test: no systemd-analyze with --offline; skipped"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp "$src/deploy/ctxcached.service" "$tmp/ctxcached.service"
cd "$tmp"
if ! out="$(systemd-analyze security --offline=true --threshold="$threshold" \
              ctxcached.service 2>&1)"; then
  echo "$out"
  echo "systemd_unit_test: exposure above 2.0"
  exit 1
fi
echo "$out" | tail -1
