#!/usr/bin/env python3
"""Trains the ctxcache reference model: a small LLaMA-architecture model
(training/llama.py: plain torch with HF LlamaForCausalLM's names and
checkpoint layout; nothing downloaded). Reference model v2 (issue 17) mixes the
documentation corpus with synthetic long-context retrieval tasks
(evals/longctx_tasks.py) at 4K-32K tokens.

Subcommands (run from the repository root; GPU machine unless --device cpu):

  prep   --corpus DIR --tok tokenizer.model --data DIR
         [--task-lengths 4096,8192,16384,32768 --tasks-per-length N[,N..] --task-seed S]
         [--eval-docs a.txt,b.txt --eval-lengths ... --eval-depths ... --eval-per-cell K]
         Tokenizes DIR/train.txt(.xz) and DIR/heldout.txt(.xz) (documents separated
         by a line holding only "\\x1e"); each document becomes [<s>] + ids + [</s>].
         Writes DATA/train.u16, DATA/heldout_docs.npz. With --tasks-per-length
         (one count, or one per task length), also generates training tasks from
         the training documents (seeds derived from --task-seed, never the
         held-out EVAL_SEED; split over --procs shards): DATA/tasks.u16 and
         DATA/tasks_index.npy (rows: offset, tokens, answer start, answer length,
         target length, then with --extra-questions K: the number of extra
         questions and K (answer start, answer length) pairs, zero-padded).
         --extra-questions K asks up to K of a task's other needles after its
         answer (longctx_tasks.make_task), each answer trained like the first.
         --var-links N / --var-distractor-chains K / --var-distractor-late P shape
         the training var_track tasks (chains of N links, K other chains, each of
         them after the queried value with probability P; the evaluation keeps 4,
         1 and 0). --var-answer chain makes var_track's answers walk the chain
         back to the value (" VAR C = VAR B = VAR A = 48213"), in the training and
         the evaluation tasks both.
         With --eval-docs: the held-out evaluation tasks
         (EVAL_SEED) in DATA/eval_tasks.jsonl.
  bench  quick throughput test on random tokens (no data needed).
  train  --data DIR --run DIR --minutes M | --steps N
         [--phases 4096:32,8192:16,16384:8,32768:4 --phase-frac 0.35,0.25,0.25,0.15
         --task-frac 0.6 --answer-weight 20]
         AdamW, linear warmup, then cosine decay over the *time* budget M (so the
         schedule needs no calibration and survives a resume), or over N steps
         (deterministic; CPU tests). Phases are (sequence length : rows per step)
         used for the given fractions of the budget; the last phase should be
         >= 16K. Each row is, with probability --task-frac, a task of the phase's
         length (its tokens at the end of the row, a corpus window before it),
         else a corpus window. Loss: next-token cross entropy averaged over the
         targets with weight 1, answer targets with weight --answer-weight
         (lm_loss). Logs (loss, lm_loss, answer_loss, answer_share) to
         RUN/log.jsonl; checkpoints RUN/ckpt.pt every --ckpt-every steps
         and at exit; --resume continues from RUN/ckpt.pt; --chunk-seconds S
         stops after S seconds of this call (checkpointed, no DONE). At the end:
         RUN/final (bf16, HF layout, shards <= 15 MB), RUN/summary.json, RUN/DONE.
  eval   --data DIR --model DIR --out DIR [--run DIR]
         Held-out perplexity at --ppl-lengths (default 1K..32K), unigram baseline,
         attention on token 0 per layer, full-attention exact-match accuracy on
         DATA/eval_tasks.jsonl by family x length x depth (greedy decoding),
         teacher-forced agreement and KL of oracle top-5% sparse attention
         against full on the demo document and scripts/eval-agreement.sh's
         prompts (--sparse-*: that script's measurement in torch), and the loss
         curve (with --run).
  hfcheck --model DIR   (needs transformers) logits of llama.py vs HF
         LlamaForCausalLM on the same checkpoint.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The task generator lives in evals/ beside this folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "evals"))
import llama  # noqa: E402
import longctx_tasks as lt  # noqa: E402

BOS, EOS = llama.BOS, llama.EOS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(a):
    return llama.Config(vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.ffn,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, rope_theta=500000.0,
                        max_position_embeddings=32768, tie_word_embeddings=True)


def add_model_args(ap):
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def autocast(dev):
    if dev == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


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


def family_schedule(weights):
    """The order in which training tasks cycle through the families.

    weights: "" (each family once: lt.FAMILIES) or "name:w,..." with integer
    w >= 0 for families of lt.FAMILIES (a family not named gets 0). The result
    repeats each family w times, interleaved round-robin so that a prefix of the
    cycle keeps roughly the same mix."""
    if not weights:
        return list(lt.FAMILIES)
    w = {}
    for part in weights.split(","):
        name, _, n = part.partition(":")
        if name not in lt.FAMILIES:
            raise SystemExit(f"--family-weights: unknown family {name!r}; expected one of "
                             f"{', '.join(lt.FAMILIES)}")
        if not n.isdigit():
            raise SystemExit(f"--family-weights: weight of {name} must be an integer >= 0, "
                             f"got {n!r}")
        w[name] = int(n)
    out = []
    for r in range(max(w.values(), default=0)):
        out += [f for f in lt.FAMILIES if w.get(f, 0) > r]
    if not out:
        raise SystemExit("--family-weights: at least one weight must be > 0")
    return out


def _task_shard(args):
    """Training tasks from one shard of the training documents: per_length[j]
    tasks of lengths[j], families cycling through `schedule`."""
    (tok_path, docs, lengths, per_length, seed, shard, schedule, n_extra, distractors,
     var_shape) = args
    tok = lt.Tokenizer(tok_path)
    pool = lt.DocumentPool(docs, tok)
    rng = np.random.default_rng([seed, shard])
    depths = rng.uniform(0.0, 1.0, size=sum(per_length))
    ids, rows = [], []
    off = 0
    k = 0
    for length, per in zip(lengths, per_length):
        for i in range(per):
            fam = schedule[i % len(schedule)]
            k += 1
            try:
                t = lt.make_task(pool, tok, fam, length, float(depths[k - 1]), seed, shard, i,
                                 extra_questions=n_extra, distractor_questions=distractors,
                                 var_links=var_shape[0], var_distractor_chains=var_shape[1],
                                 var_distractor_late=var_shape[2], var_answer=var_shape[3])
            except RuntimeError:  # a shard too small for this length
                continue
            seq, spans = t.training_ids()
            seq = seq + [EOS]
            ids.append(np.asarray(seq, dtype=np.uint16))
            row = [off, len(seq), spans[0][0], spans[0][1], length]
            if n_extra:
                row.append(len(spans) - 1)
                for j in range(n_extra):
                    row += list(spans[1 + j]) if 1 + j < len(spans) else [0, 0]
            rows.append(row)
            off += len(seq)
    if not ids:
        return (np.zeros(0, dtype=np.uint16),
                np.zeros((0, 5 + (1 + 2 * n_extra if n_extra else 0)), dtype=np.int64))
    return np.concatenate(ids), np.asarray(rows, dtype=np.int64)


def train_documents(a):
    """The training split: CORPUS/train.txt, then the --extra-train files."""
    docs = read_docs(os.path.join(a.corpus, "train.txt"))
    for path in filter(None, a.extra_train.split(",")):
        if not os.path.exists(path) and not os.path.exists(path + ".xz"):
            raise SystemExit(f"--extra-train: no such file {path}")
        docs += read_docs(path)
    return docs


def cmd_prep(a):
    from multiprocessing import Pool
    os.makedirs(a.data, exist_ok=True)
    train_docs = None
    for split in a.splits.split(","):
        docs = (train_documents(a) if split == "train"
                else read_docs(os.path.join(a.corpus, f"{split}.txt")))
        if split == "train":
            train_docs = docs
        with Pool(a.procs or os.cpu_count()) as pool:
            enc = pool.map(_enc, [(a.tok, d) for d in docs], chunksize=1)
        if split == "train":
            np.concatenate(enc).tofile(os.path.join(a.data, "train.u16"))
        else:
            np.savez(os.path.join(a.data, "heldout_docs.npz"), *enc)
        n = sum(len(e) for e in enc)
        chars = sum(len(d) for d in docs)
        print(json.dumps({"split": split, "docs": len(docs), "tokens": n, "chars": chars,
                          "chars_per_token": chars / n}), flush=True)
    per_length = [int(x) for x in a.tasks_per_length.split(",")]
    if any(per_length):
        if a.task_seed == lt.EVAL_SEED:
            raise SystemExit("--task-seed must differ from the held-out EVAL_SEED")
        if train_docs is None:
            train_docs = train_documents(a)
        procs = a.procs or os.cpu_count()
        lengths = [int(x) for x in a.task_lengths.split(",")]
        if len(per_length) == 1:
            per_length = per_length * len(lengths)
        if len(per_length) != len(lengths):
            raise SystemExit("--tasks-per-length: one count, or one per --task-lengths entry")
        per = [max(1, n // procs) if n else 0 for n in per_length]
        named = [(f"train#{i}", d) for i, d in enumerate(train_docs)]
        schedule = family_schedule(a.family_weights)
        if a.extra_questions < 0:
            raise SystemExit(f"--extra-questions must be >= 0, got {a.extra_questions}")
        try:
            lt.check_var_shape(a.var_links, a.var_distractor_chains, a.var_distractor_late,
                               a.var_answer, ("--var-links", "--var-distractor-chains",
                                              "--var-distractor-late", "--var-answer"))
        except ValueError as e:
            raise SystemExit(str(e))
        jobs = [(a.tok, named[s::procs], lengths, per, a.task_seed, s, schedule,
                 a.extra_questions, not a.no_distractor_questions,
                 (a.var_links, a.var_distractor_chains, a.var_distractor_late, a.var_answer))
                for s in range(procs)]
        t0 = time.time()
        with Pool(procs) as pool:
            parts = pool.map(_task_shard, jobs, chunksize=1)
        ids, rows, off = [], [], 0
        for pid, prow in parts:
            prow = prow.copy()
            prow[:, 0] += off
            off += len(pid)
            ids.append(pid)
            rows.append(prow)
        np.concatenate(ids).tofile(os.path.join(a.data, "tasks.u16"))
        rows = np.concatenate(rows)
        np.save(os.path.join(a.data, "tasks_index.npy"), rows)
        print(json.dumps({"tasks": len(rows), "task_tokens": int(off),
                          "family_cycle": {f: schedule.count(f) for f in lt.FAMILIES},
                          "answers": int(len(rows) + (rows[:, 5].sum() if a.extra_questions
                                                      else 0)),
                          "per_length": {str(L): int((rows[:, 4] == L).sum()) for L in lengths},
                          "seconds": time.time() - t0}), flush=True)
    if a.eval_docs:
        tok = lt.Tokenizer(a.tok)
        pool = lt.DocumentPool(lt.read_docs(a.eval_docs.split(",")), tok)
        n = 0
        with open(os.path.join(a.data, "eval_tasks.jsonl"), "w", encoding="utf-8") as f:
            for t in lt.generate(pool, tok, lt.FAMILIES, [int(x) for x in a.eval_lengths.split(",")],
                                 [float(x) for x in a.eval_depths.split(",")], a.eval_per_cell,
                                 lt.EVAL_SEED, a.var_answer):
                f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
                n += 1
        print(json.dumps({"eval_tasks": n}), flush=True)


def grow_plan(n_src, n_dst, grow_after=""):
    """Where each layer of a grown model comes from: a list of n_dst entries,
    entry i = j (>= 0) for a copy of source layer j, or -(j + 1) for a new
    layer inserted after source layer j. grow_after: comma-separated source
    layer indexes to insert after (a repeat inserts twice); default: spread
    evenly, the last one after the top layer. Raises ValueError on a plan that
    does not give n_dst layers or names a layer outside [0, n_src)."""
    if n_dst < n_src:
        raise ValueError(f"--layers {n_dst}: growth needs at least the source's {n_src}")
    k = n_dst - n_src
    if grow_after:
        try:
            after = sorted(int(x) for x in grow_after.split(","))
        except ValueError:
            raise ValueError(f"--grow-after {grow_after!r}: expected comma-separated integers")
    else:
        after = [n_src - 1 - (i * n_src) // k for i in range(k)][::-1]
    if len(after) != k or any(j < 0 or j >= n_src for j in after):
        raise ValueError(f"--grow-after {grow_after!r}: expected {k} source layer indexes "
                         f"in [0, {n_src})")
    plan = []
    for j in range(n_src):
        plan.append(j)
        plan += [-(j + 1)] * after.count(j)
    return plan


def grow_state_dict(src, plan):
    """src (a Llama state dict) re-laid out by grow_plan's plan: copied layers
    keep their weights; an inserted layer copies the layer it follows, with
    o_proj and down_proj zeroed, so the grown model computes the same function
    (LLaMA Pro's identity blocks). Non-layer tensors are kept."""
    out = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for i, e in enumerate(plan):
        j = e if e >= 0 else -e - 1
        pre = f"model.layers.{j}."
        for k, v in src.items():
            if k.startswith(pre):
                name = k[len(pre):]
                t = v.clone()
                if e < 0 and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    t.zero_()
                out[f"model.layers.{i}.{name}"] = t
    return out


def build_model(a, dev):
    return llama.Llama(model_config(a), seed=a.seed).to(dev)


def task_spans(row):
    """The (answer start, answer length) pairs of a tasks_index.npy row: the
    queried answer, then the extra questions' (see cmd_prep)."""
    out = [(int(row[2]), int(row[3]))]
    if len(row) > 5:
        out += [(int(row[6 + 2 * j]), int(row[7 + 2 * j])) for j in range(int(row[5]))]
    return out


def mean_kl(ref_logits, logits):
    """Mean over rows of KL(softmax(ref_logits) || softmax(logits)) in fp32;
    both [rows, vocab]."""
    return F.kl_div(F.log_softmax(logits.float(), dim=-1),
                    F.log_softmax(ref_logits.float(), dim=-1), log_target=True,
                    reduction="batchmean")


def distill_kl(logits, teacher_logits, text_mask):
    """Mean over the targets where text_mask [B, T] is set of KL(teacher ||
    student) between the next-token distributions (fp32); 0 with no target."""
    sel = text_mask.reshape(-1)
    if not bool(sel.any()):
        return logits.sum() * 0.0
    v = logits.shape[-1]
    return mean_kl(teacher_logits.reshape(-1, v)[sel], logits.reshape(-1, v)[sel])


def lm_loss(model, x, answer_mask=None, answer_weight=1.0, stats=None, distill=None):
    """x [B, T+1] int64. Weighted mean next-token cross entropy (fp32): every
    target counts 1, a target where answer_mask [B, T] is set counts
    answer_weight, and the sum is divided by the total weight. So an answer
    token weighs answer_weight ordinary tokens whatever the batch holds, and
    answer_weight 1 is the plain LM loss. With stats (a dict): stats["lm"] =
    the unweighted mean, stats["answer"] = the mean over answer targets (or
    None), stats["answer_share"] = the answer targets' share of the weight.

    (Reference model v2 run 1 added answer_weight x the *mean* over answer
    targets instead: ~100 answer tokens then weighed as much as the other
    131K tokens of the step, each ~1000x an ordinary token. The gradient was
    that of a ~100-token batch, clipped every step; held-out loss stalled at
    4.7 and the model learned neither language nor the tasks.)

    distill = (teacher, weight, text_mask) adds weight x distill_kl against
    the frozen teacher's logits over the targets where text_mask is set (the
    corpus text of each row, not the tasks: train --distill-from), so the
    model keeps the teacher's behaviour on free text while it learns the
    tasks; stats["distill"] = that KL."""
    logits = model(x[:, :-1])
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                         reduction="none")
    m = None
    if answer_mask is not None:
        m = answer_mask.reshape(-1)
    if m is not None and answer_weight != 1.0:
        w = 1.0 + (answer_weight - 1.0) * m.to(ce.dtype)
        loss = (ce * w).sum() / w.sum()
    else:
        loss = ce.mean()
    kl = None
    if distill is not None:
        teacher, weight, text_mask = distill
        with torch.no_grad():
            t_logits = teacher(x[:, :-1])
        kl = distill_kl(logits, t_logits, text_mask)
        del t_logits
        loss = loss + weight * kl
    if stats is not None:
        with torch.no_grad():
            stats["distill"] = float(kl) if kl is not None else None
            stats["lm"] = float(ce.mean())
            n_ans = int(m.sum()) if m is not None else 0
            stats["answer"] = float(ce[m].mean()) if n_ans else None
            stats["answer_share"] = (answer_weight * n_ans /
                                     (ce.numel() + (answer_weight - 1.0) * n_ans))
    return loss


