#!/usr/bin/env python3
"""var_track accuracy by the layout of its two chains (issue 17).

Regenerates the held-out var_track tasks that a `train.py eval` file scored
(longctx_tasks.EVAL_SEED over the tests/data/demo documents, at the lengths,
depths and per-cell count its task rows show), locates every
`VAR x = ...` line, follows the queried chain back to its value, and groups the
tasks' correctness (from one or more `train.py eval` JSON files, plain or .xz;
a task's accuracy is the mean over the files) by:
  length, depth              the task's cell;
  distractor_head_after      the other chain's value line comes after the
                             queried chain's value line (nearer the question):
                             "False" is exactly where answering the literal
                             value nearest the question (a recency rule, no
                             chain following) is right, so its count is that
                             rule's score;
  length_and_after           both, "LENGTH/True|False": per length, what the
                             recency rule scores and what the model adds to it;
  distractor_links_inside    how many of the other chain's lines lie between the
                             queried chain's first and last line;
  chain_span                 the queried chain's extent, in quarters of the context.

  python3 training/var_track_layout.py training/results/v2-run11/eval.json \\
      [more eval.json(.xz) ...]
Prints one JSON object: {"tasks": N, "models": M, "by": {feature: {value: [acc, n]}}}.
device_sweep.sh puts each variant's distractor_head_after groups
(`eval_summary`) into its summary16k.jsonl line.
"""
import argparse
import json
import lzma
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The task generator lives in evals/ beside this folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "evals"))
import longctx_tasks as lt  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LINE = re.compile(r"VAR (\w+) = (VAR \w+|\d+)\.")


def chain_of(task, rhs):
    """The queried chain's names, from the question's name to the one holding
    the literal value (rhs: {name: right-hand side of its VAR line}); raises
    ValueError if that value is not the task's answer."""
    chain = [re.search(r"value of VAR (\w+)", task.question).group(1)]
    while rhs[chain[-1]].startswith("VAR "):
        chain.append(rhs[chain[-1]][4:])
    if rhs[chain[-1]] != lt.final_value(task.answer):
        raise ValueError(f"task {task.id}: the chain does not end at the answer")
    return chain


def layout(task):
    """The chain layout of one var_track task, positions as fractions of the
    context's characters."""
    n = len(task.context)
    lines = {m.group(1): (m.start() / n, m.group(2)) for m in LINE.finditer(task.context)}
    chain = chain_of(task, {k: rhs for k, (_, rhs) in lines.items()})
    head, last = lines[chain[-1]][0], lines[chain[0]][0]
    others = [lines[k] for k in lines if k not in chain]
    dist_heads = [p for p, rhs in others if not rhs.startswith("VAR ")]
    after = any(p > head for p in dist_heads)
    return {
        "length": task.length,
        "depth": task.depth,
        "distractor_head_after": after,
        "length_and_after": f"{task.length}/{after}",
        "distractor_links_inside": sum(1 for p, _ in others if head < p < last),
        "chain_span": round((last - head) * 4) / 4,
    }


def load_rows(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["tasks"]["tasks"]


def eval_pool():
    """(tokenizer, document pool) of the held-out evaluation documents."""
    tok = lt.Tokenizer(os.path.join(ROOT, "models", "ctxcache-ref", "tokenizer.model"))
    return tok, lt.DocumentPool(lt.read_docs(lt.EVAL_DOCS), tok)


def eval_tasks(rows, tok, pool):
    """The var_track tasks among `rows` (a train.py eval file's task rows),
    regenerated: its lengths and depths (given in ascending order, as train.py
    eval's defaults are) and its per-cell count are read from the rows."""
    vt = [r for r in rows if r["family"] == "var_track"]
    if not vt:
        return []
    cells = {}
    for r in vt:
        cells[(r["length"], r["depth"])] = cells.get((r["length"], r["depth"]), 0) + 1
    return list(lt.generate(pool, tok, ["var_track"], sorted({r["length"] for r in vt}),
                            sorted({r["depth"] for r in vt}), max(cells.values()),
                            lt.EVAL_SEED))


def eval_summary(rows):
    """One eval file's accuracy by distractor_head_after ({"True": [acc, n],
    "False": [acc, n]}), for device_sweep.sh's summary lines."""
    tok, pool = eval_pool()
    results = [{r["id"]: bool(r["correct"]) for r in rows if r["family"] == "var_track"}]
    return by_layout(eval_tasks(rows, tok, pool), results).get("distractor_head_after", {})


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
    a = ap.parse_args(argv)
    rows = [load_rows(p) for p in a.evals]
    results = [{r["id"]: bool(r["correct"]) for r in rs if r["family"] == "var_track"}
               for rs in rows]
    tok, pool = eval_pool()
    by = by_layout(eval_tasks(rows[0], tok, pool), results)
    n = sum(n for _, n in by["length"].values()) if by else 0
    if n == 0:
        raise SystemExit("no var_track task of the first eval file is in every other one")
    print(json.dumps({"tasks": n, "models": len(results), "by": by}))


if __name__ == "__main__":
    main()
