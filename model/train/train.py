#!/usr/bin/env python3
"""Trains the ctxcache reference model: a small LLaMA-architecture model (HF
transformers LlamaForCausalLM built from a LlamaConfig, nothing downloaded).

Subcommands (run from the repository root on the GPU machine):

  prep   --corpus DIR --tok tokenizer.model --data DIR
         Tokenizes DIR/train.txt(.xz) and DIR/heldout.txt(.xz) (documents separated
         by a line holding only "\\x1e") with sentencepiece; each document becomes
         [<s>] + ids + [</s>]. Writes DATA/train.u16, DATA/heldout_docs.npz.
  bench  quick throughput test on random tokens (no data needed).
  train  --data DIR --run DIR --minutes M [--seq 4096 --batch 16 ...]
         AdamW, linear warmup + cosine decay; the step count is fixed after the
         first steps from the measured step time so training ends within M minutes.
         Logs to RUN/log.jsonl, saves RUN/final (bf16, save_pretrained).
  eval   --data DIR --model DIR --out DIR
         Held-out perplexity at 1K/4K/8K/16K context, unigram baseline at 4K,
         attention on token 0 per layer (eager attention), loss-curve PNG.
"""
import argparse
import json
import lzma
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

BOS, EOS = 1, 2


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=32768, rms_norm_eps=1e-5, initializer_range=0.02,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)


def add_model_args(ap):
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)


def read_docs(path):
    if not os.path.exists(path) and os.path.exists(path + ".xz"):
        path = path + ".xz"
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [d.strip("\n") for d in f.read().split("\x1e\n") if d.strip()]


_SP = None


def _enc(args):
    global _SP
    tok, text = args
    if _SP is None:
        import sentencepiece as spm
        _SP = spm.SentencePieceProcessor(model_file=tok)
    return np.asarray([BOS] + _SP.encode(text) + [EOS], dtype=np.uint16)


def cmd_prep(a):
    from multiprocessing import Pool
    os.makedirs(a.data, exist_ok=True)
    for split in a.splits.split(","):
        docs = read_docs(os.path.join(a.corpus, f"{split}.txt"))
        with Pool(os.cpu_count()) as pool:
            enc = pool.map(_enc, [(a.tok, d) for d in docs], chunksize=1)
        if split == "train":
            np.concatenate(enc).tofile(os.path.join(a.data, "train.u16"))
        else:
            np.savez(os.path.join(a.data, "heldout_docs.npz"), *enc)
        n = sum(len(e) for e in enc)
        chars = sum(len(d) for d in docs)
        print(json.dumps({"split": split, "docs": len(docs), "tokens": n, "chars": chars,
                          "chars_per_token": chars / n}))


def build_model(a, device):
    from transformers import LlamaForCausalLM
    cfg = model_config(a)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    m = LlamaForCausalLM(cfg).to(device)
    return m


