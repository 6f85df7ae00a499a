#!/usr/bin/env python3
"""Decode attention on a GPU: CSAttention-style sparse decode against dense SDPA.

One layer of one decode step with a Llama-3-8B attention shape (32 q / 8 kv
heads, head_dim 128, bf16), batch 1 and 8, contexts of 32K/64K/128K tokens.
Every sequence has its own context, resident on the GPU as 16-token pages.

Workloads (all captured in a CUDA graph, timed with CUDA events, median of
--iters replays; *_fused: Triton top-k and paged attention, kernels.py):
  dense       scaled_dot_product_attention, flash backend, over all N keys.
  csa_token   csa selection from token-level lists (the stored CSA layout:
              per subspace b and centroid j the top L = alpha*N keys, with
              their scores), then attention over the selected pages.
  csa_page    the same from page-level lists (top alpha*P pages per centroid,
              scored by their best key): 16x fewer entries touched.
  csa_token_softmax_qhead_radix  the session core's ranking instead (no
              pooling; per q head, token bins, per-page logsumexp, top pages
              per q head, each q head attending its own pages): the ranking
              that keeps the session core's attention mass (docs/benchmarks.md,
              "what the GPU kernels' page ranking costs").

Selection, per sequence and kv head (the work of the group's 4 q heads is
shared, as the block-union page tables share pages):
  1. the group's queries, pooled, split into m subspaces; nearest centroid per
     subspace by cosine; weight w_b = ||q^b|| (norm weights);
  2. gather the m chosen lists, score-add w_b * score into per-page bins;
  3. top ceil(rho * P) pages, plus the sink page and the 2 most recent pages;
  4. gather those pages' K/V and run SDPA (flash) over them.

Each sparse workload also reports its stages on their own (select only,
gather + attention only). Prints one JSON object; --out also writes it.
Random data: this measures time, not fidelity (fidelity: docs/benchmarks.md).
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

PAGE = 16

try:  # the fused path: Triton kernels in python/ctxcache/torch/kernels.py
    import os as _os

    sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..",
                                     "ctxcache", "torch"))
    import kernels  # noqa: E402
except Exception:  # no triton / no CUDA: torch ops only
    kernels = None


def sdpa_backend_ctx():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    except Exception:  # older torch: no backend selection
        import contextlib

        return contextlib.nullcontext()


def attention(q, k, v):
    """q [B, Hq, 1, d], k/v [B, Hkv, n, d] -> [B, Hq, 1, d] (GQA)."""
    hq, hkv = q.shape[1], k.shape[1]
    if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0 (CPU checks only)
        rep = hq // hkv
        k, v = k.repeat_interleave(rep, dim=1).float(), v.repeat_interleave(rep, dim=1).float()
        w = torch.softmax(q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        return (w @ v).to(q.dtype)
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)
    except (TypeError, RuntimeError):
        rep = hq // hkv
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


class Case:
    def __init__(self, n, batch, hq=32, hkv=8, d=128, m=8, c=128, alpha=0.25, rho=0.05,
                 device="cuda", seed=0):
        self.n, self.b, self.hq, self.hkv, self.d = n, batch, hq, hkv, d
        self.m, self.c, self.alpha, self.rho = m, c, alpha, rho
        self.p = n // PAGE
        self.g = hq // hkv
        self.ds = d // m
        gen = torch.Generator(device=device).manual_seed(seed)
        bf = torch.bfloat16
        self.k = torch.randn(batch, hkv, n, d, device=device, dtype=bf, generator=gen)
        self.v = torch.randn(batch, hkv, n, d, device=device, dtype=bf, generator=gen)
        self.q = torch.randn(batch, hq, 1, d, device=device, dtype=bf, generator=gen)
        rows = batch * hkv
        cent = torch.randn(rows, m, c, self.ds, device=device, generator=gen)
        self.cent = F.normalize(cent, dim=-1).to(bf)
        # Lists hold global bin ids (row * P + page), so one scatter_add
        # covers every (sequence, kv head).
        row_base = (torch.arange(rows, device=device) * self.p).view(rows, 1, 1, 1)
        # A token-level list stores the page of each of its L keys (random
        # keys: uniform pages); built in place to keep peak memory down.
        self.lt = max(1, int(math.ceil(alpha * n)))
        tok = torch.randint(0, self.p, (rows, m, c, self.lt), device=device, generator=gen)
        tok += row_base
        self.tok_bins = tok.view(rows * m * c, self.lt)
        self.tok_scores = torch.randn(rows * m * c, self.lt, device=device, dtype=torch.float16,
                                      generator=gen)
        self.lp = max(1, int(math.ceil(alpha * self.p)))
        pg = torch.randint(0, self.p, (rows, m, c, self.lp), device=device, generator=gen)
        pg += row_base
        self.page_bins = pg.view(rows * m * c, self.lp)
        self.page_scores = torch.randn(rows * m * c, self.lp, device=device,
                                       dtype=torch.float16, generator=gen)
        self.kp = min(self.p, int(math.ceil(rho * self.p)) + 3)
        self.bins = torch.zeros(rows * self.p, device=device, dtype=torch.float32)
        self.forced = torch.zeros(self.p, device=device, dtype=torch.float32)
        self.forced[0] = float("inf")
        self.forced[-2:] = float("inf")
        self.row_page0 = (torch.arange(rows, device=device) * self.p).view(rows, 1)
        self.kflat = self.k.view(rows * self.p, PAGE * d)
        self.vflat = self.v.view(rows * self.p, PAGE * d)
        self.sel = None  # pages picked by the last select (global rows)
        self.top_method = "topk"  # or "sort", "triton", "fused"
        self.paged = None
        self.paged_geometry = None
        self.lists32 = {}
        self.exact_select = True
        self.select_algo = "search"  # kernels.select_top_pages algo
        self.sel_buf = None
        self.fbins = torch.zeros(rows * self.p, device=device, dtype=torch.float32)

    def select(self, lists, scores):
        if self.top_method == "fused":
            return self.select_fused(lists, scores)
        if self.top_method == "qhead":
            return self.select_softmax_qhead(scores)
        rows, m, c, ds = self.b * self.hkv, self.m, self.c, self.ds
        qg = self.q.view(self.b, self.hkv, self.g, self.d).float().mean(dim=2)
        qs = qg.reshape(rows, m, ds)
        w = qs.norm(dim=-1)                                           # [rows, m]
        cos = torch.einsum("rmd,rmcd->rmc", qs / w.clamp_min(1e-6).unsqueeze(-1),
                           self.cent.float())
        j = cos.argmax(dim=-1)                                        # [rows, m]
        lid = ((torch.arange(rows, device=j.device).view(rows, 1) * m +
                torch.arange(m, device=j.device).view(1, m)) * c + j).view(-1)
        ids = lists.index_select(0, lid)                              # [rows*m, L]
        val = scores.index_select(0, lid).float() * w.view(-1, 1)
        self.bins.zero_()
        self.bins.scatter_add_(0, ids.view(-1), val.view(-1))
        pb = self.bins.view(rows, self.p) + self.forced
        if self.top_method == "triton":
            self.sel = kernels.select_top_pages(pb, self.kp).view(-1)
            return self.sel
        if self.top_method == "sort":
            top = torch.sort(pb, dim=1, descending=True).indices[:, :self.kp]
        else:
            top = torch.topk(pb, self.kp, dim=1, sorted=False).indices  # [rows, kp]
        self.sel = (top + self.row_page0).view(-1)
        return self.sel

    def sparse_attention(self):
        ks = self.kflat.index_select(0, self.sel).view(self.b, self.hkv, self.kp * PAGE, self.d)
        vs = self.vflat.index_select(0, self.sel).view(self.b, self.hkv, self.kp * PAGE, self.d)
        return attention(self.q, ks, vs)

    def select_fused(self, lists, scores):
        """The whole selection in two Triton kernels: score-add, then top-k."""
        rows = self.b * self.hkv
        if lists.data_ptr() not in self.lists32:
            self.lists32[lists.data_ptr()] = lists.to(torch.int32)
        if self.sel_buf is None:
            self.sel_buf = torch.empty(rows, self.kp, dtype=torch.int64, device=self.q.device)
        kernels.csa_score_pages(self.q.view(rows, self.g, self.d), self.cent,
                                self.lists32[lists.data_ptr()], scores, self.fbins)
        kernels.select_top_pages(self.fbins.view(rows, self.p), self.kp, n_recent=2, reset=True,
                                 out=self.sel_buf, exact=self.exact_select,
                                 algo=self.select_algo)
        self.sel = self.sel_buf.view(-1)
        return self.sel

    def select_softmax_qhead(self, scores):
        """The session core's page ranking on the GPU: per q head (no pooling)
        every list entry's w_b * score into per-token bins, per page the
        logsumexp of its tokens' logit estimates (the page's estimated softmax
        mass, up to a per-row constant), the top pages per q head. Token-level
        lists with token ids (`tok_local`), shared by a kv head's q heads."""
        rows = self.b * self.hkv
        r4 = rows * self.g
        dev = self.q.device
        if getattr(self, "tok_local", None) is None:
            gen = torch.Generator(device=dev).manual_seed(1)
            self.tok_local = torch.randint(0, self.n, (rows * self.m * self.c, self.lt),
                                           device=dev, generator=gen).to(torch.int32)
            self.tbins = torch.zeros(r4 * self.n, device=dev, dtype=torch.float32)
            qrow = torch.arange(r4, device=dev)
            self.q_page_off = ((qrow - qrow // self.g) * self.p).view(r4, 1)
            self.sel_q = torch.empty(r4, self.kp, dtype=torch.int64, device=dev)
        kernels.csa_score_pages(self.q.view(r4, 1, self.d), self.cent, self.tok_local, scores,
                                self.tbins, list_div=self.g, bin_stride=self.n)
        pscore = torch.logsumexp(self.tbins.view(r4, self.p, PAGE) / math.sqrt(self.d), dim=-1)
        self.tbins.zero_()
        kernels.select_top_pages(pscore, self.kp, n_recent=2, reset=False, out=self.sel_q,
                                 exact=self.exact_select, algo=self.select_algo)
        self.sel = (self.sel_q - self.q_page_off).view(-1)  # q-head rows -> kv-head pages
        return self.sel

    def paged_attention_qhead(self):
        """Each q head over its own pages (G = 1 rows), read in place."""
        r4 = self.b * self.hq
        if getattr(self, "paged_q", None) is None:
            self.paged_q = kernels.PagedDecodeAttention(r4, 1, self.d, self.kp, self.q.device,
                                                        self.q.dtype)
        out = self.paged_q(self.q.view(r4, 1, self.d), self.k.view(-1, self.d),
                           self.v.view(-1, self.d), self.sel.view(r4, self.kp))
        return out.view(self.b, self.hq, 1, self.d)

    def paged_attention(self, geometry=None):
        """Attention over the selected pages read in place (Triton); geometry:
        PagedDecodeAttention's (programs_per_sm, pages_per_block)."""
        if self.paged is None or geometry != self.paged_geometry:
            self.paged_geometry = geometry
            self.paged = kernels.PagedDecodeAttention(self.b * self.hkv, self.g, self.d, self.kp,
                                                      self.q.device, self.q.dtype,
                                                      **dict(zip(("programs_per_sm",
                                                                  "pages_per_block"),
                                                                 geometry or ())))
        out = self.paged(self.q.view(self.b * self.hkv, self.g, self.d),
                         self.k.view(-1, self.d), self.v.view(-1, self.d),
                         self.sel.view(self.b * self.hkv, self.kp))
        return out.view(self.b, self.hq, 1, self.d)

    def dense(self):
        return attention(self.q, self.k, self.v)


def time_graph(fn, iters, warmup=5):
    """Median microseconds per replay of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def self_check(device):
    """Sparse attention over every page equals dense attention."""
    case = Case(2048, 2, device=device, rho=1.0)
    case.select(case.page_bins, case.page_scores)
    with sdpa_backend_ctx():
        dense = case.dense().float()
        sparse = case.sparse_attention().float()
    err = (dense - sparse).abs().max().item()
    assert case.kp == case.p, (case.kp, case.p)
    assert err < 2e-2, f"sparse attention over all pages differs from dense by {err}"
    checks = {"gather_sdpa_vs_dense": err}
    if kernels is not None:
        case = Case(8192, 2, device=device)
        ref = case.select(case.tok_bins, case.tok_scores).view(case.b * case.hkv, -1)
        ref_set = [set(r.tolist()) for r in ref.sort(dim=1).values]
        case.top_method = "triton"
        got = case.select(case.tok_bins, case.tok_scores).view(case.b * case.hkv, -1)
        got_set = [set(r.tolist()) for r in got.sort(dim=1).values]
        assert ref_set == got_set, "triton top pages differ from torch.topk"
        with sdpa_backend_ctx():
            want = case.sparse_attention().float()
        have = case.paged_attention().float()
        perr = (want - have).abs().max().item()
        assert perr < 2e-2, f"paged attention differs from gather + SDPA by {perr}"
        checks["paged_vs_gather_sdpa"] = perr
        checks["triton_topk_equals_torch_topk"] = True
        # Fused score-add: the same page scores as the torch path (atomic
        # order aside), hence (almost always) the same pages.
        case.top_method = "topk"
        case.select(case.tok_bins, case.tok_scores)
        want_bins = case.bins.clone()
        rows = case.b * case.hkv
        kernels.csa_score_pages(case.q.view(rows, case.g, case.d), case.cent,
                                case.tok_bins.to(torch.int32), case.tok_scores, case.fbins)
        berr = ((case.fbins - want_bins).abs().max() / want_bins.abs().max()).item()
        assert berr < 1e-4, f"fused page scores differ from torch by {berr} (relative)"
        checks["fused_scores_rel_err"] = berr
        case.fbins.zero_()
    return checks


def select_sweep(iters):
    """Top-k alone (kernels.select_top_pages), both algorithms, exact and bf16
    ranking, by rows (batch * kv heads) and pages per row: µs per call."""
    out = []
    for rows in (8, 64):
        for p in (2048, 8192, 16384):
            k = int(math.ceil(0.05 * p)) + 3
            g = torch.Generator(device="cuda").manual_seed(rows + p)
            scores = torch.randn(rows, p, device="cuda", generator=g)
            sel = torch.empty(rows, k, dtype=torch.int64, device="cuda")
            row = {"rows": rows, "pages": p, "k": k}
            want = None
            for algo in ("search", "radix", "split"):
                for exact in (True, False):
                    kernels.select_top_pages(scores, k, n_recent=2, out=sel, exact=exact, algo=algo)
                    got = sel.sort(dim=1).values
                    if exact:  # both algorithms pick the same pages
                        if want is None:
                            want = got.clone()
                        assert torch.equal(want, got), f"{algo} differs at rows {rows} p {p}"
                    row[f"{algo}_{'exact' if exact else 'bf16'}_us"] = time_graph(
                        lambda: kernels.select_top_pages(scores, k, n_recent=2, out=sel,
                                                         exact=exact, algo=algo), iters)
            if p == 8192:  # warps per row's program (default 16 at this length)
                for algo in ("search", "radix"):
                    for warps in (4, 8, 32):
                        row[f"{algo}_exact_{warps}warps_us"] = time_graph(
                            lambda: kernels.select_top_pages(scores, k, n_recent=2, out=sel,
                                                             algo=algo, num_warps=warps), iters)
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def radix_sweep(args):
    """The radix top-k alone over real csa page scores (csa_score_pages of the
    bench's lists) at the largest length, batch 1 and 8: digit width x warps,
    exact and bf16 ranking; µs per call. Every setting must pick the pages of
    the 8-bit default."""
    n = max(args.lengths)
    out = []
    for batch in args.batches:
        case = Case(n, batch, m=args.m, c=args.c, alpha=args.alpha, rho=args.rho, device="cuda")
        rows = batch * case.hkv
        bins = torch.zeros(rows * case.p, device="cuda")
        kernels.csa_score_pages(case.q.view(rows, case.g, case.d), case.cent,
                                case.page_bins.to(torch.int32), case.page_scores, bins)
        bins = bins.view(rows, case.p)
        sel = torch.empty(rows, case.kp, dtype=torch.int64, device="cuda")
        row = {"n_tokens": n, "batch": batch, "k": case.kp}
        for exact in (True, False):
            tag = "exact" if exact else "bf16"
            want = kernels.select_top_pages(bins, case.kp, n_recent=2, exact=exact, algo="radix",
                                            radix_bits=8).sort(dim=1).values
            for bits in (5, 6, 7, 8):
                for warps in (8, 16, 32):
                    def call():
                        kernels.select_top_pages(bins, case.kp, n_recent=2, out=sel, exact=exact,
                                                 algo="radix", num_warps=warps, radix_bits=bits)
                    call()
                    assert torch.equal(sel.sort(dim=1).values, want), (bits, warps, exact)
                    row[f"{tag}_{bits}bit_{warps}w_us"] = time_graph(call, args.iters)
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del case
        torch.cuda.empty_cache()
    return out


def profile(args):
    """Per-op CUDA time of one sparse step (csa_page and csa_token) and the
    top-k alternatives, at the largest length and each batch."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    out = {}
    n = max(args.lengths)
    for batch in args.batches:
        case = Case(n, batch, m=args.m, c=args.c, alpha=args.alpha, rho=args.rho, device="cuda")
        for top in ("topk", "sort"):
            case.top_method = top
            out[f"b{batch}_{top}_select_page_us"] = time_graph(
                lambda: case.select(case.page_bins, case.page_scores), args.iters)
        lists, scores = case.page_bins, case.page_scores
        for name, top, exact in (("csa_page", "topk", True),
                                 ("csa_page_fused_radix", "fused", True),
                                 ("csa_page_fused_radix_bf16rank", "fused", False),
                                 ("dense", "dense", True)):
            case.top_method, case.exact_select, case.select_algo = top, exact, "radix"

            def step():
                if top == "dense":
                    return case.dense()
                case.select(lists, scores)
                return case.paged_attention() if top == "fused" else case.sparse_attention()

            with sdpa_backend_ctx():
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step()
                    torch.cuda.synchronize()
            rows = []
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t > 0:
                    rows.append((t / 10, e.key[:80]))
            rows.sort(reverse=True)
            out[f"b{batch}_{name}_ops_us_per_step"] = [[round(t, 1), k] for t, k in rows[:12]]
        del case
        torch.cuda.empty_cache()
    return out


def run(args):
    device = "cuda"
    result = {
        "bench": "gpu_decode_attention",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "shape": {"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "dtype": "bf16",
                  "page_tokens": PAGE, "m": args.m, "C": args.c, "alpha": args.alpha,
                  "rho": args.rho},
        "pdl": getattr(kernels, "PDL", None),  # programmatic dependent launch setting
        "self_check": self_check(device),
        "rows": [],
    }
    if kernels is not None and not args.no_sweep:
        result["select_sweep"] = select_sweep(args.iters)
    if kernels is not None and args.radix_sweep:
        result["radix_sweep"] = radix_sweep(args)
    if kernels is not None and args.radix_bits:
        kernels.RADIX_BITS = args.radix_bits
        result["shape"]["radix_bits"] = args.radix_bits
    for n in args.lengths:
        for batch in args.batches:
            torch.cuda.empty_cache()
            case = Case(n, batch, m=args.m, c=args.c, alpha=args.alpha, rho=args.rho,
                        device=device)
            row = {"n_tokens": n, "batch": batch, "pages_selected_per_kv_head": case.kp,
                   "pages_per_kv_head": case.p}
            with sdpa_backend_ctx():
                row["dense_us"] = time_graph(case.dense, args.iters)
                variants = [("csa_token", "topk", case.tok_bins, case.tok_scores),
                            ("csa_page", "topk", case.page_bins, case.page_scores)]
                if kernels is not None:
                    for algo, suffix in (("search", ""), ("radix", "_radix"), ("split", "_split")):
                        variants += [
                            ("csa_token_fused" + suffix, "fused", case.tok_bins, case.tok_scores),
                            ("csa_page_fused" + suffix, "fused", case.page_bins, case.page_scores),
                            ("csa_page_fused" + suffix + "_bf16rank", "fused16", case.page_bins,
                             case.page_scores)]
                    variants.append(("csa_token_softmax_qhead_radix", "qhead", None,
                                     case.tok_scores))
                if args.variants:
                    keep = set(args.variants.split(","))
                    variants = [v for v in variants if v[0] in keep]
                for name, top, lists, scores in variants:
                    case.exact_select = top != "fused16"
                    case.select_algo = ("radix" if "_radix" in name else
                                        "split" if "_split" in name else "search")
                    top = "fused" if top == "fused16" else top
                    case.top_method = top
                    attend = (case.paged_attention if top == "fused" else
                              case.paged_attention_qhead if top == "qhead" else
                              case.sparse_attention)
                    case.select(lists, scores)
                    sel_us = time_graph(lambda: case.select(lists, scores), args.iters)
                    attn_us = time_graph(attend, args.iters)
                    total_us = time_graph(
                        lambda: (case.select(lists, scores), attend()), args.iters)
                    # The "keep-rho, search every P steps" schedule (csa's
                    # period, index/csa.h) at P = 4: one search, then the
                    # pages reused for 4 steps; one graph of a whole period.
                    period4_us = time_graph(
                        lambda: (case.select(lists, scores), attend(), attend(), attend(),
                                 attend()), args.iters) / 4
                    entries = batch * 8 * case.m * (case.lt if name.startswith("csa_token")
                                                     else case.lp)
                    if top == "qhead":
                        entries *= case.g  # each q head gathers its own lists
                    row[name] = {
                        "total_us": total_us, "select_us": sel_us, "gather_attention_us": attn_us,
                        "speedup_vs_dense": row["dense_us"] / total_us,
                        "attention_only_speedup": row["dense_us"] / attn_us,
                        "list_entries_touched": entries,
                        "period4_us": period4_us,
                        "period4_speedup": row["dense_us"] / period4_us,
                    }
            if kernels is not None and args.attn_sweep:
                # PagedDecodeAttention's split geometry over the last selection.
                sweep = {}
                for geo in ((2, 4), (1, 4), (4, 4), (4, 2), (8, 2), (8, 1)):
                    sweep[f"{geo[0]}per_sm_{geo[1]}ppb"] = time_graph(
                        lambda: case.paged_attention(geo), args.iters)
                row["attention_geometry_us"] = sweep
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del case
    peak = torch.cuda.max_memory_allocated() / 2**30
    result["peak_gpu_gib"] = peak
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--alpha", type=float, default=0.25)
    ap.add_argument("--m", type=int, default=8, help="csa subspaces")
    ap.add_argument("--c", type=int, default=128, help="csa centroids per subspace")
    ap.add_argument("--variants", default="",
                    help="comma list of workloads to time (default: all), e.g. "
                         "csa_page_fused,csa_page_fused_radix")
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="")
    ap.add_argument("--radix-sweep", action="store_true",
                    help="time the radix top-k by digit width and warps on real csa scores")
    ap.add_argument("--radix-bits", type=int, default=0,
                    help="digit width of the radix top-k in the timed steps (0: kernels' default)")
    ap.add_argument("--attn-sweep", action="store_true",
                    help="also time the paged attention's split geometries")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the top-k sweep (select_top_pages alone, both algorithms)")
    ap.add_argument("--profile", action="store_true",
                    help="per-op CUDA times of one step at the largest length instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_decode_attention", "skipped": "no CUDA device"}))
        return 0
    t0 = time.time()
    result = profile(args) if args.profile else run(args)
    result["wall_s"] = time.time() - t0
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
