"""End-to-end decode through the GPU engine (ctxcache.engine) against dense
attention over the same context resident on the GPU, same model, same run.

Both run a whole greedy decode step of an HF Llama (LlamaStepper: every
layer's projections, RoPE, MLP, the argmax) as one CUDA graph replay; only
the attention differs:
  dense   DenseDecoder: the context's K, V [L, H, n, d] on the GPU, shared by
          the batch (one SDPA flash call per layer for the B * G query rows
          of a kv head), merged with each sequence's own tokens by LSE;
  sparse  ContextDecoder: the context in a pinned host tier, an HBM pool of
          --pool-fraction of its pages, Quest bounds as the planner's index,
          misses copied from the host tier by the resolve kernels.

Context: --kv random (K, V ~ N(0, 1), the pessimistic case: selections
change every step) or --kv prefill (the model's own prefill of random
tokens, through HF). The weights are random (--model llama8b, the
Llama-3-8B shape) or a local HF model directory.

--periods runs the engine with each search period (plan every P steps,
EngineOptions.period); --contexts K spreads the batch over K contexts (one
pool and index each, and K resident contexts for dense); --fidelity N
decodes N steps teacher-forced on dense's greedy tokens and reports, per
period, the agreement of the argmax with dense's and KL(dense || sparse) of
the next-token distributions.

Prints one JSON object; --check first asserts that the engine at full
budget gives dense attention's outputs and that the CUDA planner picks the
CPU reference's pages.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ctxcache.engine import (BatchDecoder, ContextDecoder, DenseDecoder,  # noqa: E402
                             EngineOptions, HostTier, LlamaStepper, QuestPlanner)
from ctxcache.engine.llama import fusable  # noqa: E402
from gpu_e2e import load_model  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gib(x: int) -> float:
    return round(x / 2**30, 3)


@torch.no_grad()
def make_context(model, n: int, how: str, dev: str, tokens_json: str = "", seed: int = 0):
    """K, V [L, H, n, d] bf16 on the GPU (context `seed`: another seed, another
    context)."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if how == "random":
        g = torch.Generator(device=dev).manual_seed(1 + seed)
        k = torch.randn(L, H, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(L, H, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        return k, v
    if tokens_json:
        doc = [int(x) for x in json.load(open(tokens_json))]
        doc = doc[seed * 997 % len(doc):] + doc[:seed * 997 % len(doc)]
        ids = torch.tensor([(doc * (n // len(doc) + 1))[:n]], device=dev)
    else:
        ids = torch.randint(3, cfg.vocab_size, (1, n), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(2 + seed))
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    k = torch.empty(L, H, n, d, device=dev, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    for i in range(L):
        lay = cache.layers[i]
        k[i].copy_(lay.keys[0])
        v[i].copy_(lay.values[0])
    del out, cache
    torch.cuda.empty_cache()
    return k, v


def first_tokens(stepper: LlamaStepper, first: int) -> None:
    """Distinct first tokens: the sequences' queries differ from step 1."""
    stepper.tokens.copy_(torch.arange(stepper.batch, device=stepper.tokens.device) * 7 + first)


def time_steps(stepper: LlamaStepper, decoder, n: int, first: int, steps: int,
               warm: int, stats=None) -> dict:
    """Graph replays: `warm` untimed, then `steps` timed; stats() (optional)
    is read around the timed ones and the difference returned as "timed"."""
    first_tokens(stepper, first)
    stepper.position.fill_(n)
    decoder.reset()
    stepper.capture()
    first_tokens(stepper, first)
    stepper.position.fill_(n)
    decoder.reset()
    for _ in range(warm):
        stepper.replay()
    torch.cuda.synchronize()
    s0 = stats() if stats else None
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(steps):
        stepper.replay()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1]) / steps
    out = {"ms_per_step": round(ms, 3), "tokens_per_s": round(stepper.batch * 1000.0 / ms, 1)}
    if stats:
        s1 = stats()
        out["timed"] = {k: s1[k] - s0[k] for k in s0}
    return out


def pool_stats(dec) -> dict:
    """Summed over the contexts' pools."""
    tot: dict = {}
    for d in getattr(dec, "decoders", [dec]):
        for k, x in d.pool.stats().items():
            if k != "n_slots":
                tot[k] = tot.get(k, 0) + x
    return tot


def make_dense(kvs, b: int, max_new: int, shared: bool):
    """One DenseDecoder per context, b / K rows each."""
    per = split_batch(b, len(kvs))
    decs = [DenseDecoder(k, v, bb, max_new, shared=shared) for (k, v), bb in zip(kvs, per)]
    return decs[0] if len(decs) == 1 else BatchDecoder(decs)


def make_sparse(tiers, dev, hq: int, b: int, max_new: int, opts: EngineOptions):
    per = split_batch(b, len(tiers))
    decs = [ContextDecoder(t, dev, hq, bb, max_new, opts) for t, bb in zip(tiers, per)]
    return decs[0] if len(decs) == 1 else BatchDecoder(decs)


def split_batch(b: int, k: int) -> list:
    if b % k:
        raise SystemExit(f"batch {b} is not a multiple of --contexts {k}")
    return [b // k] * k


@torch.no_grad()
def fidelity(model, dense, sparse_by_name: dict, n: int, steps: int, first: int) -> dict:
    """Teacher-forced on dense's greedy continuation: per period, agreement of
    the argmax with dense's and mean KL(dense || sparse) per token."""
    b = dense.batch
    sd = LlamaStepper(model, dense, b, keep_logits=True)
    first_tokens(sd, first)
    sd.position.fill_(n)
    dense.reset()
    teacher, ref = [sd.tokens.clone()], []
    for _ in range(steps):
        sd.step()
        ref.append(torch.log_softmax(sd.logits, dim=-1))
        teacher.append(sd.tokens.clone())
    out = {}
    for name, sparse in sparse_by_name.items():
        ss = LlamaStepper(model, sparse, b, keep_logits=True)
        ss.position.fill_(n)
        sparse.reset()
        agree, kl = 0, 0.0
        for i in range(steps):
            ss.tokens.copy_(teacher[i])
            ss.step()
            lp = torch.log_softmax(ss.logits, dim=-1)
            agree += int((lp.argmax(dim=-1) == ref[i].argmax(dim=-1)).sum())
            kl += float((ref[i].exp() * (ref[i] - lp)).sum())
        out[name] = {"agreement": round(agree / (b * steps), 4),
                            "kl_mean": round(kl / (b * steps), 5),
                            "tokens": b * steps}
    return out


def check_planner(planner: QuestPlanner, layers: int) -> int:
    """The CUDA planner (quest kernel, top-k, fused cap) against the CPU
    reference on integer queries (exact bounds): rows whose pages differ."""
    cpu = QuestPlanner(planner.kmin.cpu(), planner.kmax.cpu(), planner.n_tokens,
                       planner.h * planner.g, planner.batch, planner.page, rho=planner.rho,
                       recent_blocks=planner.n_recent - 1, rank=planner.rank,
                       min_budget=planner.min_budget)
    g = torch.Generator(device="cuda").manual_seed(5)
    bad = 0
    for layer in range(layers):
        q = torch.randint(-3, 4, (planner.batch, planner.h * planner.g, planner.d),
                          device="cuda", generator=g).to(torch.bfloat16)
        got = planner.plan(layer, q).cpu()
        want = cpu.plan(layer, q.cpu())
        for bi in range(planner.batch):
            for h in range(planner.h):
                bad += int(set(got[bi, h].tolist()) != set(want[bi, h].tolist()))
    return bad


def check(model, tier, k, v, dev, n: int) -> dict:
    """Engine at full budget vs dense: attention outputs and greedy tokens."""
    b, steps = 2, 6
    dense = DenseDecoder(k, v, b, steps + 2)
    sparse = ContextDecoder(tier, dev, model.config.num_attention_heads, b, steps + 2,
                            EngineOptions(rho=1.0, pool_fraction=1.0))
    sd, ss = LlamaStepper(model, dense, b), LlamaStepper(model, sparse, b)
    for s in (sd, ss):
        s.tokens.copy_(torch.tensor([11, 12], device=dev))
        s.position.fill_(n)
    worst, same = 0.0, 0
    for _ in range(steps):
        dense.begin_step()
        sparse.begin_step()
        q = torch.randn(b, model.config.num_attention_heads, k.shape[3], device=dev,
                        dtype=torch.bfloat16)
        kk = torch.randn(b, k.shape[1], k.shape[3], device=dev, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        for layer in range(min(2, k.shape[0])):
            a = dense.attend(layer, q, kk, vv)
            s = sparse.attend(layer, q, kk, vv)
            worst = max(worst, (a.float() - s.float()).abs().max().item())
        dense.end_step()
        sparse.end_step()
    dense.reset()
    sparse.reset()
    for _ in range(steps):
        same += int(torch.equal(sd.step(), ss.step()))
    sparse.pool.check()
    assert worst < 2e-2, f"engine at full budget differs from dense attention by {worst}"
    bad = 0
    for rank, min_budget in (("votes", 0), ("max", 0), ("max", 1024)):
        planner = QuestPlanner(sparse.planner.kmin, sparse.planner.kmax, n,
                               sparse.planner.h * sparse.planner.g, 3, rho=0.05, rank=rank,
                               min_budget=min_budget)
        bad += check_planner(planner, min(2, k.shape[0]))
    assert bad == 0, f"the CUDA planner differs from the CPU reference in {bad} rows"
    merge = check_merge(dev)
    assert merge < 2e-2, f"the own-token merge kernel differs from torch by {merge}"
    return {"attention_max_abs_err": worst, "greedy_steps_identical": same,
            "greedy_steps": steps, "planner_rows_differing": bad,
            "own_merge_max_abs_err": merge}


def check_merge(dev) -> float:
    """The Triton own-token merge (engine.attention's CUDA path) against its
    torch reference on the CPU: ragged own lengths, none included."""
    from ctxcache.engine import attention
    g = torch.Generator().manual_seed(7)
    b, h, grp, t, d = 5, 4, 4, 40, 128
    q = torch.randn(b, h * grp, d, generator=g).to(torch.bfloat16)
    tk = torch.randn(b, h, t, d, generator=g).to(torch.bfloat16)
    tv = torch.randn(b, h, t, d, generator=g).to(torch.bfloat16)
    o_ctx = torch.randn(b, h, grp, d, generator=g).to(torch.bfloat16)
    lse = torch.randn(b, h, grp, generator=g) * 3
    n = torch.tensor([0, 1, 17, 33, 40], dtype=torch.int32)
    want = attention._merge_own(q, o_ctx, lse, tk, tv, n).float()
    got = attention._merge_own(*(x.to(dev) for x in (q, o_ctx, lse, tk, tv, n))).float()
    return (got.cpu() - want).abs().max().item()


def profile(stepper, decoder, n: int) -> list:
    from torch.profiler import ProfilerActivity, profile as prof
    stepper.tokens.fill_(5)
    stepper.position.fill_(n)
    decoder.reset()
    stepper.reset()
    stepper.step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(4):
            stepper.step()
        torch.cuda.synchronize()
    rows = []
    for e in sorted(p.key_averages(), key=lambda e: -e.self_device_time_total)[:14]:
        rows.append({"kernel": e.key[:60], "us_per_step": round(e.self_device_time_total / 4, 1),
                     "calls_per_step": e.count / 4})
    return rows


def dense_rows_into(a, model, weights: int, kvs, n: int, first: int, max_new: int,
                    dbatches, fused, res: dict) -> None:
    """res["dense"]: the dense decoder's rows with one kind of model step."""
    dense_rows = []
    for b in dbatches:
        try:
            torch.cuda.reset_peak_memory_stats()
            dec = make_dense(kvs, b, max_new, bool(a.dense_shared))
            st = LlamaStepper(model, dec, b, fused=fused)
            row = {"batch": b, **time_steps(st, dec, n, first, a.steps, a.warm)}
            mem = dec.memory()
            row["gib_beyond_weights"] = gib(torch.cuda.max_memory_allocated() - weights)
            row["kv_gib_per_seq"] = gib(mem["context"] / b + mem["own"] / b)
            dense_rows.append(row)
            log(f"dense {row}")
            del st, dec
        except torch.cuda.OutOfMemoryError:
            dense_rows.append({"batch": b, "oom": True})
            break
        finally:
            torch.cuda.empty_cache()
    res["dense"] = dense_rows


def sparse_rows_into(a, model, weights: int, tiers, dev, hq: int, n: int, first: int,
                     max_new: int, options, tag, configs, batches, fused, kv_bytes: int,
                     res: dict) -> None:
    """res["sparse"] and the throughput ratios against res["dense"], with one
    kind of model step."""
    dense_rows, sparse_rows = res["dense"], []
    for period, union, look in configs:
        for b in batches:
            try:
                torch.cuda.reset_peak_memory_stats()
                dec = make_sparse(tiers, dev, hq, b, max_new, options(period, union, look))
                st = LlamaStepper(model, dec, b, fused=fused)
                row = {"batch": b, "period": period, "union_rho": union,
                       "lookahead": bool(getattr(dec, "lookahead", False)),
                       **time_steps(st, dec, n, first, a.steps, a.warm,
                                    stats=lambda: pool_stats(dec))}
                t = row.pop("timed")
                req = t["hit_requests"] + t["miss_requests"]
                row["hit_ratio_timed"] = round(t["hit_requests"] / max(1, req), 4)
                row["h2d_mib_per_step_timed"] = round(t["bytes_h2d"] / 2**20 / a.steps, 2)
                row["unplaced"] = pool_stats(dec)["unplaced"]
                one = getattr(dec, "decoders", [dec])[0]
                mem = dec.memory()
                row["kp"] = one.union_kp or one.planner.kp
                row["pool_slots"] = one.pool.n_slots
                row["gib_beyond_weights"] = gib(torch.cuda.max_memory_allocated() - weights)
                row["engine_gib"] = {x: gib(y) for x, y in mem.items()}
                row["gib_per_seq"] = gib(sum(mem.values()) / b)
                row["index_fraction_of_kv"] = round(
                    mem["index"] / kv_bytes, 4)
                if a.profile and b == batches[0]:
                    row["profile"] = profile(st, dec, n)
                sparse_rows.append(row)
                log(f"sparse {row}")
                del st, dec
            except torch.cuda.OutOfMemoryError:
                sparse_rows.append({"batch": b, "period": period, "union_rho": union,
                                    "lookahead": look, "oom": True})
                break
            finally:
                torch.cuda.empty_cache()
    res["sparse"] = sparse_rows
    by_b = {r["batch"]: r for r in dense_rows if "ms_per_step" in r}
    for r in sparse_rows:
        if "ms_per_step" in r and r["batch"] in by_b:
            r["speedup_vs_dense_same_batch"] = round(by_b[r["batch"]]["ms_per_step"] /
                                                     r["ms_per_step"], 3)
    best_d = max((r["tokens_per_s"] for r in dense_rows if "tokens_per_s" in r), default=0)
    for period, union, look in configs:
        best_s = max((r["tokens_per_s"] for r in sparse_rows if r.get("period") == period
                      and r.get("union_rho") == union and r.get("lookahead") == look
                      and "tokens_per_s" in r), default=0)
        res[f"throughput_ratio_best_{tag(period, union, look)}"] = (round(best_s / best_d, 3)
                                                             if best_d else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--kv", choices=("random", "prefill"), default="random")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--dense-batches", default="")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--periods", default="1", help="search periods to run, e.g. 1,4")
    ap.add_argument("--lookahead", default="1",
                    help="EngineOptions.lookahead values to run with a period > 1, e.g. 1,0 "
                         "(0: plan in line at each period's first step; tag _inline)")
    ap.add_argument("--union-rhos", default="0",
                    help="batch-union budgets to run (0: each sequence its own pages)")
    ap.add_argument("--rank", default="votes", choices=("votes", "max"))
    ap.add_argument("--min-budget", type=int, default=0, help="budget floor, tokens")
    ap.add_argument("--contexts", type=int, default=1, help="contexts the batch spreads over")
    ap.add_argument("--pool-fraction", type=float, default=0.1)
    ap.add_argument("--cap", choices=("fused", "topk"), default="fused")
    ap.add_argument("--tokens-json", default="", help="context token ids (--kv prefill)")
    ap.add_argument("--dense-shared", type=int, default=1,
                    help="1: the batch shares the context (one flash call per layer); "
                         "0: each sequence reads it as its own copy")
    ap.add_argument("--select-algo", default="")
    ap.add_argument("--fidelity", type=int, default=0,
                    help="teacher-forced steps for agreement and KL vs dense (0: none)")
    ap.add_argument("--fidelity-batch", type=int, default=4)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps-kind", default="auto",
                    help="the model step(s) to time, in order, e.g. fused,modules: fused = "
                         "a layer's elementwise ops as Triton kernels, modules = the HF "
                         "modules' ops; auto = fused where llama.fusable allows")
    a = ap.parse_args()
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    periods = [int(x) for x in a.periods.split(",") if x]
    unions = [float(x) for x in a.union_rhos.split(",") if x]
    looks = [bool(int(x)) for x in a.lookahead.split(",") if x]
    # Lookahead only changes per-sequence pages with a period above 1.
    configs = list(dict.fromkeys((p, u, lk and p > 1 and not u) for u in unions
                                 for p in periods for lk in looks))
    res = {"bench": "gpu_engine", "device": torch.cuda.get_device_name(), "model": a.model,
           "layers": a.layers, "tokens": a.tokens, "kv": a.kv, "rho": a.rho,
           "pool_fraction": a.pool_fraction, "steps": a.steps, "warm": a.warm,
           "contexts": a.contexts, "periods": periods, "union_rhos": unions,
           "lookahead": a.lookahead, "cap": a.cap,
           "rank": a.rank, "min_budget": a.min_budget,
           "dense_shared": bool(a.dense_shared), "select_algo": a.select_algo or "default"}
    model = load_model(a.model, a.layers, dev)
    weights = torch.cuda.memory_allocated()
    res["weights_gib"] = gib(weights)
    log(f"model {gib(weights)} GiB")
    kvs, tiers = [], []
    for c in range(a.contexts):
        k, v = make_context(model, a.tokens, a.kv, dev, a.tokens_json, seed=c)
        L, H, n, d = k.shape
        tier = HostTier(L, H, n, d)
        tk, tv = tier.token_view()
        for i in range(L):
            tk[i].copy_(k[i])
            tv[i].copy_(v[i])
        kvs.append((k, v))
        tiers.append(tier)
    hq = model.config.num_attention_heads
    log(f"{a.contexts} context(s) {tuple(k.shape)}")
    res["context_kv_gib"] = gib(2 * k.numel() * 2)
    if a.check:
        res["check"] = check(model, tiers[0], kvs[0][0], kvs[0][1], dev, n)
        log(f"check {res['check']}")
    first = 11
    max_new = a.warm + a.steps + 8 + a.fidelity

    def options(period: int, union: float = 0.0, look: bool = True) -> EngineOptions:
        return EngineOptions(rho=a.rho, pool_fraction=a.pool_fraction, period=period,
                             select_algo=a.select_algo, fused_cap=a.cap == "fused",
                             rank=a.rank, union_rho=union, min_budget=a.min_budget,
                             lookahead=look)

    def tag(period: int, union: float, look: bool) -> str:
        return (f"p{period}" + (f"_u{union}" if union else "")
                + ("_inline" if period > 1 and not union and not look else ""))

    if a.fidelity:
        fb = a.fidelity_batch
        dense = make_dense(kvs, fb, max_new, True)
        sparse = {tag(p, u, lk): make_sparse(tiers, dev, hq, fb, max_new, options(p, u, lk))
                  for p, u, lk in configs}
        res["fidelity"] = fidelity(model, dense, sparse, n, a.fidelity, first)
        log(f"fidelity {res['fidelity']}")
        del dense, sparse
        torch.cuda.empty_cache()
    batches = [int(x) for x in a.batches.split(",") if x]
    dbatches = [int(x) for x in (a.dense_batches or a.batches).split(",") if x]
    kinds = [x for x in a.steps_kind.split(",") if x]
    fused_of = {"auto": None, "fused": True, "modules": False}
    if not kinds or any(x not in fused_of for x in kinds):
        raise SystemExit(f"--steps-kind: expected a list of {sorted(fused_of)}, got "
                         f"{a.steps_kind!r}")
    outs = {}
    why = fusable(model)
    for kind in kinds:
        # One kind: rows at the top level as before; several: by_steps_kind.
        out = res if len(kinds) == 1 else res.setdefault("by_steps_kind", {}).setdefault(kind, {})
        out["fused"] = fused_of[kind] is not False and not why
        out["not_fused_because"] = why if fused_of[kind] is not False else "asked"
        outs[kind] = out
        dense_rows_into(a, model, weights, kvs, n, first, max_new, dbatches, fused_of[kind],
                        out)
    del kvs, k, v
    torch.cuda.empty_cache()
    for kind in kinds:
        sparse_rows_into(a, model, weights, tiers, dev, hq, n, first, max_new, options, tag,
                         configs, batches, fused_of[kind], a.contexts * 2 * L * H * n * d * 2,
                         outs[kind])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
