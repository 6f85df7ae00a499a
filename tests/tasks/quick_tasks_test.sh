#!/usr/bin/env bash
# The task suite's quick form (issue #17): 20 held-out tasks at 4K tokens
# (every family x needle depth 0.1 = far and 0.9 = near x 2) through a real
# ctxcached, full attention and streaming (sink + recent window) at 5/10% of
# pages (at 2% streaming answers nothing, near or far: it would add time, not
# a check). Passes when full attention answers >= 85% (the reference model
# answers 19 of these 20 = 95%; the margin is two answers) and streaming is
# at least 0.5 below full on the far needles at every budget (measured: full
# 0.9, streaming 0.0).
#   quick_tasks_test.sh REPO_ROOT BIN_DIR
set -euo pipefail
root="$1"
bin="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$root/evals/longctx_tasks.py" \
  --tok "$root/models/ctxcache-ref/tokenizer.model" \
  --docs "$root/tests/data/demo/vim_help.txt,$root/tests/data/demo/r_admin.txt,$root/tests/data/demo/linux_firmware_guide.txt,$root/tests/data/demo/document.txt" \
  --lengths 4096 --depths 0.1,0.9 --per-cell 2 --out "$work/tasks.jsonl"
cd "$root"
rc=0
"$bin/ctxcache-bench" tasks --tasks "$work/tasks.jsonl" --model "$root/models/ctxcache-ref" \
  --methods full,streaming --budgets 0.05,0.10 \
  --expect-full-min 0.85 --expect-far-gap 0.5 > "$work/out.txt" || rc=$?
head -n -1 "$work/out.txt"  # the table (the JSON is the last line)
exit $rc
