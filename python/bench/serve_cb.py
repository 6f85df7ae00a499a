"""transformers' continuous batching with and without ctxcache as its prefix
store (ctxcache.serving.transformers_cb), on the GPU, in one run.

Workloads (each step bounded; a failed or timed-out step is reported in the
JSON and the next one still runs):
  speed    for each --contexts length L: --n-contexts stored contexts of L
           tokens and --requests requests spread over them (the context, then
           --question-tokens tokens of its own), --new-tokens greedy tokens each,
           through transformers' continuous batching with paged SDPA
           ("paged|sdpa"), three times with a fresh engine each:
             plain           model's own ContinuousBatchingManager (its own
                             prefix sharing on: the context is prefilled once);
             ctxcache_cold   CtxcacheBackend, host KV cache empty (the load
                             from ctxcached counts);
             ctxcache_warm   CtxcacheBackend again, context KV in host memory;
             ctxcache_cold_kept  (with --shm-cache-mb > 0) the host KV cache
                             emptied again: the load maps the segment that
                             ctxcached kept from the cold run;
           then, for each further --attention mode (sparse: ServingOptions
           attention="sparse", --sparse-rho, --sparse-min-tokens), a cold
           and a warm run of a backend in that mode (ctxcache_sparse_cold,
           ctxcache_sparse_warm), compared with plain the same way.
           TTFT per request = its first token's timestamp minus the moment all
           requests were submitted; throughput = generated tokens / wall time.
  full     with every speed run: the greedy tokens of ctxcache_cold and
           ctxcache_warm against plain, request by request (identical
           expected: the stored KV is the engine's own, captured from its
           paged cache after a prefill of the context, capture_prefix_kv).
  tasks    --tasks JSONL (evals/longctx_tasks.py with context_ids, as
           python/bench/gpu_extend.py --add-ids writes it): each task's
           context stored, its question sent as a request; exact match of the
           first len(answer_ids) tokens, plain against ctxcache in each
           --attention mode, overall and per family.

ctxcached: --server HOST:PORT, or started here from $CTXCACHE_BIN_DIR (else
./build/bin) with a temporary data dir. The model: an HF folder (default
models/ctxcache-ref; ./scripts/unpack-models.sh unpacks it) or llama8b (the
Llama-3-8B shape, random weights, --layers layers). --quick: one 4K context,
16 requests, 16 new tokens (< 3 minutes on the reference model).

Prints one JSON object as the last stdout line (and writes it to --out).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List

from bench_server import start_ctxcached, stop_ctxcached

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class Steps:
    """Runs each step in a thread with a time bound; records errors."""

    def __init__(self, res: Dict[str, Any], budget_s: float) -> None:
        self.res = res
        self.deadline = time.monotonic() + budget_s
        self.stuck = False  # a step overran its bound: later GPU steps are skipped

    def run(self, name: str, fn: Callable[[], Any], timeout_s: float) -> Any:
        left = self.deadline - time.monotonic()
        if self.stuck or left <= 5:
            self.res["errors"].append({"step": name, "error": "skipped: "
                                       + ("an earlier step is stuck" if self.stuck
                                          else "out of time budget")})
            return None
        box: Dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # reported, not raised
                box["error"] = f"{type(e).__name__}: {e}"
                box["trace"] = traceback.format_exc()[-2000:]

        t = threading.Thread(target=target, name=name, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(min(timeout_s, left))
        secs = round(time.monotonic() - t0, 2)
        if t.is_alive():
            self.stuck = True
            self.res["errors"].append({"step": name, "error": f"timed out after {secs} s"})
            log(f"{name}: TIMED OUT after {secs} s")
            return None
        if "error" in box:
            self.res["errors"].append({"step": name, "error": box["error"],
                                       "trace": box["trace"]})
            log(f"{name}: FAILED {box['error']}")
            return None
        log(f"{name}: done in {secs} s")
        return box.get("value")


def start_server(bin_dir: str, work: str, shm_cache_mb: int = 0,
                 timeout_s: float = 60.0) -> tuple:
    return start_ctxcached(bin_dir, work, ["--model-dir", "models", "--default-model",
                                           "ctxcache-ref", "--max-context-tokens", "140000",
                                           "--session-memory-mb", "65536",
                                           "--shm-cache-mb", str(shm_cache_mb)], timeout_s)


def fingerprint(model: Any, name: str) -> bytes:
    """The model's fingerprint: SHA-256 over the weights for a checkpoint
    (ctxcache.torch.hf.model_spec), over the config and seed for llama8b."""
    import hashlib
    if name != "llama8b":
        from ctxcache.torch import hf
        return hf.model_spec(model, "")["fingerprint"]
    return hashlib.sha256(("llama8b-random-seed0:" + model.config.to_json_string())
                          .encode()).digest()


def spec_of(model: Any, fp: bytes, name: str) -> Dict[str, Any]:
    from ctxcache.serving.transformers_cb import model_shape
    s = model_shape(model)
    return {"name": name, "n_layers": s.n_layers, "n_q_heads": model.config.num_attention_heads,
            "n_kv_heads": s.n_kv_heads, "head_dim": s.head_dim, "kv_dtype": "bf16",
            "fingerprint": fp}


def configs(a: Any) -> tuple:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    def cb() -> Any:
        cfg = ContinuousBatchingConfig(block_size=a.block_size,
                                       max_batch_tokens=a.max_batch_tokens)
        cfg.allow_block_sharing = True  # prefix sharing, for plain and ctxcache alike
        return cfg
    gen = GenerationConfig(max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=-1)
    return cb, gen


def capture_and_publish(model: Any, client: Any, spec: Dict[str, Any], contexts: List[list],
                        cb: Callable[[], Any], gen: Any, timeout_s: float,
                        resolver: Any = None) -> List[Dict]:
    """Prefills each context with the engine itself, captures its paged KV
    and publishes it (falls back to an HF dense prefill for a context whose
    blocks were reclaimed before the capture)."""
    import torch
    from ctxcache.serving import publish
    from ctxcache.serving.transformers_cb import capture_prefix_kv
    from ctxcache.torch import hf
    out = []
    for ctx in contexts:
        mgr = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=cb())
        mgr.start()
        try:
            mgr.add_request(ctx + [ctx[-1]], request_id="capture", max_new_tokens=2)
            r = mgr.get_result(request_id="capture", timeout=timeout_s)
            if r is None or r.error is not None:
                raise RuntimeError(f"capture prefill failed: {getattr(r, 'error', 'timeout')}")
            kv = capture_prefix_kv(mgr, ctx)
        finally:
            mgr.stop(block=True, timeout=30)
            mgr.destroy()
        source = "engine_paged_cache"
        if kv is not None:
            # Only complete blocks are captured: the stored context is the
            # context's first whole blocks (its tail is prefilled per request).
            n = int(kv[0].shape[2])
        else:
            n = len(ctx)
            impl = model.config._attn_implementation
            model.set_attn_implementation("sdpa")  # a plain forward, not a paged one
            try:
                pre = hf.prefill(model, ctx)
            finally:
                model.set_attn_implementation(impl)
            kv = (torch.stack(pre.k), torch.stack(pre.v))
            source = "hf_dense_prefill"
        t0 = time.perf_counter()
        info = publish(client, spec, ctx[:n],
                       [(kv[0][i], kv[1][i]) for i in range(kv[0].shape[0])],
                       indexes=["streaming"], name=f"serve_cb-{n}", resolver=resolver)
        out.append({"context_id": info.context_id, "tokens": n, "of_context": len(ctx),
                    "kv_source": source, "ingest_s": round(time.perf_counter() - t0, 3)})
        del kv
        torch.cuda.empty_cache()
    return out


def run_engine(make_manager: Callable[[], Any], prompts: List[list], new_tokens: int,
               timeout_s: float) -> Dict[str, Any]:
    """Submits every prompt at once to a fresh, warmed-up manager (ctxcache's
    through ``add_requests``: all routed, then all submitted); collects the
    results (bounded). TTFT from the submission of the first request."""
    import torch
    from ctxcache.serving.transformers_cb import CtxcacheBatchingManager
    mgr = make_manager()
    mgr.warmup()
    mgr.start()
    errors_: Dict[str, str] = {}
    results: Dict[str, Any] = {}
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = [f"req_{i}" for i in range(len(prompts))]
        if isinstance(mgr, CtxcacheBatchingManager):  # every prompt routed, then all submitted
            added = mgr.add_requests(prompts, request_ids=ids, max_new_tokens=new_tokens,
                                     record_timestamps=True)
            for rid, x in zip(ids, added):
                if isinstance(x, Exception):  # a policy error: reported per request
                    errors_[rid] = f"{type(x).__name__}: {x}"
        else:
            for rid, p in zip(ids, prompts):
                try:
                    mgr.add_request(p, request_id=rid, max_new_tokens=new_tokens,
                                    record_timestamps=True)
                except Exception as e:  # a policy error: reported per request
                    errors_[rid] = f"{type(e).__name__}: {e}"
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors_) < len(ids) and time.monotonic() < deadline:
            r = mgr.get_result(timeout=1.0)
            if r is not None and r.is_finished():
                results[r.request_id] = r
        wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True, timeout=30)
        mgr.destroy()
        # A manager that ran out of memory can leave its cache referenced
        # until a collection: the next manager sizes its cache from what is
        # free (after plain's OOM it found no room: num_blocks -11).
        del mgr
        gc.collect()
        torch.cuda.empty_cache()
    ttft, tokens = [], {}
    for rid in ids:
        r = results.get(rid)
        if r is None:
            continue
        if r.error is not None:
            errors_[rid] = r.error
            continue
        tokens[rid] = list(r.generated_tokens)
        if r.timestamps:
            ttft.append(r.timestamps[0] - t0)
    n_gen = sum(len(t) for t in tokens.values())
    ttft.sort()
    return {"requests": len(ids), "finished": len(tokens), "errors": errors_,
            "wall_s": round(wall, 4), "tokens_generated": n_gen,
            "throughput_tok_s": round(n_gen / wall, 2) if wall > 0 else None,
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else None,
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4) if ttft else None,
            "ttft_max_s": round(ttft[-1], 4) if ttft else None,
            "_tokens": tokens}


def compare(plain: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, Any]:
    a, b = plain["_tokens"], other["_tokens"]
    common = sorted(set(a) & set(b))
    same = [rid for rid in common if a[rid] == b[rid]]
    pos = sum(len(a[r]) for r in common)
    agree = sum(x == y for r in common for x, y in zip(a[r], b[r]))
    return {"requests_compared": len(common), "identical_requests": len(same),
            "identical": bool(common) and len(same) == len(common) == len(a),
            "token_agreement": round(agree / pos, 4) if pos else None,
            "first_mismatches": [r for r in common if a[r] != b[r]][:5]}


def speed_case(a: Any, model: Any, client: Any, backends: Dict[str, Any],
               spec: Dict[str, Any], n: int, steps: Steps) -> Dict[str, Any]:
    import random
    cb, gen = configs(a)
    rng = random.Random(n)
    vocab = int(model.config.vocab_size)
    contexts = [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(a.n_contexts)]
    case: Dict[str, Any] = {"context_tokens": n, "n_contexts": a.n_contexts,
                            "requests": a.requests, "question_tokens": a.question_tokens,
                            "new_tokens": a.new_tokens}
    backend = next(iter(backends.values()))
    case["stored"] = steps.run(f"publish_{n}", lambda: capture_and_publish(
        model, client, spec, contexts, cb, gen, a.step_timeout, backend.resolver),
        a.step_timeout)
    if not case["stored"]:
        return case
    prompts = [contexts[i % a.n_contexts]
               + [rng.randrange(3, vocab) for _ in range(a.question_tokens)]
               for i in range(a.requests)]
    runs = {}
    runs["plain"] = steps.run(f"plain_{n}", lambda: run_engine(
        lambda: model.init_continuous_batching(generation_config=gen,
                                               continuous_batching_config=cb()),
        prompts, a.new_tokens, a.step_timeout), a.step_timeout + 60)
    for mode, be in backends.items():
        prefix = "ctxcache" if mode == "dense" else f"ctxcache_{mode}"
        for c in [x["context_id"] for x in case["stored"]]:
            be.resolver.kv_cache.drop(c)  # cold: the first request loads from ctxcached
        names = [f"{prefix}_cold", f"{prefix}_warm"]
        if a.shm_cache_mb > 0:
            # A worker whose host cache lost the KV (a new process, say)
            # while ctxcached keeps it in shared memory: the load maps the
            # kept segment.
            names.append(f"{prefix}_cold_kept")
        for name in names:
            if name.endswith("_cold_kept"):
                for c in [x["context_id"] for x in case["stored"]]:
                    be.resolver.kv_cache.drop(c)
            runs[name] = steps.run(f"{name}_{n}", lambda: run_engine(
                lambda: be.manager(gen, cb()), prompts, a.new_tokens, a.step_timeout),
                a.step_timeout + 60)
        case[f"backend_{mode}"] = be.stats()
    base = runs.get("plain")
    cold, warm = runs.get("ctxcache_cold"), runs.get("ctxcache_warm")
    if cold is not None and warm is not None:
        # Both seed the same stored KV: any difference is the engine's own
        # run-to-run variation, not ctxcache's.
        warm["vs_cold"] = compare(cold, warm)
    for name, r in runs.items():
        if r is None:
            continue
        if base is not None and name != "plain":
            r["vs_plain"] = compare(base, r)
            if r["ttft_mean_s"] and base["ttft_mean_s"]:
                r["ttft_speedup"] = round(base["ttft_mean_s"] / r["ttft_mean_s"], 3)
            if r["throughput_tok_s"] and base["throughput_tok_s"]:
                r["throughput_speedup"] = round(r["throughput_tok_s"] / base["throughput_tok_s"],
                                                3)
    for r in runs.values():
        if r is not None:
            r.pop("_tokens", None)  # after every comparison
    case["runs"] = runs
    return case


def tasks_case(a: Any, model: Any, client: Any, backends: Dict[str, Any],
               spec: Dict[str, Any], steps: Steps) -> Dict[str, Any]:
    cb, gen = configs(a)
    opener = gzip.open if a.tasks.endswith(".gz") else open
    with opener(a.tasks, "rt", encoding="utf-8") as f:
        items = [json.loads(x) for x in f][:a.task_limit or None]
    missing = [i for i, t in enumerate(items) if "context_ids" not in t]
    if missing:
        raise ValueError(f"--tasks: task {missing[0]} has no context_ids (write them with "
                         "python/bench/gpu_extend.py --add-ids IN OUT)")
    contexts = [[1] + t["context_ids"] for t in items]
    backend = next(iter(backends.values()))
    stored = steps.run("tasks_publish", lambda: capture_and_publish(
        model, client, spec, contexts, cb, gen, a.step_timeout, backend.resolver),
        a.step_timeout * 2)
    if not stored:
        return {"tasks": len(items)}
    prompts = [c + t["question_ids"] for c, t in zip(contexts, items)]
    answers = [t["answer_ids"] for t in items]
    n_new = max(len(x) for x in answers)
    out: Dict[str, Any] = {"tasks": len(items), "stored": len(stored)}
    makers = [("plain", lambda: model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=cb()))]
    for mode, be in backends.items():
        makers.append(("ctxcache" if mode == "dense" else f"ctxcache_{mode}",
                       lambda be=be: be.manager(gen, cb())))
    for name, make in makers:
        r = steps.run(f"tasks_{name}", lambda: run_engine(make, prompts, n_new, a.step_timeout),
                      a.step_timeout + 60)
        if r is None:
            continue
        right = [i for i, ans in enumerate(answers)
                 if r["_tokens"].get(f"req_{i}", [])[:len(ans)] == ans]
        fam: Dict[str, List[int]] = {}
        for i, t in enumerate(items):
            f = fam.setdefault(str(t.get("family", "")), [0, 0])
            f[0] += i in right
            f[1] += 1
        out[name] = {"right": len(right), "accuracy": round(len(right) / max(1, len(items)), 4),
                     "families": fam, "right_ids": right, "finished": r["finished"],
                     "wall_s": r["wall_s"]}
    plain = out.get("plain")
    for name in [m for m, _ in makers[1:]]:
        if plain is not None and name in out:
            out[name]["of_plain"] = round(out[name]["right"] / max(1, plain["right"]), 4)
            out[name]["families_of_plain"] = {
                f: round(v[0] / max(1, plain["families"][f][0]), 4)
                for f, v in out[name]["families"].items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/ctxcache-ref")
    ap.add_argument("--layers", type=int, default=8, help="layers of --model llama8b")
    ap.add_argument("--server", default="", help="a running ctxcached (default: start one)")
    ap.add_argument("--bin-dir", default=os.environ.get("CTXCACHE_BIN_DIR", "build/bin"))
    ap.add_argument("--contexts", default="32768,131072", help="context lengths, tokens")
    ap.add_argument("--n-contexts", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--tasks", default="", help="task JSONL (.gz too) with context_ids")
    ap.add_argument("--task-limit", type=int, default=32)
    ap.add_argument("--on-missing", default="prefill", choices=("prefill", "error"))
    ap.add_argument("--attention", default="dense",
                    help="ctxcache attention modes to run, comma-separated: dense, sparse, "
                         "sparse:R (the prompt's chunks at prefill fraction R)")
    ap.add_argument("--sparse-rho", type=float, default=0.05)
    ap.add_argument("--sparse-min-tokens", type=int, default=1024)
    ap.add_argument("--kv-transport", default="auto", choices=("auto", "fetch", "map"),
                    help="ServingOptions.kv_transport (auto: MapKV from the local ctxcached)")
    ap.add_argument("--shm-cache-mb", type=int, default=0,
                    help="ctxcached --shm-cache-mb of the server started here (0: every "
                         "cold load fills its own segment)")
    ap.add_argument("--step-timeout", type=float, default=540.0, help="seconds per step")
    ap.add_argument("--budget", type=float, default=3300.0, help="seconds for the whole run")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.quick:
        a.contexts, a.n_contexts, a.requests, a.new_tokens = "4096", 1, 16, 16
        a.question_tokens, a.step_timeout, a.budget = 32, 100.0, 170.0
        a.task_limit = min(a.task_limit, 8)
    res: Dict[str, Any] = {"bench": "serve_cb", "model": a.model, "quick": a.quick,
                           "args": vars(a).copy(), "errors": [], "speed": []}
    steps = Steps(res, a.budget)
    proc = None
    work = tempfile.mkdtemp(prefix="serve_cb-")
    backends: Dict[str, Any] = {}
    try:
        import torch
        import transformers
        res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        res["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": sys.version.split()[0]}
        addr = a.server
        if not addr:
            started = steps.run("start_ctxcached",
                                lambda: start_server(a.bin_dir, work, a.shm_cache_mb), 90)
            if started is None:
                raise RuntimeError("ctxcached did not start")
            proc, addr = started
        res["server"] = addr

        def load() -> Any:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_e2e import load_model
            m = load_model(a.model, a.layers, "cuda")
            m.set_attn_implementation("paged|sdpa")
            return m
        model = steps.run("load_model", load, 300)
        if model is None:
            raise RuntimeError("the model did not load")
        import ctxcache
        from ctxcache.serving import ServingOptions
        from ctxcache.serving.transformers_cb import CtxcacheBackend
        name = os.path.basename(a.model.rstrip("/"))
        fp = steps.run("fingerprint", lambda: fingerprint(model, a.model), 300)
        if fp is None:
            raise RuntimeError("no fingerprint")
        spec = spec_of(model, fp, "hf:" + name)
        client = ctxcache.Client(addr, timeout=120)
        for mode in [x for x in a.attention.split(",") if x]:
            kind, _, prefill_rho = mode.partition(":")
            backends[mode.replace(":", "_p")] = CtxcacheBackend(addr, model, [fp], ServingOptions(
                on_missing=a.on_missing, refresh_interval_s=1.0, load_timeout_s=a.step_timeout,
                rpc_timeout_s=10.0, attention=kind, sparse_rho=a.sparse_rho,
                sparse_min_tokens=a.sparse_min_tokens, kv_transport=a.kv_transport,
                sparse_prefill_rho=float(prefill_rho or 1.0)))
        for n in [int(x) for x in a.contexts.split(",") if x]:
            res["speed"].append(speed_case(a, model, client, backends, spec, n, steps))
        if a.tasks:
            res["tasks"] = steps.run("tasks", lambda: tasks_case(a, model, client, backends,
                                                                 spec, steps),
                                     a.step_timeout * 6)
    except BaseException as e:  # reported in the JSON
        res["errors"].append({"step": "main", "error": f"{type(e).__name__}: {e}",
                              "trace": traceback.format_exc()[-2000:]})
    finally:
        for be in backends.values():
            try:
                be.close()
            except Exception:
                pass
        stop_ctxcached(proc)
    res["ok"] = not res["errors"]
    res["wall_s"] = round(time.perf_counter() - T0, 1)
    line = json.dumps(res, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    # A step that overran its bound may still hold a thread: do not wait for it.
    os._exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
