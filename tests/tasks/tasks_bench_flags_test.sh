#!/usr/bin/env bash
# ctxcache-bench tasks' run-control flags (issue #17): --shard I/N takes tasks
# I, I+N, ... of the file; --out holds the same JSON as the last stdout line;
# --session-params / --index-params are recorded in the JSON and reach the
# server (values it refuses fail the run with its error); malformed flags
# exit 2 naming the flag. Two 4K tasks, csa at 5%.
#   tasks_bench_flags_test.sh REPO_ROOT BIN_DIR
set -euo pipefail
root="$1"
bin="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$root/evals/longctx_tasks.py" \
  --tok "$root/models/ctxcache-ref/tokenizer.model" \
  --docs "$root/tests/data/demo/vim_help.txt,$root/tests/data/demo/document.txt" \
  --lengths 4096 --depths 0.1 --per-cell 1 --out "$work/all.jsonl"
head -2 "$work/all.jsonl" > "$work/tasks.jsonl"
cd "$root"
B="$bin/ctxcache-bench"
run() { "$B" tasks --tasks "$work/tasks.jsonl" --methods csa --budgets 0.05 "$@"; }
run --shard 1/2 --out "$work/s1.json" > "$work/s1.txt"
run --shard 0/2 --session-params page_fraction=1 --index-params csa:m=16 \
  --out "$work/s0.json" > "$work/s0.txt"
run --shard 0/2 --out "$work/d0.json" > "$work/d0.txt"
for bad in "--shard 2/2" "--shard 1" "--session-params rho" "--index-params csa" \
           "--index-params quest:page_size=8"; do
  if run $bad > /dev/null 2> "$work/err.txt"; then echo "accepted: $bad"; exit 1; fi
  flag="${bad%% *}"
  grep -q -- "$flag" "$work/err.txt" || { echo "error for '$bad' does not name $flag:"; cat "$work/err.txt"; exit 1; }
done
/usr/bin/python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
ids = [json.loads(l)["id"] for l in open(f"{w}/tasks.jsonl")]
def load(n):
    out = json.load(open(f"{w}/{n}.json"))
    final = json.loads(open(f"{w}/{n}.txt").read().splitlines()[-1])
    assert final.pop("check_failures") == [], final  # the stdout JSON adds the checks
    assert out == final, n
    return out
s0, s1, d0 = load("s0"), load("s1"), load("d0")
assert [t["id"] for t in s0["tasks"]] == [ids[0]], s0["tasks"]
assert [t["id"] for t in s1["tasks"]] == [ids[1]], s1["tasks"]
assert s0["shard"] == "0/2" and s0["n_tasks"] == 1
assert s0["session_params"] == "page_fraction=1" and s0["index_params"] == ["csa:m=16"]
assert d0["session_params"] == "" and d0["index_params"] == []
print("tasks bench flags: shards", ids)
PY
# The params reach the server: values it refuses fail the run with its error.
if run --shard 0/2 --index-params csa:m=7 > /dev/null 2> "$work/err.txt"; then
  echo "csa m=7 (does not divide head_dim 64) was accepted"; exit 1; fi
grep -q "m=7" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
if run --shard 0/2 --session-params page_fraction=2 > /dev/null 2> "$work/err.txt"; then
  echo "page_fraction=2 was accepted"; exit 1; fi
grep -q "page_fraction" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
echo "tasks bench flags: passed"