def lm_loss(model, x):
    # x [B, T+1] int64; next-token cross entropy in fp32.
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def cmd_bench(a):
    dev = "cuda"
    for seq, batch, comp in [(4096, 16, False), (8192, 8, False), (8192, 8, True)]:
        m = build_model(a, dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        fwd = torch.compile(m) if comp else m
        x = torch.randint(0, 8192, (batch, seq + 1), device=dev)
        t0 = None
        for i in range(14):
            if i == 4:
                torch.cuda.synchronize()
                t0 = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(fwd, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = (time.time() - t0) / 10
        print(json.dumps({"seq": seq, "batch": batch, "compile": comp, "step_s": dt,
                          "tok_per_s": batch * seq / dt,
                          "params": sum(p.numel() for p in m.parameters()),
                          "mem_gb": torch.cuda.max_memory_allocated() / 1e9}), flush=True)
        del m, opt, fwd
        torch.cuda.empty_cache()


def cmd_train(a):
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    os.makedirs(a.run, exist_ok=True)
    data = np.fromfile(os.path.join(a.data, "train.u16"), dtype=np.uint16)
    n = len(data)
    data_t = torch.from_numpy(data.astype(np.int64))
    model = build_model(a, dev)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for nm, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for nm, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if a.compile else model
    g = torch.Generator().manual_seed(a.seed)
    # Fixed held-out windows for a validation loss during training.
    held = np.load(os.path.join(a.data, "heldout_docs.npz"))
    hstream = np.concatenate([held[k] for k in held.files]).astype(np.int64)
    nval = min(8, (len(hstream) - 1) // (a.seq + 1))
    val_x = torch.from_numpy(hstream[:nval * (a.seq + 1)].reshape(nval, a.seq + 1)).to(dev)

    def val_loss():
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            v = sum(lm_loss(model, val_x[i:i + 1]).item() for i in range(nval)) / nval
        model.train()
        return v

    budget = a.minutes * 60.0
    total_steps = None
    log = open(os.path.join(a.run, "log.jsonl"), "a")
    t_start = time.time()
    step = 0
    tokens = 0
    ema = None
    while True:
        if total_steps is None and step == a.calib_steps:
            per_step = (time.time() - t_calib) / (a.calib_steps - 5)
            total_steps = int((budget - (time.time() - t_start)) / per_step) + step
            print(json.dumps({"calibrated_step_s": per_step, "total_steps": total_steps}),
                  flush=True)
        if step == 5:
            torch.cuda.synchronize()
            t_calib = time.time()
        if total_steps is not None and step >= total_steps:
            break
        ts = total_steps or 10**9
        if step < a.warmup:
            lr = a.lr * (step + 1) / a.warmup
        else:
            frac = min(1.0, (step - a.warmup) / max(1, ts - a.warmup))
            lr = a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        seq, batch = a.seq, a.batch
        if total_steps is not None and a.long_seq and step >= total_steps * (1 - a.long_frac):
            seq, batch = a.long_seq, max(1, a.batch * a.seq // a.long_seq)
        off = torch.randint(0, n - seq - 1, (batch,), generator=g)
        idx = off[:, None] + torch.arange(seq + 1)[None]
        x = data_t[idx].to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(fwd, x)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += batch * seq
        if step % 10 == 0 or step == 1:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            rec = {"step": step, "loss": lv, "lr": lr, "grad_norm": gn.item(), "tokens": tokens,
                   "seq": seq, "elapsed_s": time.time() - t_start}
            if step % a.val_every == 0:
                rec["val_loss"] = val_loss()
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % 100 == 0 or step == 1:
                print(json.dumps(rec), flush=True)
        if step % a.ckpt_every == 0:
            model.save_pretrained(os.path.join(a.run, "ckpt"), safe_serialization=True)
    elapsed = time.time() - t_start
    final = os.path.join(a.run, "final")
    model.to(torch.bfloat16).save_pretrained(final, safe_serialization=True,
                                             max_shard_size=a.shard)
    summary = {"steps": step, "tokens": tokens, "train_tokens": n, "epochs": tokens / n,
               "params": nparams, "train_seconds": elapsed, "seq": a.seq, "batch": a.batch,
               "lr": a.lr, "warmup": a.warmup, "final_loss_ema": ema,
               "final_val_loss": val_loss(), "val_windows": nval,
               "long_seq": a.long_seq, "long_frac": a.long_frac,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cmd": " ".join(sys.argv)}
    json.dump(summary, open(os.path.join(a.run, "summary.json"), "w"), indent=1)
    print(json.dumps(summary), flush=True)
    open(os.path.join(a.run, "DONE"), "w").write("ok\n")


@torch.no_grad()
def window_nll(model, ids, dev):
    x = torch.as_tensor(ids, dtype=torch.int64, device=dev)[None]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float()[0], x[0, 1:], reduction="none").cpu().numpy()


def cmd_eval(a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from transformers import LlamaForCausalLM
    dev = "cuda"
    os.makedirs(a.out, exist_ok=True)
    res = {}
    # Loss curve.
    recs = [json.loads(l) for l in open(os.path.join(a.run, "log.jsonl"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["tokens"] / 1e6 for r in recs], [r["loss"] for r in recs], lw=0.8,
            label="train (batch)")
    vr = [r for r in recs if "val_loss" in r]
    ax.plot([r["tokens"] / 1e6 for r in vr], [r["val_loss"] for r in vr], "o-", ms=3,
            label="held-out (8 windows)")
    ax.set_ylim(top=min(8.0, max(r["loss"] for r in recs)))
    ax.legend()
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("ctxcache-ref training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "loss_curve.png"), dpi=110)
    # Model as shipped.
    t0 = time.time()
    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(dev).eval()
    res["load_seconds"] = time.time() - t0
    res["params"] = model.num_parameters()
    held = np.load(os.path.join(a.data, "heldout_docs.npz"))
    docs = [held[k].astype(np.int64) for k in held.files]
    names = [f"doc{i}" for i in range(len(docs))]
    if a.names:  # docs.tsv from make_corpus.py: held-out rows are in file order
        names = [l.split("\t")[1] for l in open(a.names).read().splitlines()[1:]
                 if l.startswith("heldout\t")]
        assert len(names) == len(docs), (len(names), len(docs))
    keep = [i for i in range(len(docs)) if not (a.exclude and re.search(a.exclude, names[i]))]
    res["excluded_docs"] = [names[i] for i in range(len(docs)) if i not in keep]
    res["heldout_docs"] = len(keep)
    res["heldout_tokens"] = int(sum(len(docs[i]) for i in keep))
    order = sorted(keep, key=lambda i: len(docs[i]), reverse=True)
    longest = [docs[i] for i in order]
    res["heldout_long_docs"] = [(names[i], int(len(docs[i]))) for i in order[:6]]
    # Unigram baseline from training frequencies (add-one smoothing).
    if a.unigram_counts:
        counts = np.load(a.unigram_counts).astype(np.float64) + 1.0
    else:
        tr = np.fromfile(os.path.join(a.data, "train.u16"), dtype=np.uint16)
        counts = np.bincount(tr, minlength=8192).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    # Per-document perplexity at 4K context (non-overlapping windows, up to 64K tokens).
    per_doc = {}
    for i in order:
        d = docs[i]
        v = [window_nll(model, d[s:s + 4097], dev)
             for s in range(0, min(len(d), 65536) - 4097 + 1, 4096)]
        if v:
            v = np.concatenate(v)
            u = np.concatenate([-logp[d[s + 1:s + 4097]]
                                for s in range(0, min(len(d), 65536) - 4097 + 1, 4096)])
            per_doc[names[i]] = {"tokens": int(v.size), "ppl": float(np.exp(v.mean())),
                                 "unigram_ppl": float(np.exp(u.mean()))}
    res["per_doc_4k"] = per_doc
    print(json.dumps(per_doc), flush=True)
    ppl = {}
    max_tok = a.eval_tokens
    for L in (1024, 4096, 8192, 16384):
        nll, tail, uni, nwin = [], [], [], 0
        for d in longest:
            for s in range(0, len(d) - L - 1 + 1, L):
                if sum(len(v) for v in nll) >= max_tok:
                    break
                w = d[s:s + L + 1]
                v = window_nll(model, w, dev)
                nll.append(v)
                tail.append(v[-512:])
                uni.append(-logp[w[1:]])
                nwin += 1
        if not nll:
            continue
        allv = np.concatenate(nll)
        ppl[str(L)] = {"windows": nwin, "tokens": int(allv.size),
                       "nll": float(allv.mean()), "ppl": float(np.exp(allv.mean())),
                       "ppl_last512": float(np.exp(np.concatenate(tail).mean())),
                       "unigram_ppl_same_tokens": float(np.exp(np.concatenate(uni).mean()))}
        print(json.dumps({"ctx": L, **ppl[str(L)]}), flush=True)
    res["perplexity"] = ppl
    res["eval_tokens_per_context"] = max_tok
    # Attention on token 0 per layer (eager attention, output_attentions).
    model_e = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                               attn_implementation="eager").to(dev).eval()
    sinks = {}
    for label, seq in (("doc_start", longest[0][:a.sink_len]),
                       ("mid_doc", longest[1][5000:5000 + a.sink_len])):
        x = torch.as_tensor(seq, dtype=torch.int64, device=dev)[None]
        with torch.no_grad():
            out = model_e(input_ids=x, output_attentions=True)
        T = x.shape[1]
        q0 = 16
        rows = []
        for li, att in enumerate(out.attentions):
            a0 = att[0, :, q0:, 0].float()  # [H, T-q0] attention on key 0
            per_head = a0.mean(dim=1).cpu().numpy()
            rows.append({"layer": li, "mean": float(per_head.mean()),
                         "max_head": float(per_head.max()),
                         "per_head": [round(float(v), 4) for v in per_head]})
        uniform = float(np.mean([1.0 / (q + 1) for q in range(q0, T)]))
        sinks[label] = {"seq_len": T, "first_token_id": int(seq[0]), "query_from": q0,
                        "uniform_reference": uniform, "layers": rows}
        print(json.dumps({label: [(r["layer"], round(r["mean"], 3)) for r in rows],
                          "uniform": uniform}), flush=True)
    res["attention_sinks"] = sinks
    json.dump(res, open(os.path.join(a.out, "eval.json"), "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--corpus", required=True)
    p.add_argument("--tok", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--splits", default="train,heldout")
    p = sub.add_parser("bench")
    add_model_args(p)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train")
    add_model_args(p)
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--calib-steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--long-seq", type=int, default=0,
                   help="if set, the last --long-frac of the steps use this context "
                        "(same tokens per step)")
    p.add_argument("--long-frac", type=float, default=0.1)
    p.add_argument("--shard", default="15MB")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("eval")
    p.add_argument("--data", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--eval-tokens", type=int, default=262144)
    p.add_argument("--unigram-counts", default="",
                   help=".npy of training-token counts (else DATA/train.u16 is counted)")
    p.add_argument("--names", default="", help="docs.tsv written by make_corpus.py")
    p.add_argument("--exclude", default="", help="regex of held-out doc names to skip")
    p.add_argument("--sink-len", type=int, default=4096)
    a = ap.parse_args()
    {"prep": cmd_prep, "bench": cmd_bench, "train": cmd_train, "eval": cmd_eval}[a.cmd](a)


if __name__ == "__main__":
    main()
