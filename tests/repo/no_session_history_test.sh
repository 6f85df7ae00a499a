#!/usr/bin/env bash
# Code, comments, scripts and build files say what is true now, not which
# work session did it: no "session N" (nor "run N (session M)") outside the
# docs. Docs are ordered by topic: no markdown heading names a session.
# Superseded history may stay in docs/history.md; result data is exempt.
# Exit 77 (ctest skip) outside a git checkout.
#   no_session_history_test.sh REPO_ROOT
set -euo pipefail
root="${1:-$(cd "$(dirname "$0")/../.." && pwd)}"
if ! git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "no_session_history_test: $root is not a git work tree; skipped"
  exit 77
fi
cd "$root"
exempt=(':!bench/results' ':!training/results' ':!docs/history.md')
fail=0
# A session number after the word; a flag like "--sessions 64" does not count.
if git grep -I -n -E '(^|[^[:alnum:]_-])[Ss]ession [0-9]' -- ':!*.md' "${exempt[@]}"; then
  echo "FAIL: the lines above cite a work session; say what is true now" >&2
  fail=1
fi
if git grep -I -n -E '^#+ .*[Ss]ession [0-9]' -- '*.md' "${exempt[@]}"; then
  echo "FAIL: the headings above name a session; name the topic" >&2
  fail=1
fi
exit $fail
