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

Prints one JSON object; --check first asserts that the engine at full
budget gives dense attention's outputs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ctxcache.engine import (ContextDecoder, DenseDecoder, EngineOptions,  # noqa: E402
                             HostTier, LlamaStepper)
from gpu_e2e import load_model  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gib(x: int) -> float:
    return round(x / 2**30, 3)


@torch.no_grad()
def make_context(model, n: int, how: str, dev: str, tokens_json: str = ""):
    """K, V [L, H, n, d] bf16 on the GPU."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if how == "random":
        g = torch.Generator(device=dev).manual_seed(1)
        k = torch.randn(L, H, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(L, H, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        return k, v
    if tokens_json:
        doc = [int(x) for x in json.load(open(tokens_json))]
        ids = torch.tensor([(doc * (n // len(doc) + 1))[:n]], device=dev)
    else:
        ids = torch.randint(3, cfg.vocab_size, (1, n), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(2))
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
               warm: int) -> dict:
    first_tokens(stepper, first)
    stepper.position.fill_(n)
    decoder.own.reset()
    stepper.capture()
    first_tokens(stepper, first)
    stepper.position.fill_(n)
    decoder.own.reset()
    for _ in range(warm):
        stepper.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(steps):
        stepper.replay()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1]) / steps
    return {"ms_per_step": round(ms, 3), "tokens_per_s": round(stepper.batch * 1000.0 / ms, 1)}


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
    dense.own.reset()
    sparse.own.reset()
    for _ in range(steps):
        same += int(torch.equal(sd.step(), ss.step()))
    sparse.pool.check()
    assert worst < 2e-2, f"engine at full budget differs from dense attention by {worst}"
    return {"attention_max_abs_err": worst, "greedy_steps_identical": same,
            "greedy_steps": steps}


def profile(stepper, decoder, n: int) -> list:
    from torch.profiler import ProfilerActivity, profile as prof
    stepper.tokens.fill_(5)
    stepper.position.fill_(n)
    decoder.own.reset()
    stepper.step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            stepper.step()
        torch.cuda.synchronize()
    rows = []
    for e in sorted(p.key_averages(), key=lambda e: -e.self_device_time_total)[:14]:
        rows.append({"kernel": e.key[:60], "us_per_step": round(e.self_device_time_total / 3, 1),
                     "calls_per_step": e.count // 3})
    return rows


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
    ap.add_argument("--pool-fraction", type=float, default=0.1)
    ap.add_argument("--tokens-json", default="", help="context token ids (--kv prefill)")
    ap.add_argument("--dense-shared", type=int, default=1,
                    help="1: the batch shares the context (one flash call per layer); "
                         "0: each sequence reads it as its own copy")
    ap.add_argument("--select-algo", default="")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    res = {"bench": "gpu_engine", "device": torch.cuda.get_device_name(), "model": a.model,
           "layers": a.layers, "tokens": a.tokens, "kv": a.kv, "rho": a.rho,
           "pool_fraction": a.pool_fraction, "steps": a.steps,
           "dense_shared": bool(a.dense_shared), "select_algo": a.select_algo or "default"}
    model = load_model(a.model, a.layers, dev)
    weights = torch.cuda.memory_allocated()
    res["weights_gib"] = gib(weights)
    log(f"model {gib(weights)} GiB")
    k, v = make_context(model, a.tokens, a.kv, dev, a.tokens_json)
    L, H, n, d = k.shape
    hq = model.config.num_attention_heads
    log(f"context {tuple(k.shape)}")
    tier = HostTier(L, H, n, d)
    tk, tv = tier.token_view()
    for i in range(L):
        tk[i].copy_(k[i])
        tv[i].copy_(v[i])
    res["context_kv_gib"] = gib(2 * k.numel() * 2)
    if a.check:
        res["check"] = check(model, tier, k, v, dev, n)
        log(f"check {res['check']}")
    first = 11
    dense_rows, sparse_rows = [], []
    batches = [int(x) for x in a.batches.split(",") if x]
    dbatches = [int(x) for x in (a.dense_batches or a.batches).split(",") if x]
    for b in dbatches:
        try:
            torch.cuda.reset_peak_memory_stats()
            dec = DenseDecoder(k, v, b, a.warm + a.steps + 4, shared=bool(a.dense_shared))
            st = LlamaStepper(model, dec, b)
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
    del k, v
    torch.cuda.empty_cache()
    for b in batches:
        try:
            torch.cuda.reset_peak_memory_stats()
            opts = EngineOptions(rho=a.rho, pool_fraction=a.pool_fraction,
                                 select_algo=a.select_algo)
            dec = ContextDecoder(tier, dev, hq, b, a.warm + a.steps + 4, opts)
            st = LlamaStepper(model, dec, b)
            s0 = dec.pool.stats()
            row = {"batch": b, **time_steps(st, dec, n, first, a.steps, a.warm)}
            s1 = dec.pool.stats()
            replays = a.steps + a.warm  # capture's warm-up step is eager
            req = (s1["hit_requests"] + s1["miss_requests"]) - (s0["hit_requests"] +
                                                               s0["miss_requests"])
            row["hit_ratio"] = round((s1["hit_requests"] - s0["hit_requests"]) / max(1, req), 4)
            row["h2d_mib_per_step"] = round((s1["bytes_h2d"] - s0["bytes_h2d"]) / 2**20 /
                                            (replays + 1), 2)
            row["unplaced"] = s1["unplaced"]
            mem = dec.memory()
            row["kp"] = dec.planner.kp
            row["pool_slots"] = dec.pool.n_slots
            row["gib_beyond_weights"] = gib(torch.cuda.max_memory_allocated() - weights)
            row["engine_gib"] = {x: gib(y) for x, y in mem.items()}
            row["gib_per_seq"] = gib((mem["pool"] + mem["index"]) / b + mem["own"] / b)
            row["index_fraction_of_kv"] = round(mem["index"] / (2 * L * H * n * d * 2), 4)
            if a.profile and b == batches[0]:
                row["profile"] = profile(st, dec, n)
            sparse_rows.append(row)
            log(f"sparse {row}")
            del st, dec
        except torch.cuda.OutOfMemoryError:
            sparse_rows.append({"batch": b, "oom": True})
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
    best_s = max((r["tokens_per_s"] for r in sparse_rows if "tokens_per_s" in r), default=0)
    res["throughput_ratio_best"] = round(best_s / best_d, 3) if best_d else None
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
