#!/usr/bin/env python3
"""Where the reference model looks when it answers a var_track task (issue 17).

For each held-out var_track task (longctx_tasks.EVAL_SEED over the
tests/data/demo documents, as train.py eval draws them, in the value answer
format of v2-v2.2: longctx_tasks.VAR_ANSWERS) at --lengths, runs the
model on [<s>] + context + question + the answer's tokens up to the first one
that differs from the other chain's value (the values share their leading
space piece, and sometimes digits), and takes, in every layer, the attention
of that last position (the one that predicts the deciding token) over the
context. That attention's mass is summed over the token span
of each `VAR x = ...` line, grouped by the line's role:
  hop0 .. hop{N-1}   the queried chain from the question's end: hop0 is the
                     line that assigns the queried name, the last hop the
                     line with the literal value;
  other_value        the other chain's literal value line;
  other_links        the other chain's `VAR x = VAR y.` lines.
Per layer it reports, over the tasks, the mean of the largest mass any one
head puts on each group (a head that finds a line puts most of its mass
there), split by whether the predicted deciding token is right, and
whether it is the other chain's value's token instead.

  /usr/bin/python3 training/var_track_attention.py [--model models/ctxcache-ref] \\
      [--lengths 4096,8192] [--per-cell 4] [--var-links 4 --var-distractor-late 0] [--out F.json]
--var-links / --var-distractor-late draw other chain shapes from the same seeds
(longctx_tasks.make_task's options): fewer hops, or the other chain's value
always nearer the question, to see which part of the chain following fails.
Prints one JSON object (and writes it to --out).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The task generator lives in evals/ beside this folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "evals"))
import llama  # noqa: E402
import longctx_tasks as lt  # noqa: E402
import var_track_layout as vl  # noqa: E402


def line_spans(task, tok):
    """{name: (first token, end token, rhs)} of every VAR line in the task's
    [<s>] + context ids (inserts are whole paragraphs, so a line's tokens are
    those of the line alone, after the tokens of the text before it)."""
    spans = {}
    for m in vl.LINE.finditer(task.context):
        start = 1 + len(tok.encode(task.context[:m.start()]))
        spans[m.group(1)] = (start, start + len(tok.encode(m.group(0))), m.group(2))
    return spans


def roles(task, spans):
    """({role: [(first, end), ...]} for the hop/other groups of the docstring,
    the queried chain's names, the other chain's value)."""
    chain = vl.chain_of(task, {n: rhs for n, (_, _, rhs) in spans.items()})
    out = {f"hop{i}": [spans[n][:2]] for i, n in enumerate(chain)}
    other = None
    for n, (a, b, rhs) in spans.items():
        if n not in chain:
            link = rhs.startswith("VAR ")
            out.setdefault("other_links" if link else "other_value", []).append((a, b))
            other = other if link else rhs
    return out, chain, other


@torch.no_grad()
def last_row_attention(model, ids):
    """(per-layer attention of the last position [layers][heads, T] as float
    tensors, the last position's logits): the model's own forward
    (llama.attention_inputs), each layer's last query row scored against all
    its keys."""
    dev = next(model.parameters()).device
    logits, inputs = llama.attention_inputs(
        model, torch.as_tensor([ids], dtype=torch.int64, device=dev))
    cos, sin = model.rope(len(ids), dev)
    rows = []
    for layer, x in zip(model.model.layers, inputs):
        q, k, _ = layer.self_attn.qkv(x, cos.to(x.dtype), sin.to(x.dtype))
        s = torch.matmul(q[0, :, -1:], k[0].transpose(-1, -2))[:, 0] / math.sqrt(q.shape[-1])
        rows.append(torch.softmax(s.float(), -1).cpu())
    return rows, logits[0, -1].float().cpu()


def task_record(model, tok, task):
    spans = line_spans(task, tok)
    groups, chain, other = roles(task, spans)
    ans = task.answer_ids
    oth = lt._qa_ids(tok, task.question, " " + other)[1]  # as answer_ids are made
    k = next((i for i in range(min(len(ans), len(oth))) if ans[i] != oth[i]), None)
    if k is None:
        raise ValueError(f"task {task.id}: the answer's tokens and the other value's "
                         f"({other}) do not differ")
    ids = [lt.BOS] + task.context_ids + task.question_ids + ans[:k]
    rows, logits = last_row_attention(model, ids)
    pred = int(logits.argmax())
    per_layer = []
    for p in rows:
        per_layer.append({g: float(max(sum(float(p[h, a:b].sum()) for a, b in sp)
                                       for h in range(p.shape[0])))
                          for g, sp in groups.items()})
    return {"id": task.id, "length": task.length, "depth": task.depth,
            "after": vl.layout(task)["distractor_head_after"],
            "deciding_token": k, "right": pred == ans[k], "other": pred == oth[k],
            "layers": per_layer}


def summarize(records):
    """{"n", "right", "other", "by": {"right"|"wrong": {layer: {group: mean}}}}."""
    out = {"n": len(records), "right": sum(r["right"] for r in records),
           "other": sum(r["other"] for r in records), "by": {}}
    for label, keep in (("right", True), ("wrong", False)):
        rs = [r for r in records if r["right"] == keep]
        if not rs:
            continue
        layers = {}
        for i in range(len(rs[0]["layers"])):
            groups = sorted({g for r in rs for g in r["layers"][i]})
            layers[str(i)] = {g: round(sum(r["layers"][i].get(g, 0.0) for r in rs) / len(rs), 3)
                              for g in groups}
        out["by"][label] = {"n": len(rs), "layers": layers}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(vl.ROOT, "models", "ctxcache-ref"))
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--depths", default="0.05,0.25,0.5,0.75,0.95")
    ap.add_argument("--per-cell", type=int, default=4)
    ap.add_argument("--var-links", type=int, default=4,
                    help="links per chain (hops + 1); other than 4: not the evaluation's tasks")
    ap.add_argument("--var-distractor-late", type=float, default=0.0,
                    help="probability that the other chain lies after the queried value")
    ap.add_argument("--device", default="", help="default: cuda if there is one, else cpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    tok, pool = vl.eval_pool()
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = llama.from_pretrained(a.model, device=dev).eval()
    lengths = [int(x) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    # The defaults (4 links, late 0) make exactly lt.generate's evaluation tasks.
    tasks = [lt.make_task(pool, tok, "var_track", L, d, lt.EVAL_SEED, di, i,
                          var_links=a.var_links, var_distractor_late=a.var_distractor_late,
                          var_answer="value")
             for L in lengths for di, d in enumerate(depths) for i in range(a.per_cell)]
    records = [task_record(model, tok, t) for t in tasks]
    res = {"model": a.model, "lengths": lengths, "var_links": a.var_links,
           "var_distractor_late": a.var_distractor_late,
           "by_length": {str(L): summarize([r for r in records if r["length"] == L])
                         for L in lengths},
           "tasks": records}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)
    print(json.dumps({k: v for k, v in res.items() if k != "tasks"}))


if __name__ == "__main__":
    main()
