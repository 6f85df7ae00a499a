"""Extending a stored context on the GPU: sparse chunked prefill (block-union
page tables over Quest bounds, ctxcache.engine.prefill) against dense
chunked prefill over the same resident context, same model, same run.

Two modes (both may run in one call):
  --speed   an HF Llama (--model llama8b: the Llama-3-8B shape, random
            weights) extends a --tokens context (random K/V) by each of
            --ext-tokens new tokens in chunks of --chunk; per extension the
            attention alone (every layer's chunks, random q/k/v) and the
            whole prefill (LlamaExtender: projections, MLP, attention),
            dense vs sparse at each --rho;
  --tasks   accuracy on the long-context task suite with the question as the
            extension: the document is prefilled densely (HF) as the stored
            context, the question prefilled as an extension (dense, and
            sparse at each --rho), then the answer decoded greedily with
            dense attention over context + extension (DenseDecoder); a task
            is right when the first len(answer_ids) tokens are the answer.
            With --decode-rho, the answer is also decoded through the GPU
            engine (ContextDecoder: Quest pages at each budget, each
            --periods search period) after the dense extension prefill, and
            after the sparse one (the whole sparse path).
            The JSONL needs context_ids: --add-ids writes them (sentencepiece).

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Optional

import torch

from ctxcache.engine import (ContextDecoder, DenseDecoder, DenseExtendAttention,  # noqa: E402
                             EngineOptions, ExtendOptions, HostTier, LlamaExtender,
                             LlamaStepper, SparseExtendAttention)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def add_ids(src: str, dst: str, tok_model: str) -> int:
    """The task generator's JSONL with context_ids (encode(context)) added."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=tok_model)
    n = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            t = json.loads(line)
            t["context_ids"] = sp.encode(t["context"])
            del t["context"]
            out.write(json.dumps(t) + "\n")
            n += 1
    return n


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


@torch.no_grad()
def speed(model, n: int, ext: list, chunk: int, rhos: list, reps: int) -> list:
    cfg = model.config
    L, H, hq = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    n_pad = (n + 15) // 16 * 16
    k = torch.randn(L, H, n_pad, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, H, n_pad, d, device=dev, dtype=torch.bfloat16, generator=g)
    ex = LlamaExtender(model)
    rows = []
    for t in ext:
        qs = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        kvs = torch.randn(2, t, H, d, device=dev, dtype=torch.bfloat16, generator=g)
        toks = torch.randint(3, cfg.vocab_size, (t,), device=dev, generator=g)
        makers = [("dense", None, lambda: DenseExtendAttention(k, v, n, t))]
        for rho in rhos:
            makers.append(("sparse", rho, lambda rho=rho: SparseExtendAttention(
                k, v, n, t, ExtendOptions(rho=rho))))
        for name, rho, make in makers:
            att = make()

            def attention_only():
                att.reset()
                for c0 in range(0, t, chunk):
                    for layer in range(L):
                        att.attend(layer, qs[c0:c0 + chunk], kvs[0, c0:c0 + chunk],
                                   kvs[1, c0:c0 + chunk])

            def whole():
                att.reset()
                ex(att, toks, n, chunk)

            row = {"context": n, "ext_tokens": t, "chunk": chunk, "attention": name,
                   "rho": rho, "attention_ms": round(timed(attention_only, reps), 3),
                   "prefill_ms": round(timed(whole, reps), 3)}
            if name == "sparse":
                row["kp"] = att.kp
                row["pages"] = att.n_pages
            rows.append(row)
            log(row)
            del att
    dense = {(r["ext_tokens"]): r for r in rows if r["attention"] == "dense"}
    for r in rows:
        if r["attention"] == "sparse":
            base = dense[r["ext_tokens"]]
            r["attention_speedup"] = round(base["attention_ms"] / r["attention_ms"], 3)
            r["prefill_speedup"] = round(base["prefill_ms"] / r["prefill_ms"], 3)
    return rows


