#!/usr/bin/env python3
"""Why a reference model misses held-out tasks (issue 17): task accuracy on
three sets of fresh tasks, and for every miss what went wrong.

Sets (each of the families (--families, default all 5) x depths x lengths x
--per-cell, seeds never used in training):
  train_docs      haystacks from training documents (text the model has seen
                  many times), task seed 4;
  heldout_corpus  haystacks from the corpus' held-out split, task seed 5;
  eval            the held-out evaluation tasks (tests/data/demo documents,
                  longctx_tasks.EVAL_SEED), as `train.py eval` and
                  `ctxcache-bench tasks` score them.
Equal accuracy on the three means the misses are not a generalization gap
(memorized haystacks) but the model's retrieval itself.

For each miss it records the teacher-forced log-probability of the answer,
the smallest per-token probability, the first wrong token, the greedy output,
and whether that output occurs in the context verbatim: a value that does is
a wrong binding (the distractor chain of var_track, another key's needle of
niah_multi); one that does not is a copy that drifted.

  python3 training/diag_tasks.py --model models/ctxcache-ref \\
      --train-docs work/diag/train_slice.txt.xz --heldout work/diag/heldout.txt.xz \\
      --lengths 4096,16384 --per-cell 2 --out diag.json
Prints one JSON line per (model, set); writes every task's row to --out.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The task generator lives in evals/ beside this folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "evals"))
import llama  # noqa: E402
import longctx_tasks as lt  # noqa: E402
from train import BOS, default_device, miss_detail, read_docs  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEPTHS = [0.05, 0.25, 0.5, 0.75, 0.95]


def task_sets(tok, a):
    lengths = [int(x) for x in a.lengths.split(",")]

    def gen(docs, seed):
        pool = lt.DocumentPool(docs, tok)
        return list(lt.generate(pool, tok, families, lengths, DEPTHS, a.per_cell, seed))
    families = [f for f in a.families.split(",") if f] or list(lt.FAMILIES)
    bad = [f for f in families if f not in lt.FAMILIES]
    if bad:
        raise SystemExit(f"--families: unknown {', '.join(bad)}; known: {', '.join(lt.FAMILIES)}")
    sets = {}
    if a.train_docs:
        sets["train_docs"] = gen([(f"t{i}", d) for i, d in enumerate(read_docs(a.train_docs))], 4)
    if a.heldout:
        sets["heldout_corpus"] = gen([(f"h{i}", d) for i, d in enumerate(read_docs(a.heldout))], 5)
    sets["eval"] = gen(lt.read_docs(lt.EVAL_DOCS), lt.EVAL_SEED)
    return sets


def diagnose(model, tok, t, dev, teacher_forced=False):
    ids = [BOS] + t.context_ids + t.question_ids
    n = len(t.answer_ids)
    with torch.no_grad():
        x = torch.as_tensor([ids + t.answer_ids], device=dev)
        lp = torch.log_softmax(model(x)[0].float(), -1)[len(ids) - 1:len(ids) - 1 + n]
        tf = lp.gather(1, torch.as_tensor(t.answer_ids, device=dev)[:, None])[:, 0]
    # Greedy exact match holds iff every teacher-forced argmax is the answer
    # token, so --teacher-forced decides correctness in the one forward pass
    # (for a miss, "got" is then the per-position argmax, not a continuation).
    got = lp.argmax(-1).tolist() if teacher_forced else model.greedy(ids, n)
    ok = got == t.answer_ids
    row = {"family": t.family, "length": t.length, "depth": t.depth, "correct": ok,
           "tf_logp": round(float(tf.sum()), 3), "min_token_p": round(float(tf.exp().min()), 4)}
    if not ok:
        row.update(miss_detail(tok, got, t.answer_ids, t.answer, t.context))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="model directory (repeatable)")
    ap.add_argument("--tok", default=os.path.join(ROOT, "models", "ctxcache-ref", "tokenizer.model"))
    ap.add_argument("--train-docs", default="", help="training documents (corpus format, .xz ok)")
    ap.add_argument("--heldout", default="", help="held-out corpus documents (corpus format)")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--families", default="", help="comma-separated task families (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="tasks per set (0 = all)")
    ap.add_argument("--device", default="")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="score by the teacher-forced argmax (one forward per task; same "
                         "verdicts as greedy decoding, ~n times cheaper without a KV cache)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = a.device or default_device()
    tok = lt.Tokenizer(a.tok)
    sets = task_sets(tok, a)
    out = {}
    for mdir in a.model:
        model = llama.from_pretrained(mdir, dtype=torch.bfloat16 if dev == "cuda" else torch.float32,
                                      device=dev)
        for name, tasks in sets.items():
            t0 = time.time()
            rows = [diagnose(model, tok, t, dev, a.teacher_forced)
                    for t in tasks[:a.limit or None]]
            by = {}
            for r in rows:
                for k in ("all", r["family"], f"length:{r['length']}"):
                    c = by.setdefault(k, [0, 0])
                    c[0] += r["correct"]
                    c[1] += 1
            miss = [r for r in rows if not r["correct"]]
            summary = {"model": mdir, "set": name, "by": by, "misses": len(miss),
                       "wrong_binding": sum(r["got_in_context"] for r in miss),
                       "seconds": round(time.time() - t0, 1)}
            print(json.dumps(summary), flush=True)
            out[f"{mdir}|{name}"] = {**summary, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
