"""End-to-end decode on the GPU against a running ctxcached, for a long
context: (a) HF's own dense decoding with the whole KV loaded from ctxcache
onto the GPU against (b) the same model through the GPU engine
(``hf.generate_engine``) (the scripts/gpu-suite.sh stage gpu_e2e).

1. Loads the model: an HF LLaMA-family checkpoint (``--model PATH``), or
   ``--model llama8b``: the Llama-3-8B shape (32 q / 8 kv heads, d 128,
   hidden 4096, MLP 14336, vocab 128256) with random bf16 weights and
   ``--layers`` layers (say how many in the table).
2. Prefills ``--tokens`` context tokens with HF (the ``--tokens-json``
   document, repeated to length, or random ids for llama8b) and ingests
   the post-RoPE K/V/Q (csa built server-side): prefill and ingest seconds,
   ingest tokens/s.
3. (a) dense: FetchPages of every page of every layer, the K/V placed in an
   HF cache on the GPU, then ``--n-new`` greedy steps with the model's own
   SDPA attention, eagerly (HF's decode loop). TTFT = the fetch + the first
   step.
4. (b) ``hf.generate_engine``: the context bulk-loaded into a pinned host
   tier, the model's step as CUDA graph replays, no RPC while decoding:
   ``engine_dense`` (the whole KV copied to the GPU, DenseDecoder: the
   baseline through the same code) and ``engine_sparse_P<p>`` (Quest pages
   at ``--engine-rho`` with ``rank=max``, ``min_budget=1024``, an HBM pool of
   ``--pool-frac`` of the pages, search period p), each at every batch of
   ``--engine-batches`` (sequence 0 feeds the context's last token, the
   others random tokens; at batch 1 teacher-forced on (a)'s tokens for the
   agreement), cold (the bulk load in TTFT) and ``_warm`` (a tier loaded
   before the call, as a worker keeps it), and ``_reused``: the second call
   of an ``hf.EngineDecoding`` kept between calls (decoder and graphs made
   once). One untimed call first compiles the kernels (a worker does that
   once).
Peak GPU memory is measured per phase (torch.cuda.max_memory_allocated,
reset before each) and given with and without the weights. Prints and
writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def load_model(name: str, layers: int, dev: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if name != "llama8b":
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                    attn_implementation="sdpa").to(dev).eval()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def context_tokens(a, vocab: int) -> list:
    if a.tokens_json:
        doc = [int(x) for x in json.load(open(a.tokens_json))]
        reps = (a.tokens + 1 + len(doc) - 1) // len(doc)
        return (doc * reps)[:a.tokens + 1]
    rng = np.random.default_rng(7)
    return [int(x) for x in rng.integers(3, vocab, size=a.tokens + 1)]


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


@torch.no_grad()
def load_dense_cache(client, model, info, dev: str):
    """The whole KV fetched into an HF cache on the GPU: (cache, seconds, bytes)."""
    from transformers import DynamicCache

    m = info.model
    n, b = int(info.n_tokens), int(info.block_tokens) or 16
    n_pages = (n + b - 1) // b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cache = DynamicCache()
    fetched = 0
    for layer in range(int(m.n_layers)):
        pages = client.fetch_pages(info.context_id,
                                   [(layer, h, list(range(n_pages))) for h in range(m.n_kv_heads)],
                                   dtype="raw", as_torch=True)
        k = torch.empty(int(m.n_kv_heads), n, int(m.head_dim), dtype=torch.bfloat16)
        v = torch.empty_like(k)
        for p in pages:
            t = int(p.n_tokens)
            k[p.kv_head, p.block * b:p.block * b + t] = p.k.view(t, -1)
            v[p.kv_head, p.block * b:p.block * b + t] = p.v.view(t, -1)
            fetched += 2 * p.k.numel() * p.k.element_size()
        cache.update(k[None].to(dev, non_blocking=True), v[None].to(dev, non_blocking=True),
                     layer)
    torch.cuda.synchronize()
    return cache, time.perf_counter() - t0, fetched


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


@torch.no_grad()
def dense_steps(model, cache, first: int, position: int, n_new: int, dev: str,
                backend: str = "flash"):
    """Greedy steps with the model's own (SDPA) attention over ``cache``,
    restricted to one SDPA ``backend`` (flash: FlashAttention-2; without the
    restriction torch 2.11 picks cuDNN on an H100, which builds a new graph
    for every new KV length, ~5 ms per layer-step): (tokens, per-step seconds)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
        return _dense_steps(model, cache, first, position, n_new, dev)