@torch.no_grad()
def stored_kv(model, ids: list):
    """Dense prefill of ids: K, V [L, H, n_pad, d] (page-padded with zeros)."""
    dev = "cuda"
    out = model(input_ids=torch.tensor([ids], device=dev), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    L = len(cache.layers)
    _, H, n, d = cache.layers[0].keys.shape
    n_pad = (n + 15) // 16 * 16
    k = torch.zeros(L, H, n_pad, d, device=dev, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for i in range(L):
        k[i, :, :n].copy_(cache.layers[i].keys[0])
        v[i, :, :n].copy_(cache.layers[i].values[0])
    return k, v, n


@torch.no_grad()
def answer(model, k, v, n: int, att, question: list, n_answer: int,
           engine: Optional[EngineOptions] = None, tier: Optional[HostTier] = None) -> list:
    """Prefill the question through ``att``, then decode n_answer tokens
    greedily over context + extension: dense attention, or the GPU engine
    with ``engine``'s options over ``tier`` (the context in host memory)."""
    dev = "cuda"
    t = len(question)
    logits = LlamaExtender(model)(att, torch.tensor(question, device=dev), n)
    out = [int(logits.argmax())]
    if engine is None:
        dec = DenseDecoder(k[:, :, :n], v[:, :, :n], 1, t + n_answer + 2)
    else:
        dec = ContextDecoder(tier, dev, model.config.num_attention_heads, 1, t + n_answer + 2,
                             engine)
    dec.own.k[:, 0, :, :t].copy_(att.k_new[:, :, :t])
    dec.own.v[:, 0, :, :t].copy_(att.v_new[:, :, :t])
    dec.own.length.fill_(t)
    st = LlamaStepper(model, dec, 1)
    st.tokens.fill_(out[0])
    st.position.fill_(n + t)
    for _ in range(n_answer - 1):
        out.append(int(st.step()[0]))
    return out


def tasks(model, path: str, rhos: list, limit: int, decode_rhos: list = (),
          periods: list = (1,), ranks: list = ("votes",), pairs: bool = True,
          min_budgets: list = (0,)) -> dict:
    by = {}
    rows = []
    with open(path, encoding="utf-8") as f:
        items = [json.loads(x) for x in f][:limit or None]
    for i, t in enumerate(items):
        ids = [1] + t["context_ids"]
        k, v, n = stored_kv(model, ids)
        q, a = t["question_ids"], t["answer_ids"]
        res = {"id": t["id"], "family": t["family"], "length": t["length"]}
        runs = [("dense", lambda: DenseExtendAttention(k, v, n, len(q)), None)]
        for rho in rhos:
            runs.append((f"sparse_{rho}", lambda rho=rho: SparseExtendAttention(
                k, v, n, len(q), ExtendOptions(rho=rho)), None))
        for rho, p, rk, mb in itertools.product(decode_rhos, periods, ranks, min_budgets):
            eo = EngineOptions(rho=rho, period=p, rank=rk, min_budget=mb)
            tag = ("" if rk == "votes" else f"_{rk}") + (f"_min{mb}" if mb else "")
            runs.append((f"decode_{rho}_p{p}{tag}", runs[0][1], eo))
            if rhos and pairs:
                runs.append((f"sparse_{rhos[-1]}+decode_{rho}_p{p}{tag}",
                             runs[len(rhos)][1], eo))
        tier = None
        if decode_rhos:
            L, H, _, d = k.shape
            tier = HostTier(L, H, n, d)
            tk, tv = tier.token_view()
            tk.copy_(k[:, :, :n])
            tv.copy_(v[:, :, :n])
        for name, make, eo in runs:
            got = answer(model, k, v, n, make(), q, len(a), eo, tier)
            res[name] = got == a
        rows.append(res)
        for name, _, _ in runs:
            c = by.setdefault(name, {"right": 0, "tasks": 0, "families": {}})
            c["right"] += int(res[name])
            c["tasks"] += 1
            fam = c["families"].setdefault(t["family"], [0, 0])
            fam[0] += int(res[name])
            fam[1] += 1
        if i % 10 == 0:
            log(f"task {i}: {res}")
        del k, v
        torch.cuda.empty_cache()
    dense = by["dense"]
    for name, c in by.items():
        c["accuracy"] = round(c["right"] / max(1, c["tasks"]), 4)
        c["of_dense"] = round(c["right"] / max(1, dense["right"]), 4)
        c["families_of_dense"] = {
            f: round(x[0] / max(1, dense["families"][f][0]), 3) for f, x in c["families"].items()}
    return {"summary": by, "tasks": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--tokens", default="32768,131072", help="stored context lengths (speed)")
    ap.add_argument("--ext-tokens", default="1024,4096,8192")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rho", default="0.1", help="sparse budgets, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tasks", default="", help="task JSONL with context_ids")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--decode-rho", default="", help="engine decode budgets (tasks)")
    ap.add_argument("--periods", default="1", help="engine decode search periods (tasks)")
    ap.add_argument("--ranks", default="votes", help="engine planner ranks (tasks)")
    ap.add_argument("--min-budgets", default="0",
                    help="engine budget floors in tokens, comma-separated (tasks)")
    ap.add_argument("--no-pairs", action="store_true",
                    help="skip sparse prefill + engine decode (tasks)")
    ap.add_argument("--add-ids", nargs=2, metavar=("IN", "OUT"))
    ap.add_argument("--tok", default="models/ctxcache-ref/tokenizer.model")
    a = ap.parse_args()
    if a.add_ids:
        print(json.dumps({"tasks": add_ids(a.add_ids[0], a.add_ids[1], a.tok)}))
        return 0
    from gpu_e2e import load_model
    torch.backends.cuda.matmul.allow_tf32 = True
    rhos = [float(x) for x in a.rho.split(",") if x]
    res = {"bench": "gpu_extend", "device": torch.cuda.get_device_name(), "model": a.model,
           "rho": rhos, "chunk": a.chunk}
    model = load_model(a.model, a.layers, "cuda")
    if a.speed:
        res["speed"] = []
        for n in [int(x) for x in a.tokens.split(",") if x]:
            res["speed"] += speed(model, n, [int(x) for x in a.ext_tokens.split(",")],
                                  a.chunk, rhos, a.reps)
            torch.cuda.empty_cache()
    if a.tasks:
        res["tasks"] = tasks(model, a.tasks, rhos, a.limit,
                             [float(x) for x in a.decode_rho.split(",") if x],
                             [int(x) for x in a.periods.split(",") if x],
                             a.ranks.split(","), not a.no_pairs,
                             [int(x) for x in a.min_budgets.split(",")])
        log(json.dumps(res["tasks"]["summary"]))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
