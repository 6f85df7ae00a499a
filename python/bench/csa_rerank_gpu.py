"""Times csa's stage 2 (key-sketch rerank) on a torch device, op by op, at a
layer-step of a given shape, eagerly and as CUDA graph replays (default:
Llama-3-8B, 32 q / 8 kv heads, d 128, 32K tokens, 5% budget, rerank 6: the
default), with random tables. Prints JSON.

    python3 python/bench/csa_rerank_gpu.py [--n 32768] [--device cuda]
"""
import argparse
import json
import math
import types

import torch

from ctxcache.torch import gpu_session


def topk_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """The torch.topk form of gpu_session._top_k_mask (its predecessor)."""
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    above = x > kth
    ties = x == kth
    need = k - above.sum(dim=-1, keepdim=True)
    return above | (ties & (torch.cumsum(ties.to(torch.int32), dim=-1) <= need))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--kv", type=int, default=8)
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--rerank", type=float, default=6.0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    h, g, n, d = a.kv, a.g, a.n, a.d
    hg = h * g
    torch.manual_seed(0)
    lay = types.SimpleNamespace(
        n=n, d=d, rerank=a.rerank,
        sketch=torch.randint(-127, 128, (h, n, d), dtype=torch.int8, device=dev),
        sketch_scale=torch.rand(h, n, dtype=torch.float64, device=dev) * 0.01)
    planner = types.SimpleNamespace(n_kv_heads=h, group_size=g)
    acc = torch.randn(hg, n, device=dev)
    q = torch.randn(h * g, d, device=dev)
    forced = torch.zeros(n, dtype=torch.bool, device=dev)
    forced[:4] = True
    forced[n - 32:] = True
    k = int(math.ceil(a.rho * n))

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t = []
        for _ in range(a.iters):
            if dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                t.append(s.elapsed_time(e) * 1e3)
        t.sort()
        return t[len(t) // 2] if t else 0.0

    want = int(math.ceil(a.rerank * k)) - 36
    ranked = torch.where(forced, torch.full_like(acc, -math.inf), acc)
    mask = gpu_session._top_k_mask(ranked, want)
    cand = gpu_session._mask_indices(mask, want)
    head = torch.arange(h, device=dev).repeat_interleave(g).view(hg, 1)
    codes = lay.sketch[head, cand]
    res = {"shape": {"n": n, "kv": h, "g": g, "d": d, "k": k, "want": want},
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "us": {
               "stage2_total": timed(lambda: gpu_session.TorchCsaSession._rerank(
                   planner, lay, q, acc, acc * 0.1, forced, 4, n - 32, k)),
               "top_k_mask_k": timed(lambda: gpu_session._top_k_mask(ranked, k)),
               "torch_topk_mask_k": timed(lambda: topk_mask(ranked, k)),
               "top_k_mask_want": timed(lambda: gpu_session._top_k_mask(ranked, want)),
               "topk_values_want": timed(lambda: torch.topk(ranked, want, dim=-1)),
               "mask_to_indices": timed(lambda: gpu_session._mask_indices(mask, want)),
               "sketch_scores": timed(lambda: gpu_session._sketch_scores(
                   lay, cand, q.round(), q.abs().amax(-1, keepdim=True), g)),
               "torch_gather_codes": timed(lambda: lay.sketch[head, cand]),
               "torch_codes_float_bmm": timed(lambda: torch.bmm(codes.float(),
                                                                q.view(hg, d, 1))),
               "torch_scale_gather_double": timed(lambda: lay.sketch_scale[head, cand] * 2.0),
           }}
    if dev.type == "cuda":
        stage2 = lambda: gpu_session.TorchCsaSession._rerank(  # noqa: E731
            planner, lay, q, acc, acc * 0.1, forced, 4, n - 32, k)
        base = lambda: gpu_session._top_k_mask(  # noqa: E731
            torch.where(forced, torch.full_like(acc, math.inf), acc), k)
        for name, fn in (("stage2_graph", stage2), ("lists_only_top_k_graph", base)):
            graph, _ = gpu_session.capture_graph(dev, fn)
            res["us"][name] = timed(graph.replay)
    # The Triton kernel against the torch form on the same rows.
    qi, qs = q.round(), q.abs().amax(-1, keepdim=True)
    want_r = (torch.bmm(codes.float(), qi.view(hg, d, 1)).squeeze(-1).double() *
              (qs.double() * lay.sketch_scale[head, cand])).float()
    res["sketch_scores_equal_torch"] = bool(torch.equal(
        gpu_session._sketch_scores(lay, cand, qi, qs, g), want_r))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
