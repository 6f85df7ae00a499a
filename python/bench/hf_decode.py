"""HF transformers end to end against a running ctxcached (the GPU machine:
scripts/gpu-suite.sh stage hf_decode).

1. Loads an HF LLaMA-family model (default models/ctxcache-ref) in bf16.
2. Prefills the context (a document + a continuation prompt, minus its last
   token) with HF, and ingests its post-RoPE K/V/Q into ctxcache
   (``ctxcache.torch.hf.prefill_and_ingest``, csa index built server-side):
   TTFT = prefill + ingest, and the ingest throughput.
3. Decodes ``--n-new`` tokens greedily with dense attention over the
   prefill's KV, and with ctxcache selecting per layer-step for each method
   (teacher-forced on the dense tokens, so per-position agreement and
   KL(dense||sparse) are measured like ``ctxcache generate --compare full``).
   ``full`` must decode exactly like dense.
4. Native HF decoding (SDPA over HF's own cache) for tokens/s context.
Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def kl_div(p: "torch.Tensor", q: "torch.Tensor") -> float:
    """KL(softmax(p) || softmax(q)) of two logit vectors."""
    lp, lq = torch.log_softmax(p.float(), -1), torch.log_softmax(q.float(), -1)
    return float(torch.sum(lp.exp() * (lp - lq)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", default="models/ctxcache-ref")
    ap.add_argument("--tokens-json", required=True,
                    help="JSON list of token ids: the document then the prompt")
    ap.add_argument("--n-new", type=int, default=64)
    ap.add_argument("--methods", default="full,csa,streaming")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the torch client-side decode (host time per function)")
    a = ap.parse_args()

    import ctxcache
    from ctxcache.torch import hf
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"loading {a.model} on {dev}")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev).eval()
    ids = [int(x) for x in json.load(open(a.tokens_json))]
    context, first = ids[:-1], ids[-1]
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "model": a.model, "n_context": len(context), "n_new": a.n_new}
    def save() -> None:
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    with ctxcache.Client(a.server, timeout=300) as c:
        log(f"prefill + ingest of {len(context)} tokens")
        t0 = time.perf_counter()
        info, pre = hf.prefill_and_ingest(c, model, context, indexes=["csa"], keep_cache=True)
        res["ttft_s"] = time.perf_counter() - t0
        res["prefill_s"] = pre.seconds
        res["ingest_s"] = pre.ingest_s
        res["ingest_tokens_per_s"] = len(context) / pre.ingest_s
        res["context_id"] = info.context_id
        log(f"ingested: prefill {pre.seconds:.2f} s, ingest {pre.ingest_s:.2f} s; dense decode")
        save()
        dense = hf.generate_dense(model, pre, first, a.n_new)
        forced = dense.tokens
        dense_tf = hf.generate_dense(model, pre, first, a.n_new, forced=forced)
        n_layers, n_kv, d = len(pre.k), pre.k[0].shape[0], pre.k[0].shape[2]
        dense_bytes = len(context) * n_layers * n_kv * d * 2 * 2
        res["dense"] = {"tokens_per_s": a.n_new / sum(dense.step_s),
                        "step_ms_p50": 1e3 * statistics.median(dense.step_s)}
        method_tokens = {}
        for method in a.methods.split(","):
            log(f"decode with {method}")
            # append=False: the server selects over the stored context, like
            # the client-side cores compared with it below.
            out = hf.generate(c, model, info, first, a.n_new, method=method, forced=forced,
                              append=False)
            method_tokens[method] = out.tokens
            agree = float(np.mean([x == y for x, y in zip(out.tokens, dense_tf.tokens)]))
            kl = [kl_div(p, q) for p, q in zip(dense_tf.logits, out.logits)]
            res[method] = {
                "agreement": agree, "mean_kl": float(np.mean(kl)),
                "max_abs_logit_diff": float(max(float((p - q).abs().max())
                                                for p, q in zip(dense_tf.logits, out.logits))),
                "bytes_per_step": out.bytes_received / a.n_new,
                "bytes_ratio_vs_dense": dense_bytes / max(1.0, out.bytes_received / a.n_new),
                "tokens_per_s": a.n_new / sum(out.step_s),
                "step_ms_p50": 1e3 * statistics.median(out.step_s)}
            if method == "full":
                res[method]["tokens_equal_dense"] = out.tokens == dense_tf.tokens
            log(f"{method}: {res[method]}")
            save()
        for sel in ("exact", "torch"):
            name = "csa_client" if sel == "exact" else "csa_client_torch"
            log(f"decode with csa, client-side selection ({sel})")
            if a.profile and sel == "torch":  # where the host time goes, per function
                import cProfile
                import io
                import pstats
                prof = cProfile.Profile()
                prof.enable()
            out = hf.generate_client(c, model, info, first, a.n_new, forced=forced, selection=sel,
                                     append=False)
            if a.profile and sel == "torch":
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                log(text.getvalue())
            res[name] = {
                "selection": sel,
                "agreement": float(np.mean([x == y for x, y in zip(out.tokens, dense_tf.tokens)])),
                # exact: the C++ session core through the native library, so
                # the server's tokens (its page cache is the library's: no
                # byte or pool counts); torch: the same stages as tensor ops
                # with the GPU page pool (near-ties may differ).
                "tokens_equal_server_csa": out.tokens == method_tokens.get("csa"),
                "agreement_with_server_csa": float(np.mean(
                    [x == y for x, y in zip(out.tokens, method_tokens.get("csa", []))])),
                "mean_kl": float(np.mean([kl_div(x, y) for x, y in
                                          zip(dense_tf.logits, out.logits)])),
                "bytes_per_step": out.bytes_received / a.n_new,
                "pool_hit_ratio": out.pool_hits / max(1, out.pool_hits + out.pool_misses),
                "tokens_per_s": a.n_new / sum(out.step_s),
                "step_ms_p50": 1e3 * statistics.median(out.step_s),
                "step_ms_p50_after_first": 1e3 * statistics.median(out.step_s[1:] or out.step_s)}
            log(f"{name}: {res[name]}")
            save()
        log("decode with csa, server-side selection, generated tokens appended")
        out = hf.generate(c, model, info, first, a.n_new, method="csa", forced=forced)
        res["csa_append"] = {
            "agreement": float(np.mean([x == y for x, y in zip(out.tokens, dense_tf.tokens)])),
            "mean_kl": float(np.mean([kl_div(x, y) for x, y in zip(dense_tf.logits, out.logits)])),
            "appended_tokens": out.appended_tokens,
            "step_ms_p50": 1e3 * statistics.median(out.step_s)}
        log(f"csa_append: {res['csa_append']}")
        save()
        log("native HF decode")
        # Native HF decoding over its own cache (SDPA), for context.
        cache = pre.cache
        tok = torch.tensor([[first]], device=dev)
        steps = []
        native = []
        with torch.no_grad():
            for i in range(a.n_new):
                torch.cuda.synchronize() if dev == "cuda" else None
                t = time.perf_counter()
                o = model(input_ids=tok, past_key_values=cache, use_cache=True)
                nxt = int(torch.argmax(o.logits[0, -1]))
                torch.cuda.synchronize() if dev == "cuda" else None
                steps.append(time.perf_counter() - t)
                native.append(nxt)
                tok = torch.tensor([[forced[i]]], device=dev)
        res["native_hf"] = {"tokens_per_s": a.n_new / sum(steps),
                            "step_ms_p50": 1e3 * statistics.median(steps),
                            "agreement_with_dense": float(np.mean([x == y for x, y in
                                                                   zip(native, dense_tf.tokens)]))}
    print(json.dumps(res, indent=1))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
