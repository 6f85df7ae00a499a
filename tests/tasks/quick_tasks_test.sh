#!/usr/bin/env bash
# The task suite's quick form (issue #17): 10 held-out tasks at 4K tokens (every
# family, needles at depth 0.1 = far and 0.9 = near) through a real ctxcached.
# Passes when full attention answers >= 90% and streaming (sink + recent
# window) is at least 0.5 below full on the far needles at every budget.
#
# Not in the default suite: the reference model v1 was not trained to
# retrieve and fails these tasks under full attention (docs/benchmarks.md has
# its accuracies). It is registered with cmake -DCTXCACHE_TASK_SUITE=ON (ctest
# -L tasks) and joins the default suite when the v2 model lands.
#   quick_tasks_test.sh REPO_ROOT BIN_DIR
set -euo pipefail
root="$1"
bin="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$root/model/train/longctx_tasks.py" \
  --tok "$root/models/ctxcache-ref/tokenizer.model" \
  --docs "$root/tests/data/demo/vim_help.txt,$root/tests/data/demo/r_admin.txt,$root/tests/data/demo/linux_firmware_guide.txt,$root/tests/data/demo/document.txt" \
  --lengths 4096 --depths 0.1,0.9 --per-cell 1 --out "$work/tasks.jsonl"
cd "$root"
rc=0
"$bin/ctxcache-bench" tasks --tasks "$work/tasks.jsonl" --model "$root/models/ctxcache-ref" \
  --methods full,streaming --budgets 0.02,0.05,0.10 \
  --expect-full-min 0.9 --expect-far-gap 0.5 > "$work/out.txt" || rc=$?
head -n -1 "$work/out.txt"  # the table (the JSON is the last line)
exit $rc