def _dense_steps(model, cache, first: int, position: int, n_new: int, dev: str):
    tokens, steps = [], []
    tok = torch.tensor([[first]], device=dev)
    for i in range(n_new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position + i]], device=dev))
        nxt = int(torch.argmax(out.logits[0, -1]))
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        tokens.append(nxt)
        tok = torch.tensor([[nxt]], device=dev)
    return tokens, steps


def dense_from_ctxcache(client, model, info, first: int, n_new: int, dev: str,
                        backend: str = "flash") -> dict:
    """(a): the whole KV fetched into an HF cache, then native decoding."""
    cache, load_s, fetched = load_dense_cache(client, model, info, dev)
    tokens, steps = dense_steps(model, cache, first, int(info.n_tokens), n_new, dev, backend)
    del cache
    return {"tokens": tokens, "load_kv_s": load_s, "bytes_loaded": fetched, "sdpa": backend,
            "ttft_s": load_s + steps[0], "step_ms_p50": 1e3 * statistics.median(steps),
            "tokens_per_s": n_new / sum(steps)}


def profile_of(fn) -> dict:
    """fn() under torch.profiler (CPU + CUDA; the ctxcache.* ranges of
    ctxcache.torch.hf) and, in a second run, under
    cProfile: the top rows."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(50)
    return {"torch_by_cpu_total": ka.table(sort_by="cpu_time_total", row_limit=50),
            "torch_by_device_total": ka.table(sort_by="cuda_time_total", row_limit=30),
            "cprofile_cumulative": text.getvalue()}


@torch.no_grad()
def prefill_first_token(model, ids) -> tuple:
    """HF prefill of ids, to the argmax of the last position: (seconds, cache, token)."""
    x = torch.tensor([ids], device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    tok = int(torch.argmax(out.logits[0, -1]))
    torch.cuda.synchronize()
    return time.perf_counter() - t, out.past_key_values, tok


@torch.no_grad()
def plain_prefill(model, ids: list) -> float:
    """What the cache saves: HF's own prefill of the context plus the first
    token to the first token's argmax, one forward (after a short warm-up):
    seconds."""
    prefill_first_token(model, ids[:256])
    secs, cache, _ = prefill_first_token(model, ids)
    del cache
    torch.cuda.empty_cache()
    return secs


def engine_runs(a, c, model, info, first: int, dense_tokens: list, res: dict, save) -> None:
    """Step 4 (module docstring): hf.generate_engine, dense and sparse, cold
    and warm, at each batch."""
    from ctxcache import native
    from ctxcache.engine import EngineOptions, HostTier
    from ctxcache.torch import hf

    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    with native.NativeClient(a.server, timeout=900) as nc:
        t = time.perf_counter()
        warm = HostTier.from_server(nc, info.context_id)
        with warm.load:
            warm.load.wait()
        res["engine_tier_load_s"] = time.perf_counter() - t
        kinds = [("engine_dense", "dense", None)] + [
            (f"engine_sparse_P{p}", "sparse",
             EngineOptions(rho=a.engine_rho, rank="max", min_budget=1024,
                           pool_fraction=a.pool_frac, period=p))
            for p in (int(x) for x in a.engine_periods.split(","))]
        for b in (int(x) for x in a.engine_batches.split(",")):
            firsts = [first] + [int(x) for x in rng.integers(3, vocab, size=b - 1)]
            forced = [dense_tokens] if b == 1 else None
            for _, att, opts in kinds:  # compiles this batch's kernels, untimed
                hf.generate_engine(c, model, info, firsts, a.n_new, attention=att,
                                   options=opts, tier=warm)
            for name, att, opts in kinds:
                for tier, tag in ((None, ""), (warm, "_warm")):
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    out = hf.generate_engine(c, model, info, firsts, a.n_new, attention=att,
                                             options=opts, forced=forced, tier=tier,
                                             native=nc)
                    row = {"batch": b, "ttft_s": out.ttft_s, "load_s": out.load_s,
                           "setup_s": out.setup_s, "tokens_per_s": out.tokens_per_s,
                           "step_ms": 1e3 * out.decode_s / max(1, a.n_new - 1),
                           "memory_gib": {k: v / 2**30 for k, v in out.memory.items()},
                           "peak_gib_over_start": (torch.cuda.max_memory_allocated()
                                                   - before) / 2**30}
                    if forced is not None:
                        row["agreement_with_dense"] = float(np.mean(
                            [x == y for x, y in zip(out.tokens[0], dense_tokens)]))
                    if out.pool:
                        row["pool"] = out.pool
                        row["bytes_h2d_per_step"] = out.pool["bytes_h2d"] / a.n_new
                    if tag == "" and b == 1:
                        row["ttft_vs_plain_prefill"] = res["plain_prefill_s"] / out.ttft_s
                    key = f"{name}{tag}_B{b}"
                    res[key] = row
                    log(f"{key}: {row}")
                    save()
                    del out
                # A decoder kept between calls (hf.EngineDecoding, as a worker
                # keeps one per context and batch size): a second call's TTFT.
                eng = hf.EngineDecoding(model, warm, b, a.n_new, attention=att, options=opts)
                eng.generate(firsts, a.n_new, forced)
                out = eng.generate(firsts, a.n_new, forced)
                row = {"batch": b, "ttft_s": out.ttft_s, "tokens_per_s": out.tokens_per_s,
                       "decoder_setup_s": eng.setup_s}
                if out.pool:
                    row["pool"] = out.pool
                if b == 1:
                    row["ttft_vs_plain_prefill"] = res["plain_prefill_s"] / out.ttft_s
                res[f"{name}_reused_B{b}"] = row
                log(f"{name}_reused_B{b}: {row}")
                save()
                del eng, out
            dn = res[f"engine_dense_warm_B{b}"]
            hf_tps = res["dense"]["tokens_per_s"]
            res[f"engine_ratio_B{b}"] = {"engine_dense_vs_hf_dense": dn["tokens_per_s"] / hf_tps}
            for name, _, _ in kinds[1:]:
                sp = res[f"{name}_warm_B{b}"]
                res[f"engine_ratio_B{b}"][f"{name}_vs_engine_dense"] = (sp["tokens_per_s"]
                                                                      / dn["tokens_per_s"])
                res[f"engine_ratio_B{b}"][f"{name}_vs_hf_dense"] = sp["tokens_per_s"] / hf_tps
        del warm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", default="models/ctxcache-ref",
                    help="an HF checkpoint directory, or llama8b (random weights)")
    ap.add_argument("--layers", type=int, default=8, help="llama8b: layers")
    ap.add_argument("--tokens", type=int, default=32768, help="context tokens")
    ap.add_argument("--tokens-json", default="", help="a document's token ids (repeated)")
    ap.add_argument("--n-new", type=int, default=32)
    ap.add_argument("--pool-frac", type=float, default=0.10,
                    help="(b)'s HBM page pool: this share of the context's pages")
    ap.add_argument("--out", default="")
    ap.add_argument("--csa-params", default="",
                    help="k=v,... build params of the csa index (e.g. rerank=0)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed runs, this many steps of (a) and of (b) under "
                         "torch.profiler and cProfile, written to --profile-out")
    ap.add_argument("--profile-out", default="e2e-profile.json")
    ap.add_argument("--dense-sdpa", default="flash", choices=sorted(SDPA_BACKENDS),
                    help="(a)'s SDPA backend")
    ap.add_argument("--engine-batches", default="1", help="engine batch sizes")
    ap.add_argument("--engine-periods", default="1,4", help="engine search periods")
    ap.add_argument("--engine-rho", type=float, default=0.05, help="engine page budget")
    a = ap.parse_args()

    import ctxcache
    from ctxcache.torch import hf

    dev = "cuda"
    log(f"loading {a.model}")
    model = load_model(a.model, a.layers, dev)
    cfg = model.config
    weights = torch.cuda.memory_allocated()
    ids = context_tokens(a, cfg.vocab_size)
    context, first = ids[:-1], ids[-1]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": a.model, "layers": cfg.num_hidden_layers,
           "shape": {"n_q_heads": cfg.num_attention_heads,
                     "n_kv_heads": cfg.num_key_value_heads,
                     "head_dim": getattr(cfg, "head_dim", None)
                     or cfg.hidden_size // cfg.num_attention_heads},
           "n_context": len(context), "n_new": a.n_new, "pool_frac": a.pool_frac,
           "weights_gib": weights / 2**30}

    def save() -> None:
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    with ctxcache.Client(a.server, timeout=900) as c:
        log(f"prefill + ingest of {len(context)} tokens")
        csa_params = dict(kv.split("=", 1) for kv in a.csa_params.split(",") if kv)
        res["csa_params"] = csa_params
        info, pre = hf.prefill_and_ingest(c, model, context,
                                          indexes=[("csa", csa_params)] if csa_params else ["csa"],
                                          name="gpu-e2e")
        res["prefill_s"] = pre.seconds  # with every layer's Q captured and K/V/Q copied out
        res["ingest_s"] = pre.ingest_s
        res["ingest_tokens_per_s"] = len(context) / pre.ingest_s
        res["ttft_prefill_ingest_s"] = pre.seconds + pre.ingest_s
        del pre
        torch.cuda.empty_cache()
        res["plain_prefill_s"] = plain_prefill(model, context + [first])
        res["kv_gib"] = (2 * cfg.num_hidden_layers * res["shape"]["n_kv_heads"] * len(context)
                         * res["shape"]["head_dim"] * 2) / 2**30
        log(f"ingested in {res['ingest_s']:.1f} s; (a) dense with the KV from ctxcache")
        save()

        torch.cuda.reset_peak_memory_stats()
        dense = dense_from_ctxcache(c, model, info, first, a.n_new, dev, a.dense_sdpa)
        dense["peak_gib"] = peak_gib()
        dense["peak_gib_minus_weights"] = dense["peak_gib"] - weights / 2**30
        res["dense"] = {k: v for k, v in dense.items() if k != "tokens"}
        log(f"dense: {res['dense']}")
        save()
        torch.cuda.empty_cache()

        engine_runs(a, c, model, info, first, dense["tokens"], res, save)
        if a.profile_steps:
            log(f"profiling {a.profile_steps} steps of (a) and (b)")
            k = a.profile_steps
            prof = {}
            cache, _, _ = load_dense_cache(c, model, info, dev)
            pos = [len(context)]

            def dense_run():
                dense_steps(model, cache, first, pos[0], k, dev, a.dense_sdpa)
                pos[0] += k
            prof["dense"] = profile_of(dense_run)
            del cache
            torch.cuda.empty_cache()
            from ctxcache.engine import EngineOptions
            prof["engine_sparse"] = profile_of(lambda: hf.generate_engine(
                c, model, info, [first], k, options=EngineOptions(
                    rho=a.engine_rho, rank="max", min_budget=1024, pool_fraction=a.pool_frac)))
            with open(a.profile_out, "w") as f:
                json.dump(prof, f, indent=1)
        c.evict(info.context_id)
    print(json.dumps(res, indent=1))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