def cmd_bench(a):
    dev = default_device()
    for seq, batch in [(4096, 32), (8192, 16), (16384, 8), (32768, 4)]:
        m = build_model(a, dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = torch.randint(0, 8192, (batch, seq + 1), device=dev)
        t0 = None
        for i in range(12):
            if i == 4:
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.time()
            with autocast(dev):
                loss = lm_loss(m, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = (time.time() - t0) / 8
        print(json.dumps({"seq": seq, "batch": batch, "step_s": dt, "tok_per_s": batch * seq / dt,
                          "params": sum(p.numel() for p in m.parameters()),
                          "mem_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda"
                          else 0}), flush=True)
        del m, opt
        if dev == "cuda":
            torch.cuda.empty_cache()


def parse_phases(a):
    phases = []
    for p in a.phases.split(","):
        seq, rows = p.split(":")
        phases.append((int(seq), int(rows)))
    fracs = [float(x) for x in a.phase_frac.split(",")]
    if len(fracs) != len(phases) or abs(sum(fracs) - 1) > 1e-6:
        raise SystemExit("--phase-frac: one fraction per phase, summing to 1")
    return phases, np.cumsum(fracs)


class Batcher:
    """Rows of seq+1 tokens: corpus windows, or a task of length seq at the end
    of the row after a corpus window (and its answer mask)."""

    def __init__(self, a, data_dir, gen):
        self.train = np.fromfile(os.path.join(data_dir, "train.u16"), dtype=np.uint16)
        self.gen = gen
        self.task_frac = a.task_frac
        self.tasks = None
        ti = os.path.join(data_dir, "tasks_index.npy")
        if a.task_frac > 0 and os.path.exists(ti):
            self.tasks = np.fromfile(os.path.join(data_dir, "tasks.u16"), dtype=np.uint16)
            self.index = np.load(ti)
            self.by_length = {int(L): np.nonzero(self.index[:, 4] == L)[0]
                              for L in np.unique(self.index[:, 4])}
        elif a.task_frac > 0:
            raise SystemExit(f"--task-frac {a.task_frac}: no {ti} (run prep --tasks-per-length)")

    def batch(self, seq, rows, with_text=False):
        """x [rows, seq+1], the answer mask [rows, seq], the number of task
        rows, and with_text also the text mask [rows, seq]: the targets inside
        each row's corpus window (all of a corpus row, none of its task)."""
        n = len(self.train)
        x = torch.empty(rows, seq + 1, dtype=torch.int64)
        mask = torch.zeros(rows, seq, dtype=torch.bool)
        text = torch.zeros(rows, seq, dtype=torch.bool)
        n_task = 0
        for r in range(rows):
            task = None
            if self.tasks is not None and float(torch.rand(1, generator=self.gen)) < self.task_frac:
                cand = self.by_length.get(seq, [])
                if len(cand):
                    task = self.index[cand[int(torch.randint(len(cand), (1,), generator=self.gen))]]
            fill = seq + 1 - (int(task[1]) if task is not None else 0)
            if fill > 0:
                o = int(torch.randint(0, n - fill, (1,), generator=self.gen))
                x[r, :fill] = torch.from_numpy(self.train[o:o + fill].astype(np.int64))
                # Target p predicts x[p + 1]: corpus text while p + 1 < fill.
                text[r, :fill - 1] = True
            if task is not None:
                off, ln = int(task[0]), int(task[1])
                x[r, fill:] = torch.from_numpy(self.tasks[off:off + ln].astype(np.int64))
                # Target position p predicts x[p + 1]: answer tokens sit at
                # fill + ans .. fill + ans + alen - 1 (the queried answer, then
                # those of the extra questions).
                for ans, alen in task_spans(task):
                    mask[r, fill + ans - 1:fill + ans - 1 + alen] = True
                n_task += 1
        return (x, mask, n_task, text) if with_text else (x, mask, n_task)


def lr_at(a, frac, step):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1, frac))))


