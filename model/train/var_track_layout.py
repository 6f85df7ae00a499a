#!/usr/bin/env python3
"""var_track accuracy by the layout of its two chains (issue 17).

Regenerates the held-out var_track tasks (longctx_tasks.EVAL_SEED over the
tests/data/demo documents, as `train.py eval` makes them), locates every
`VAR x = ...` line, follows the queried chain back to its value, and groups the
tasks' correctness (from one or more `train.py eval` JSON files, plain or .xz;
a task's accuracy is the mean over the files) by:
  length, depth              the task's cell;
  distractor_head_after      the other chain's value line comes after the
                             queried chain's value line (nearer the question);
  distractor_links_inside    how many of the other chain's lines lie between the
                             queried chain's first and last line;
  chain_span                 the queried chain's extent, in quarters of the context.

  python3 model/train/var_track_layout.py model/train/results/v2-run11/eval.json \\
      [more eval.json(.xz) ...] [--lengths 4096,8192,16384,32768]
Prints one JSON object: {"tasks": N, "models": M, "by": {feature: {value: [acc, n]}}}.
"""
import argparse
import json
import lzma
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import longctx_tasks as lt  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EVAL_DOCS = [os.path.join(ROOT, "tests", "data", "demo", f) for f in
             ("vim_help.txt", "r_admin.txt", "linux_firmware_guide.txt", "document.txt")]
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)  # train.py eval's default --eval-depths
LINE = re.compile(r"VAR (\w+) = (VAR \w+|\d+)\.")


def layout(task):
    """The chain layout of one var_track task, positions as fractions of the
    context's characters."""
    n = len(task.context)
    lines = {m.group(1): (m.start() / n, m.group(2)) for m in LINE.finditer(task.context)}
    name = re.search(r"value of VAR (\w+)", task.question).group(1)
    chain = [name]
    while lines[chain[-1]][1].startswith("VAR "):
        chain.append(lines[chain[-1]][1][4:])
    if lines[chain[-1]][1] != task.answer.strip():
        raise ValueError(f"task {task.id}: the chain does not end at the answer")
    head, last = lines[chain[-1]][0], lines[chain[0]][0]
    others = [lines[k] for k in lines if k not in chain]
    dist_heads = [p for p, rhs in others if not rhs.startswith("VAR ")]
    return {
        "length": task.length,
        "depth": task.depth,
        "distractor_head_after": any(p > head for p in dist_heads),
        "distractor_links_inside": sum(1 for p, _ in others if head < p < last),
        "chain_span": round((last - head) * 4) / 4,
    }


def load_rows(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["tasks"]["tasks"]


def by_layout(tasks, results):
    """results: list of {task id: correct}; returns {feature: {value: [acc, n]}}
    over the tasks that every result scored."""
    groups = {}
    for t in tasks:
        if not all(t.id in r for r in results):
            continue
        acc = sum(r[t.id] for r in results) / len(results)
        for k, v in layout(t).items():
            groups.setdefault(k, {}).setdefault(str(v), []).append(acc)
    return {k: {v: [round(sum(a) / len(a), 3), len(a)] for v, a in sorted(g.items())}
            for k, g in groups.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("evals", nargs="+", help="train.py eval JSON files (.json or .json.xz)")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--per-cell", type=int, default=4, help="train.py eval's --eval-per-cell")
    a = ap.parse_args(argv)
    results = [{r["id"]: bool(r["correct"]) for r in load_rows(p) if r["family"] == "var_track"}
               for p in a.evals]
    tok = lt.Tokenizer(os.path.join(ROOT, "models", "ctxcache-ref", "tokenizer.model"))
    pool = lt.DocumentPool(lt.read_docs(EVAL_DOCS), tok)
    tasks = list(lt.generate(pool, tok, ["var_track"], [int(x) for x in a.lengths.split(",")],
                             DEPTHS, a.per_cell, lt.EVAL_SEED))
    by = by_layout(tasks, results)
    n = sum(n for _, n in by["length"].values()) if by else 0
    if n == 0:
        raise SystemExit("no var_track task of these lengths is in every eval file")
    print(json.dumps({"tasks": n, "models": len(results), "by": by}))


if __name__ == "__main__":
    main()