def cmd_train(a):
    if (a.minutes > 0) == (a.steps > 0):
        raise SystemExit("train: give exactly one of --minutes M or --steps N")
    if a.answer_weight < 0:
        raise SystemExit(f"--answer-weight must be >= 0, got {a.answer_weight}")
    dev = a.device or default_device()
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    os.makedirs(a.run, exist_ok=True)
    phases, bounds = parse_phases(a)
    model = build_model(a, dev)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for nm, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for nm, p in model.named_parameters() if p.dim() < 2]
    kw = {"fused": True} if dev == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **kw)
    g = torch.Generator().manual_seed(a.seed)
    state = {"step": 0, "tokens": 0, "task_rows": 0, "rows": 0, "elapsed": 0.0, "ema": None}
    ckpt = os.path.join(a.run, "ckpt.pt")
    if a.resume and os.path.exists(ckpt):
        # CPU first: the RNG state must stay a CPU tensor; the optimizer
        # moves its state to the parameters' device.
        c = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        g.set_state(c["gen"])
        state = c["state"]
        print(json.dumps({"resumed": state}), flush=True)
    elif a.init_from:
        # Continued training: the weights of a saved model (HF layout, e.g.
        # models/ctxcache-ref), a fresh optimizer and schedule. The model
        # flags (--hidden, --layers, ...) must describe the same shapes.
        init = llama.from_pretrained(a.init_from)
        mine = model.state_dict()
        src = init.state_dict()
        n_src = init.config.num_hidden_layers
        plan = list(range(n_src))
        if a.layers != n_src or a.grow_after:
            # Depth growth: a new layer is a copy of the layer it follows with
            # its output projections zeroed, so it starts as the identity.
            try:
                plan = grow_plan(n_src, a.layers, a.grow_after)
            except ValueError as e:
                raise SystemExit(f"--init-from {a.init_from}: {e}")
            src = grow_state_dict(src, plan)
        bad = [k for k in mine if k not in src or src[k].shape != mine[k].shape]
        if bad:
            raise SystemExit(f"--init-from {a.init_from}: shapes differ from the model flags "
                             f"at {bad[:3]}")
        model.load_state_dict({k: src[k].to(mine[k].dtype) for k in mine})
        print(json.dumps({"init_from": a.init_from, "layers_from": n_src,
                          "layer_plan": plan}), flush=True)
    teacher = None
    if a.distill_from:
        if a.distill_weight <= 0:
            raise SystemExit(f"--distill-weight must be > 0 with --distill-from, got {a.distill_weight}")
        teacher = llama.from_pretrained(a.distill_from).to(dev).eval()
        for p_ in teacher.parameters():
            p_.requires_grad_(False)
        print(json.dumps({"distill_from": a.distill_from, "distill_weight": a.distill_weight,
                          "teacher_layers": teacher.config.num_hidden_layers}), flush=True)
    batcher = Batcher(a, a.data, g)
    held = np.load(os.path.join(a.data, "heldout_docs.npz"))
    hstream = np.concatenate([held[k] for k in held.files]).astype(np.int64)
    vseq = min(a.val_seq, (len(hstream) - 1))
    nval = max(1, min(8, (len(hstream) - 1) // (vseq + 1)))
    val_x = torch.from_numpy(hstream[:nval * (vseq + 1)].reshape(nval, vseq + 1)).to(dev)

    def val_loss():
        model.eval()
        with torch.no_grad(), autocast(dev):
            v = sum(lm_loss(model, val_x[i:i + 1]).item() for i in range(nval)) / nval
        model.train()
        return v

    def save_ckpt():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": g.get_state(),
                    "state": state}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    budget = a.minutes * 60.0
    log = open(os.path.join(a.run, "log.jsonl"), "a")
    t_call = time.time()
    base_elapsed = state["elapsed"]
    while True:
        elapsed = base_elapsed + (time.time() - t_call)
        frac = state["step"] / a.steps if a.steps else elapsed / budget
        if frac >= 1:
            break
        if a.chunk_seconds and time.time() - t_call >= a.chunk_seconds:
            state["elapsed"] = elapsed
            save_ckpt()
            print(json.dumps({"chunk_done": state}), flush=True)
            log.close()
            return
        seq, rows = phases[int(np.searchsorted(bounds, frac, side="right"))
                           if frac < bounds[-1] else len(phases) - 1]
        lr = lr_at(a, frac, state["step"])
        for grp in opt.param_groups:
            grp["lr"] = lr
        distill = None
        if teacher is not None:
            x, mask, n_task, text = batcher.batch(seq, rows, with_text=True)
            distill = (teacher, a.distill_weight, text.to(dev, non_blocking=True))
        else:
            x, mask, n_task = batcher.batch(seq, rows)
        x, mask = x.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
        logging = (state["step"] + 1) % a.log_every == 0 or state["step"] == 0
        st = {} if logging else None
        with autocast(dev):
            loss = lm_loss(model, x, mask, a.answer_weight, st, distill)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += rows * seq
        state["rows"] += rows
        state["task_rows"] += n_task
        step = state["step"]
        if logging:
            lv = loss.item()
            state["ema"] = (st["lm"] if state["ema"] is None
                            else 0.9 * state["ema"] + 0.1 * st["lm"])
            rec = {"step": step, "loss": lv, "lm_loss": st["lm"], "answer_loss": st["answer"],
                   "answer_share": st["answer_share"], "distill_kl": st["distill"], "lr": lr,
                   "grad_norm": float(gn),
                   "tokens": state["tokens"], "seq": seq, "rows": rows, "task_rows": n_task,
                   "elapsed_s": base_elapsed + time.time() - t_call}
            if step % a.val_every == 0:
                rec["val_loss"] = val_loss()
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % (a.log_every * 10) == 0 or step == 1:
                print(json.dumps(rec), flush=True)
        if step % a.ckpt_every == 0:
            state["elapsed"] = base_elapsed + time.time() - t_call
            save_ckpt()
    state["elapsed"] = base_elapsed + time.time() - t_call
    save_ckpt()
    final = os.path.join(a.run, "final")
    llama.save_pretrained(model, final, dtype=torch.bfloat16, max_shard_bytes=a.shard_bytes)
    train_tokens = len(batcher.train)
    summary = {"steps": state["step"], "tokens": state["tokens"], "train_tokens": train_tokens,
               "epochs": state["tokens"] / train_tokens, "params": nparams,
               "train_seconds": state["elapsed"], "phases": a.phases, "phase_frac": a.phase_frac,
               "task_frac": a.task_frac, "task_rows": state["task_rows"], "rows": state["rows"],
               "answer_weight": a.answer_weight, "lr": a.lr, "warmup": a.warmup,
               "distill_from": a.distill_from, "distill_weight": a.distill_weight,
               "final_loss_ema": state["ema"], "final_val_loss": val_loss(), "val_windows": nval,
               "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "torch": torch.__version__, "cmd": " ".join(sys.argv)}
    json.dump(summary, open(os.path.join(a.run, "summary.json"), "w"), indent=1)
    print(json.dumps(summary), flush=True)
    open(os.path.join(a.run, "DONE"), "w").write("ok\n")


@torch.no_grad()
def window_nll(model, ids, dev):
    x = torch.as_tensor(ids, dtype=torch.int64, device=dev)[None]
    with autocast(dev):
        logits = model(x[:, :-1])
    return F.cross_entropy(logits.float()[0], x[0, 1:], reduction="none").cpu().numpy()


@torch.no_grad()
def attention_on_key0(model, seq, dev, q0=16):
    """Per layer and q head: mean attention weight on key 0 over queries
    q0..T-1 (fp32, computed from the captured post-RoPE q/k)."""
    x = torch.as_tensor(seq, dtype=torch.int64, device=dev)[None]
    rows = []
    c = model.config
    _, cap = llama.attention_inputs(model, x)
    T = x.shape[1]
    cos, sin = model.rope(T, dev)
    for li, layer in enumerate(model.model.layers):
        q, k, _ = layer.self_attn.qkv(cap[li].float(), cos, sin)
        s = torch.matmul(q[:, :, q0:], k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        mask = torch.ones(T - q0, T, dtype=torch.bool, device=dev).triu(q0 + 1)
        p0 = torch.softmax(s.masked_fill(mask, float("-inf")), -1)[0, :, :, 0]
        per_head = p0.mean(dim=1).cpu().numpy()
        rows.append({"layer": li, "mean": float(per_head.mean()), "max_head": float(per_head.max()),
                     "per_head": [round(float(v), 4) for v in per_head]})
    return rows


def sparse_fidelity(model, context, prompts, n_new, rho):
    """scripts/eval-agreement.sh's measurement in torch, with oracle
    selection: for each prompt (token ids) after the context (token ids),
    n_new greedy tokens under full attention, then at each of those n_new
    positions, teacher-forced, whether the sparse run's top-1 is the dense
    one (agreement) and KL(full || sparse) of the next-token distributions
    (llama.tail_logits with rho)."""
    cache = llama.prefix_kv(model, context)
    rows = []
    for p in prompts:
        tail = list(p)
        logits, grown = llama.tail_logits(model, cache, tail, extend=True)
        for i in range(n_new):  # greedy decode step by step on the growing cache
            tail.append(int(logits[-1].argmax()))
            if i + 1 < n_new:
                logits, grown = llama.tail_logits(model, grown, tail[-1:], extend=True)
        tail = tail[:-1]  # the last token's prediction is not scored
        at = slice(len(p) - 1, len(tail))
        full = llama.tail_logits(model, cache, tail)[at]
        sparse = llama.tail_logits(model, cache, tail, rho)[at]
        rows.append({"agreement": (full.argmax(-1) == sparse.argmax(-1)).float().mean().item(),
                     "kl": mean_kl(full, sparse).item()})
    a = [r["agreement"] for r in rows]
    return {"context_tokens": len(context), "prompts": len(rows), "new_tokens": n_new,
            "rho": rho, "agreement_first_prompt": a[0], "agreement_mean": float(np.mean(a)),
            "agreement_min": float(np.min(a)),
            "mean_kl": float(np.mean([r["kl"] for r in rows])), "per_prompt": rows}


def miss_detail(tok, got, answer_ids, answer, context):
    """What a missed task's greedy output was: its text, the first wrong
    position, and whether it restates the context (longctx_tasks.
    answer_in_context; a wrong binding: var_track's distractor chain, another
    key's needle) or not (a copy that drifted). tok: longctx_tasks.Tokenizer."""
    text = tok.sp.decode(got).strip()
    return {"answer": answer.strip(), "got": text,
            "first_wrong": next((i for i, (g, w) in enumerate(zip(got, answer_ids)) if g != w),
                                min(len(got), len(answer_ids))),
            "got_in_context": lt.answer_in_context(text, context)}


def eval_tasks(model, tok, path, dev, limit=0):
    """Greedy exact match of every task in the JSONL under full attention;
    the context is tokenized with `tok` (longctx_tasks.Tokenizer). A missed
    task's row also has miss_detail's fields."""
    res = {"by": {}, "tasks": []}
    with open(path, encoding="utf-8") as f:
        lines = [l for l in f if l.strip()]
    if limit:
        lines = lines[:limit]
    for line in lines:
        t = json.loads(line)
        ids = [BOS] + tok.encode(t["context"]) + t["question_ids"]
        got = model.greedy(ids, len(t["answer_ids"]))
        ok = got == t["answer_ids"]
        row = {"id": t["id"], "family": t["family"], "length": t["length"],
               "depth": t["depth"], "correct": ok}
        if not ok:
            row.update(miss_detail(tok, got, t["answer_ids"], t["answer"], t["context"]))
        res["tasks"].append(row)
        for key in ("all", f"family:{t['family']}", f"length:{t['length']}",
                    f"depth:{t['depth']:.2f}", f"family:{t['family']}/length:{t['length']}"):
            c = res["by"].setdefault(key, [0, 0])
            c[0] += int(ok)
            c[1] += 1
    res["accuracy"] = {k: v[0] / v[1] for k, v in res["by"].items()}
    return res


def cmd_eval(a):
    dev = a.device or default_device()
    os.makedirs(a.out, exist_ok=True)
    res = {}
    if a.run and os.path.exists(os.path.join(a.run, "log.jsonl")):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        recs = [json.loads(l) for l in open(os.path.join(a.run, "log.jsonl"))]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["tokens"] / 1e6 for r in recs], [r["loss"] for r in recs], lw=0.8,
                label="train (batch, incl. answer term)")
        vr = [r for r in recs if "val_loss" in r]
        ax.plot([r["tokens"] / 1e6 for r in vr], [r["val_loss"] for r in vr], "o-", ms=3,
                label="held-out")
        ax.set_ylim(top=min(8.0, max(r["loss"] for r in recs)))
        ax.legend()
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title("ctxcache-ref training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "loss_curve.png"), dpi=110)
    t0 = time.time()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = llama.from_pretrained(a.model, dtype=dtype, device=dev)
    res["load_seconds"] = time.time() - t0
    res["params"] = sum(p.numel() for p in model.parameters())
    held = np.load(os.path.join(a.data, "heldout_docs.npz"))
    docs = [held[k].astype(np.int64) for k in held.files]
    names = [f"doc{i}" for i in range(len(docs))]
    if a.names:  # docs.tsv from make_corpus.py: held-out rows are in file order
        names = [l.split("\t")[1] for l in open(a.names).read().splitlines()[1:]
                 if l.startswith("heldout\t")]
        assert len(names) == len(docs), (len(names), len(docs))
    keep = [i for i in range(len(docs)) if not (a.exclude and re.search(a.exclude, names[i]))]
    res["excluded_docs"] = [names[i] for i in range(len(docs)) if i not in keep]
    order = sorted(keep, key=lambda i: len(docs[i]), reverse=True)
    longest = [docs[i] for i in order]
    res["heldout_long_docs"] = [(names[i], int(len(docs[i]))) for i in order[:6]]
    if a.unigram_counts:
        counts = np.load(a.unigram_counts).astype(np.float64) + 1.0
    else:
        tr = np.fromfile(os.path.join(a.data, "train.u16"), dtype=np.uint16)
        counts = np.bincount(tr, minlength=8192).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    ppl = {}
    for L in [int(x) for x in a.ppl_lengths.split(",")]:
        nll, tail, uni, nwin = [], [], [], 0
        for d in longest:
            for s in range(0, len(d) - L - 1 + 1, L):
                if sum(len(v) for v in nll) >= a.eval_tokens:
                    break
                w = d[s:s + L + 1]
                v = window_nll(model, w, dev)
                nll.append(v)
                tail.append(v[-512:])
                uni.append(-logp[w[1:]])
                nwin += 1
        if not nll:
            ppl[str(L)] = {"windows": 0, "note": "no held-out document is that long"}
            continue
        allv = np.concatenate(nll)
        ppl[str(L)] = {"windows": nwin, "tokens": int(allv.size), "nll": float(allv.mean()),
                       "ppl": float(np.exp(allv.mean())),
                       "ppl_last512": float(np.exp(np.concatenate(tail).mean())),
                       "unigram_ppl_same_tokens": float(np.exp(np.concatenate(uni).mean()))}
        print(json.dumps({"ctx": L, **ppl[str(L)]}), flush=True)
    res["perplexity"] = ppl
    res["eval_tokens_per_context"] = a.eval_tokens
    sinks = {}
    for label, seq in (("doc_start", longest[0][:a.sink_len]),
                       ("mid_doc", longest[min(1, len(longest) - 1)][5000:5000 + a.sink_len])):
        if len(seq) <= 32:
            continue
        rows = attention_on_key0(model.float(), seq, dev)
        model.to(dtype)
        T = len(seq)
        uniform = float(np.mean([1.0 / (q + 1) for q in range(16, T)]))
        sinks[label] = {"seq_len": T, "first_token_id": int(seq[0]), "query_from": 16,
                        "uniform_reference": uniform, "layers": rows}
        print(json.dumps({label: [(r["layer"], round(r["mean"], 3)) for r in rows],
                          "uniform": uniform}), flush=True)
    res["attention_sinks"] = sinks
    tok = lt.Tokenizer(a.tok or os.path.join(a.model, "tokenizer.model"))
    if a.sparse_new:
        t0 = time.time()
        context = [BOS] + tok.encode(open(a.sparse_doc, encoding="utf-8").read())
        prompts = [tok.encode(p) for p in json.load(open(a.sparse_prompts))]
        if not prompts:
            raise SystemExit(f"--sparse-prompts: {a.sparse_prompts} holds no prompt")
        # fp32 as on the CPU, where SPARSE_MAX_KL (device_sweep.sh) was set:
        # in bf16 v2's KL is 0.0263 against 0.0277 (H100, docs/history.md run 9).
        sf = sparse_fidelity(model.float(), context, prompts, a.sparse_new, a.sparse_rho)
        model.to(dtype)
        sf["seconds"] = time.time() - t0
        res["sparse_fidelity"] = sf
        print(json.dumps({"sparse_fidelity": {k: v for k, v in sf.items()
                                              if k != "per_prompt"}}), flush=True)
    tasks = a.tasks or os.path.join(a.data, "eval_tasks.jsonl")
    if os.path.exists(tasks):
        t0 = time.time()
        tr = eval_tasks(model, tok, tasks, dev, a.task_limit)
        tr["seconds"] = time.time() - t0
        res["tasks"] = tr
        print(json.dumps({"task_accuracy": {k: round(v, 3) for k, v in tr["accuracy"].items()
                                            if "/" not in k}}), flush=True)
    json.dump(res, open(os.path.join(a.out, "eval.json"), "w"), indent=1)


def cmd_hfcheck(a):
    from transformers import LlamaForCausalLM
    dev = a.device or default_device()
    ours = llama.from_pretrained(a.model, dtype=torch.float32, device=dev)
    hf = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                          attn_implementation="eager").to(dev).eval()
    x = torch.randint(3, ours.config.vocab_size, (1, 256), device=dev,
                      generator=torch.Generator(device=dev).manual_seed(0))
    with torch.no_grad():
        d = (ours(x) - hf(input_ids=x).logits).abs().max().item()
    print(json.dumps({"hfcheck_max_abs_logit_diff": d}), flush=True)
    if d > 1e-3:
        raise SystemExit(f"llama.py and transformers disagree: {d}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--corpus", required=True)
    p.add_argument("--tok", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--splits", default="train,heldout")
    p.add_argument("--extra-train", default="",
                   help="more training documents (comma-separated files in the corpus format, "
                        ".xz ok; make_corpus.py's train_extra.txt): LM text and task haystacks")
    p.add_argument("--procs", type=int, default=0, help="worker processes (0 = all cores)")
    p.add_argument("--task-lengths", default="4096,8192,16384,32768")
    p.add_argument("--tasks-per-length", default="0",
                   help="training tasks per length: one count, or one per --task-lengths entry")
    p.add_argument("--task-seed", type=int, default=1)
    p.add_argument("--extra-questions", type=int, default=0,
                   help="ask up to K of a training task's other needles after its answer "
                        "(niah_multi 3, kv_table 23, var_track 7, section_copy 5, niah_single 0)")
    p.add_argument("--no-distractor-questions", action="store_true",
                   help="extra questions skip distractor needles (var_track asks only the "
                        "queried chain's 3 earlier links, not the other chain's 4)")
    p.add_argument("--var-links", type=int, default=4,
                   help="links per var_track chain in the training tasks (the evaluation: 4)")
    p.add_argument("--var-distractor-chains", type=int, default=1,
                   help="other chains per var_track training task (the evaluation: 1)")
    p.add_argument("--var-distractor-late", type=float, default=0.0,
                   help="probability that a var_track training task's other chain lies wholly "
                        "after its queried value (the evaluation: 0; the held-out misses are "
                        "mostly that layout, var_track_layout.py)")
    p.add_argument("--var-answer", default=lt.VAR_ANSWER, choices=lt.VAR_ANSWERS,
                   help="var_track's answer format, in the training tasks and the evaluation "
                        "tasks alike: the value, or the chain walked back to it")
    p.add_argument("--family-weights", default="",
                   help='training task mix, "niah_single:1,section_copy:3,..." (default: equal)')
    p.add_argument("--eval-docs", default="", help="held-out documents for the evaluation tasks")
    p.add_argument("--eval-lengths", default="4096,8192,16384,32768")
    p.add_argument("--eval-depths", default="0.05,0.25,0.5,0.75,0.95")
    p.add_argument("--eval-per-cell", type=int, default=2)
    p = sub.add_parser("bench")
    add_model_args(p)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train")
    add_model_args(p)
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--minutes", type=float, default=0, help="training time budget")
    p.add_argument("--steps", type=int, default=0,
                   help="step budget instead of --minutes (deterministic; CPU tests)")
    p.add_argument("--device", default="")
    p.add_argument("--phases", default="4096:32,8192:16,16384:8,32768:4",
                   help="seq:rows per step, in order")
    p.add_argument("--phase-frac", default="0.35,0.25,0.25,0.15",
                   help="fraction of the time (or step) budget per phase")
    p.add_argument("--task-frac", type=float, default=0.6)
    p.add_argument("--answer-weight", type=float, default=20.0,
                   help="weight of an answer target against an ordinary one (1: plain LM)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--val-seq", type=int, default=8192)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default="",
                   help="start from this saved model's weights (not with a checkpoint in --run)")
    p.add_argument("--distill-from", default="",
                   help="a saved model (HF layout) whose next-token distributions the model keeps "
                        "on the corpus text of each row: loss += weight x KL(teacher || model)")
    p.add_argument("--distill-weight", type=float, default=1.0)
    p.add_argument("--grow-after", default="",
                   help="with --init-from and more --layers than the saved model: source "
                        "layers to insert a new (identity-initialized) layer after, comma-"
                        "separated; default spread evenly")
    p.add_argument("--chunk-seconds", type=float, default=0,
                   help="stop (checkpointed) after this many seconds of this call; 0 = run out")
    p.add_argument("--shard-bytes", type=int, default=15_000_000)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("eval")
    p.add_argument("--data", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--run", default="")
    p.add_argument("--device", default="")
    p.add_argument("--tok", default="", help="sentencepiece model (default MODEL/tokenizer.model)")
    p.add_argument("--tasks", default="", help="eval tasks JSONL (default DATA/eval_tasks.jsonl)")
    p.add_argument("--task-limit", type=int, default=0)
    p.add_argument("--ppl-lengths", default="1024,4096,8192,16384,32768")
    p.add_argument("--eval-tokens", type=int, default=262144)
    p.add_argument("--unigram-counts", default="",
                   help=".npy of training-token counts (else DATA/train.u16 is counted)")
    p.add_argument("--names", default="", help="docs.tsv written by make_corpus.py")
    p.add_argument("--exclude", default="", help="regex of held-out doc names to skip")
    p.add_argument("--sink-len", type=int, default=4096)
    p.add_argument("--sparse-doc", default=os.path.join(ROOT, "tests", "data", "demo", "document.txt"),
                   help="context of the sparse-fidelity proxy (scripts/eval-agreement.sh's)")
    p.add_argument("--sparse-prompts",
                   default=os.path.join(ROOT, "tests", "data", "demo", "agreement_prompts.json"),
                   help="JSON list of prompt strings placed after --sparse-doc")
    p.add_argument("--sparse-new", type=int, default=64,
                   help="greedy tokens per prompt scored (0 = skip the proxy)")
    p.add_argument("--sparse-rho", type=float, default=0.05)
    p = sub.add_parser("hfcheck")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="")
    a = ap.parse_args()
    {"prep": cmd_prep, "bench": cmd_bench, "train": cmd_train, "eval": cmd_eval,
     "hfcheck": cmd_hfcheck}[a.cmd](a)


if __name__ == "__main__":
    main()
