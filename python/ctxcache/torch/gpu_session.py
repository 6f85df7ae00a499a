"""The session core in torch: a whole layer's selection, page cap and page
tables as tensor ops on the queries' device (the GPU in a decode worker), for
csa, quest, streaming and oracle.

The C++ session core (session/sparse_session.h) is the specification; the
native library runs it in this process
(:class:`ctxcache.native.DecodeSession` with ``client_mode``). This module
runs the same four stages (docs/architecture.md, "Decode path: one session
core") for every kv head of a layer at once, with the selection of each q
head held as a dense token mask, over the tables that
:class:`ctxcache.torch.tables.ContextTables` parses. :func:`torch_session`
makes the session of a method; all of them share stages 2-4 and return a
:class:`LayerPlan` from ``step(layer, queries)``.

1. select, per method:

   * csa (:class:`TorchCsaSession`, ``CsaSelector::Select``): per q head and
     subspace the nearest centroid, or the top ``tau`` by similarity (ties:
     lower index) when the best cosine is below ``backoff_cos``; ``w * score +
     bias`` of every entry of the chosen lists scatter-added into a float32
     accumulator per q head; the sinks and the recent window forced in; the
     top of the rest up to the token budget, ties to the lower id.
   * quest (:class:`TorchQuestSession`): the page bounds summed over d in the
     C++ order (d elementwise steps), the page walk in closed form
     (:func:`quest_take_pages`). No logits.
   * streaming (:class:`TorchStreamingSession`): a fixed mask per layer.
     No logits.
   * oracle (:class:`TorchOracleSession`): q.k against the context's keys,
     which the caller passes as a tensor (they stay on the device), top k with
     ties to the lower id; logits q.k / sqrt(d).
2. page cap (``CapSelectedPages``): pages ranked by estimated softmax mass
   (float64; by selected-token count without logits: quest, streaming, or a
   csa step that reused the last selection), ties to the later page; page 0
   and the last ``recent_blocks + 1`` pages always kept.
3. block-union page tables per subgroup of q heads (``BuildPageTables``).
4. whole-page widening (``ExpandToTablePages``).

Exactness. Streaming and quest give the C++ selections bit for bit on any
device (no arithmetic, or float32 elementwise ops in the C++ order). csa and
oracle are not bit-exact: their float32 sums run in another order than the
C++ loops (scatter-add, matmul, fused or unfused multiply-add, the device's
exp; TF32 matmuls, if enabled, change oracle's scores further), so a token
whose score ties or nearly ties the budget's boundary may be chosen
differently. python/tests/test_selection.py (csa) and test_gpu_selection.py
(quest, streaming, oracle) check them against the C++ core through the
library, with a real ctxcached, on real artifacts. This covers the stored
context only (a session that has appended no tokens; the C++ core's
selectors also take appended keys).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ctxcache.torch.artifacts import CsaArtifact
from ctxcache.torch.tables import (SKETCH_QUERY_MAX_CODE, ContextTables, SessionParams,
                                   budget_for, csa_missing_scores, page_budget)

__all__ = ["LayerPlan", "TORCH_SESSIONS", "TorchCsaSession", "TorchOracleSession",
           "TorchQuestSession", "TorchStreamingSession", "capture_graph",
           "quest_page_scores_torch", "quest_take_pages", "torch_session"]


@dataclass
class LayerPlan:
    """One layer-step of every kv head.

    token_mask: [H, G, n] bool, the tokens each q head attends (after the
        page cap and, with whole_pages, the widening).
    table_pages: [H, S, n_pages] bool, the page table of each subgroup.
    pages: [H, n_pages] bool, the union of a kv head's tables: its pages.
    selected: [H, G, n] bool, the selector's raw selection (stage 1).
    """

    token_mask: torch.Tensor
    table_pages: torch.Tensor
    pages: torch.Tensor
    selected: torch.Tensor

    def page_ids(self, kv_head: int) -> torch.Tensor:
        """Ascending page ids of one kv head (int64, on the plan's device)."""
        return torch.nonzero(self.pages[kv_head])[:, 0]


# csa list ids are held as int16 (offset by -32768) on the device for
# contexts of up to this many tokens, int32 beyond.
INT16_ID_TOKENS = 1 << 16


class _Layer:
    """The csa tables of every kv head of one layer, stacked on a device."""

    def __init__(self, arts: Sequence[CsaArtifact], device: Any) -> None:
        first = arts[0]
        for a in arts:
            if (a.m, a.C, a.L, a.head_dim, a.n_tokens) != (first.m, first.C, first.L,
                                                            first.head_dim, first.n_tokens):
                raise ValueError("TorchCsaSession: the kv heads of a layer have different "
                                 "table shapes")
        self.o = first.options
        self.m, self.C, self.L = first.m, first.C, first.L
        self.d, self.n, self.ds = first.head_dim, first.n_tokens, first.sub_dim
        h = len(arts)
        self.cent = torch.as_tensor(np.stack([a.centroids for a in arts]),
                                    dtype=torch.float32, device=device)  # [H, m, C, ds]
        # On the device a list entry takes 4 bytes up to 65,536 tokens: the
        # id as int16 minus 32768 (id_offset), else int32, widened per step
        # for scatter_add_; the score as the artifacts' float16 (every
        # format's scores are fp16 values: widened exactly per step).
        ids = np.stack([a.ids for a in arts]).reshape(h * self.m * self.C, self.L)
        if self.n <= INT16_ID_TOKENS:
            self.id_offset = 1 << 15
            ids = (ids.astype(np.int32) - self.id_offset).astype(np.int16)
        else:
            self.id_offset = 0
            ids = ids.astype(np.int32, copy=False)
        self.ids = torch.as_tensor(ids, device=device)
        sc = np.stack([a.scores for a in arts]).reshape(h * self.m * self.C, self.L)
        if sc.dtype != np.float16:
            raise ValueError(f"TorchCsaSession: list scores of dtype {sc.dtype}, expected float16")
        self.scores = torch.as_tensor(sc, device=device)
        miss = np.stack([csa_missing_scores(a) for a in arts])
        self.missing = torch.as_tensor(miss, device=device).reshape(-1)
        # The key sketch (stage 2, rerank > 0): int8 codes [H, n, d] and the
        # fp16 scales widened to float64 [H, n] (exact).
        self.rerank = self.o.rerank if first.sketch is not None else 0.0
        self.sketch: Optional[torch.Tensor] = None
        self.sketch_scale: Optional[torch.Tensor] = None
        if self.rerank > 0:
            self.sketch = torch.as_tensor(np.stack([a.sketch for a in arts]), device=device)
            self.sketch_scale = torch.as_tensor(
                np.stack([a.sketch_scale.astype(np.float64) for a in arts]), device=device)
        self.last: Optional[torch.Tensor] = None  # the last search's selection [H, G, n]
        self.since_search = 0


def capture_graph(device: Any, fn: Any, pool: Any = None) -> Tuple[Any, Any]:
    """Runs ``fn()`` once eagerly (lazy initializations stay out of the
    capture), then captures ``fn()`` as a CUDA graph (in the memory ``pool``
    of another graph, if given). Returns the graph and the captured call's
    outputs: buffers that each replay rewrites, not yet written.

    The warm-up runs on the current stream: on a side stream made for it,
    its temporaries stayed allocated after the graphs and their owner were
    gone (docs/benchmarks.md, "GPU memory left behind")."""
    fn()
    torch.cuda.current_stream(device).synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def _top_k_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """Rows' k largest entries as a mask, ties to the lower index."""
    n = x.shape[-1]
    if k >= n:
        return torch.ones_like(x, dtype=torch.bool)
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    above = x > kth
    ties = x == kth
    need = k - above.sum(dim=-1, keepdim=True)
    return above | (ties & (torch.cumsum(ties.to(torch.int32), dim=-1) <= need))


def _mask_indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The column indices of a 2-D mask with exactly ``count`` set entries per
    row, ascending: [rows, count] (cumsum compaction, no host sync)."""
    rows = mask.shape[0]
    pos = torch.cumsum(mask.to(torch.int64), dim=1) - 1
    slot = torch.where(mask, pos, torch.full_like(pos, count))
    cols = torch.arange(mask.shape[1], device=mask.device).expand(rows, -1)
    out = torch.zeros(rows, count + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(1, slot, cols)[:, :count]


def _sketch_scores(lay: "_Layer", rows: torch.Tensor, qi: torch.Tensor, qs: torch.Tensor,
                   g: int) -> torch.Tensor:
    """float32 [hg, R]: for row i (q head i, kv head i // g) and token
    rows[i, e], float32(double(sum_j qi[i, j] * code[j]) * (double(qs[i]) *
    double(scale))). The dot is exact: int32 in the Triton kernel (CUDA),
    float64 otherwise."""
    if rows.is_cuda and lay.sketch.shape[-1] in (16, 32, 64, 128, 256):
        from ctxcache.torch import kernels  # Triton: CUDA only
        return kernels.sketch_scores(lay.sketch, lay.sketch_scale, rows, qi, qs, g)
    hg = rows.shape[0]
    head = torch.arange(hg // g, device=rows.device).repeat_interleave(g).view(hg, 1)
    dots = torch.bmm(lay.sketch[head, rows].double(), qi.double().unsqueeze(-1)).squeeze(-1)
    return (dots * (qs.double() * lay.sketch_scale[head, rows])).float()


class _TorchPlanner:
    """Stages 2-4 of the session core on a torch device, shared by every
    method's torch session; a subclass supplies stage 1 (:meth:`_select`)."""

    method = ""

    def __init__(self, tables: ContextTables, device: Any) -> None:
        # The parsed and checked artifacts and params; each session copies
        # what its stage 1 reads onto the device.
        self.tables = tables
        self.params = tables.params
        self.n_layers, self.n_kv_heads = tables.n_layers, tables.n_kv_heads
        self.n_q_heads, self.group_size = tables.n_q_heads, tables.group_size
        self.n_tokens, self.head_dim = tables.n_tokens, tables.head_dim
        self.device = torch.device(device)
        b = self.params.page_size
        self.n_pages = (self.n_tokens + b - 1) // b
        # layer -> (CUDA graph, its query buffer, its LayerPlan); None: eager.
        self._graphs: Optional[Dict[int, Tuple[Any, torch.Tensor, LayerPlan]]] = None

    def use_cuda_graphs(self, on: bool = True) -> None:
        """Runs each layer's stages 1-4 as one CUDA graph (captured at the
        layer's first step; ~100 kernel launches of host time become one
        replay). Same results as eager. Contract: the LayerPlan a step returns
        is the graph's output buffers, overwritten by the next step of the
        same layer (copy what must outlive it). Layers whose selection keeps
        host state (csa with ``period`` > 1) stay eager. ValueError unless the
        session is on a CUDA device."""
        if on and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graphs: the session is on {self.device}, not CUDA")
        self._graphs = {} if on else None

    def _graphable(self, layer: int) -> bool:
        """Whether ``layer``'s stage 1 is a pure function of the queries."""
        return True

    def graphable(self, layer: int) -> bool:
        """Whether ``layer``'s plan is a pure function of its queries (so a
        caller may capture :meth:`plan_queries` in a CUDA graph)."""
        return self._graphable(layer)

    def plan_queries(self, layer: int, q: torch.Tensor) -> LayerPlan:
        """Stages 1-4 for queries ``q`` [n_q_heads, d] already float32 on the
        session's device: :meth:`step` without its checks, which read the
        device (no host sync, capturable when :meth:`graphable`)."""
        return self._plan(*self._select(layer, q))

    def _graph_step(self, layer: int, q: torch.Tensor) -> LayerPlan:
        assert self._graphs is not None
        entry = self._graphs.get(layer)
        if entry is None:
            static_q = q.clone()
            graph, plan = capture_graph(self.device,
                                        lambda: self._plan(*self._select(layer, static_q)))
            entry = self._graphs[layer] = (graph, static_q, plan)
        graph, static_q, plan = entry
        static_q.copy_(q)
        graph.replay()
        return plan

    def reset(self) -> None:
        """Forgets any search schedule (csa's ``period`` > 1)."""

    def _select(self, layer: int, q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Stage 1: the selection mask [H, G, n] and the logit estimates
        [H, G, n] (None: the page cap ranks pages by selected-token count)."""
        raise NotImplementedError

    def by_page(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., n_pages, page_size], zero/False padded."""
        b = self.params.page_size
        pad = self.n_pages * b - x.shape[-1]
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(*x.shape[:-1], self.n_pages, b)

    def _cap(self, sel: torch.Tensor, logits: Optional[torch.Tensor]) -> torch.Tensor:
        p = self.params
        n_pages = self.n_pages
        count = self.by_page(sel.to(torch.int32)).sum(dim=(1, 3))        # [H, n_pages]
        if logits is not None:
            lg = torch.where(sel, logits, torch.full_like(logits, -math.inf)).double()
            mx = lg.max(dim=-1, keepdim=True).values
            e = torch.where(sel, torch.exp(lg - mx), torch.zeros_like(lg))
            z = e.sum(dim=-1, keepdim=True)
            share = torch.where(z > 0, e / torch.where(z > 0, z, torch.ones_like(z)),
                                torch.zeros_like(e))
            rank = self.by_page(share).sum(dim=(1, 3))                   # [H, n_pages]
        else:
            rank = count.double()
        keep = torch.zeros(n_pages, dtype=torch.bool, device=sel.device)
        if n_pages:
            keep[:1] = True  # a slice fill: no host-to-device copy (CUDA graphs)
        keep[max(0, n_pages - 1 - p.recent_blocks):] = True
        cand = ~keep & (count > 0)
        # Rank desc, ties to the later page: a stable sort over reversed pages.
        key = torch.where(cand, rank, torch.full_like(rank, -math.inf)).flip(-1)
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        top = (n_pages - 1 - order)[:, :page_budget(p.page_fraction, self.n_tokens,
                                                    p.page_size)]
        chosen = torch.zeros_like(cand)
        chosen.scatter_(1, top, True)
        keep_pages = (chosen & cand) | keep                                 # [H, n_pages]
        tok_keep = keep_pages.unsqueeze(-1).expand(-1, -1, p.page_size).reshape(
            keep_pages.shape[0], -1)[:, :self.n_tokens]
        return sel & tok_keep.unsqueeze(1)

    def _plan(self, sel: torch.Tensor, logits: Optional[torch.Tensor]) -> LayerPlan:
        """Stages 2-4 for a layer's selection."""
        p = self.params
        mask = self._cap(sel, logits) if p.page_fraction > 0 else sel
        # Stage 3: per subgroup, the union of its heads' pages plus the recent ones.
        h, g = self.n_kv_heads, self.group_size
        sg = min(p.subgroup, g)
        n_sub = (g + sg - 1) // sg
        head_pages = self.by_page(mask).any(dim=-1)                      # [H, G, n_pages]
        if n_sub * sg != g:
            head_pages = torch.nn.functional.pad(head_pages, (0, 0, 0, n_sub * sg - g))
        tables = head_pages.view(h, n_sub, sg, self.n_pages).any(dim=2)     # [H, S, n_pages]
        tables[:, :, max(0, self.n_pages - 1 - p.recent_blocks):] = True
        if p.whole_pages:  # stage 4: every token of the subgroup's pages
            sub_of = torch.arange(g, device=sel.device) // sg
            tok = tables[:, sub_of].unsqueeze(-1).expand(-1, -1, -1, p.page_size)
            mask = tok.reshape(h, g, -1)[:, :, :self.n_tokens]
        return LayerPlan(token_mask=mask, table_pages=tables, pages=tables.any(dim=1),
                         selected=sel)

    def step(self, layer: int, queries: torch.Tensor) -> LayerPlan:
        """Plans ``layer`` for queries [n_q_heads, d] (any float dtype; used
        as float32 on the session's device)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"step.layer {layer} out of range [0, {self.n_layers})")
        if tuple(queries.shape) != (self.n_q_heads, self.head_dim):
            raise ValueError(f"queries have shape {list(queries.shape)}, expected "
                             f"[{self.n_q_heads}, {self.head_dim}]")
        q = queries.to(self.device, torch.float32)
        if not bool(torch.isfinite(q).all()):
            raise ValueError(f"{self.method}: queries have NaN/Inf")
        if self._graphs is not None and self._graphable(layer):
            return self._graph_step(layer, q)
        sel, logits = self._select(layer, q)
        return self._plan(sel, logits)


class TorchCsaSession(_TorchPlanner):
    """Client-side csa selection for a whole context on a torch device.

    >>> arts = client.fetch_index(ctx.context_id, "csa")
    >>> sess = TorchCsaSession(arts, n_q_heads=ctx.model.n_q_heads, device="cuda")
    >>> plan = sess.step(layer, q)          # q: [n_q_heads, d] post-RoPE queries
    >>> plan.page_ids(0)                    # kv head 0's pages, ascending
    """

    method = "csa"

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 device: Any = "cpu") -> None:
        super().__init__(ContextTables(artifacts, n_q_heads, params, method="csa"), device)
        self.layers = [_Layer(self.tables.layer(l), self.device) for l in range(self.n_layers)]

    def reset(self) -> None:
        for lay in self.layers:
            lay.last, lay.since_search = None, 0

    def _graphable(self, layer: int) -> bool:
        return self.layers[layer].o.period <= 1

    def _select(self, layer: int, q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        lay = self.layers[layer]
        period = lay.o.period
        if period > 1 and lay.last is not None and 0 < lay.since_search < period:
            lay.since_search += 1
            return lay.last, None  # reused: pages ranked by count, like the core
        sel, logits = self._search(lay, q, self.params.token_budget(self.n_tokens))
        if period > 1:
            lay.last, lay.since_search = sel, 1
        return sel, logits

    # ---------------------------------------------------------------- stage 1
    def _search(self, lay: _Layer, q: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Selection mask [H, G, n] and the accumulated scores as logits."""
        o = lay.o
        h, g = self.n_kv_heads, self.group_size
        m, c, n = lay.m, lay.C, lay.n
        qs = q.view(h, g, m, lay.ds)
        norms = qs.norm(dim=-1)                                   # [H, G, m]
        sims = torch.einsum("hgmd,hmcd->hgmc", qs, lay.cent)      # [H, G, m, C]
        best = sims.argmax(dim=-1, keepdim=True)                  # first of equal maxima
        if o.proj_weights:
            w_of = sims
        else:
            w = norms if o.norm_weights else torch.ones_like(norms)
            w_of = w.unsqueeze(-1).expand(h, g, m, c)
        tau = min(o.tau, c) if o.tau > 1 else 1
        if tau > 1:
            safe = torch.where(norms > 0, norms, torch.ones_like(norms))
            back = (sims.gather(-1, best)[..., 0] / safe) < o.backoff_cos    # [H, G, m]
            order = torch.sort(sims, dim=-1, descending=True, stable=True).indices[..., :tau]
            chosen = torch.where(back.unsqueeze(-1), order, best.expand(h, g, m, tau))
            wj = w_of.gather(-1, chosen)
            wj = torch.where(back.unsqueeze(-1), wj / tau, wj)
            first = torch.arange(tau, device=q.device) == 0
            wj = torch.where(back.unsqueeze(-1) | first, wj, torch.zeros_like(wj))
        else:
            chosen = best
            wj = w_of.gather(-1, chosen)
        wj = torch.where((norms > 0).unsqueeze(-1), wj, torch.zeros_like(wj))  # [H, G, m, J]
        base = (torch.arange(h, device=q.device).view(h, 1, 1, 1) * m +
                torch.arange(m, device=q.device).view(1, 1, m, 1)) * c
        lid = (base + chosen).reshape(-1)                         # lists, [H*G*m*J]
        bias = -wj.reshape(-1) * lay.missing[lid]
        vals = lay.scores[lid].float() * wj.reshape(-1, 1) + bias.view(-1, 1)
        ids = lay.ids[lid].view(h * g, -1).long()
        if lay.id_offset:
            ids = ids + lay.id_offset
        acc = torch.zeros(h * g, n, dtype=torch.float32, device=q.device)
        acc.scatter_add_(1, ids, vals.view(h * g, -1))
        n_sinks = min(o.sinks, n)
        recent_start = max(n_sinks, n - o.recent)
        forced = torch.zeros(n, dtype=torch.bool, device=q.device)
        forced[:n_sinks] = True
        forced[recent_start:] = True
        n_forced = n_sinks + (n - recent_start)
        if o.norm_weights or o.proj_weights:
            to_logit = torch.full((h * g, 1), 1.0 / math.sqrt(lay.d), device=q.device)
        else:
            to_logit = (norms.sum(dim=-1) / m).view(h * g, 1) / math.sqrt(lay.d)
        if lay.rerank > 0:
            return self._rerank(lay, q, acc, acc * to_logit, forced, n_sinks, recent_start, k)
        ranked = torch.where(forced, torch.full_like(acc, math.inf), acc)
        sel = _top_k_mask(ranked, max(k, n_forced))
        return sel.view(h, g, n), (acc * to_logit).view(h, g, n)

    # ---------------------------------------------------------------- stage 2
    def _rerank(self, lay: _Layer, q: torch.Tensor, acc: torch.Tensor, logits: torch.Tensor,
                forced: torch.Tensor, n_sinks: int, recent_start: int,
                k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stage 2 of ``CsaSelector::SearchOne`` (rerank > 0) for every q head
        at once: the forced tokens and the top ``ceil(rerank * k) - |forced|``
        others by ``acc`` are scored with the key sketch (an exact integer
        dot product, _sketch_scores); the best of the others fill the
        budget, ties to the lower id at both stages."""
        h, g, n, d = self.n_kv_heads, self.group_size, lay.n, lay.d
        hg = h * g
        dev = q.device
        fixed = torch.cat([torch.arange(n_sinks, device=dev),
                           torch.arange(recent_start, n, device=dev)])       # [F]
        n_forced = int(fixed.numel())
        qf = q.reshape(hg, d).float()
        qs = qf.abs().amax(dim=-1, keepdim=True) / SKETCH_QUERY_MAX_CODE      # [hg, 1]
        qi = torch.where(qs > 0, torch.round(qf / torch.where(qs > 0, qs, torch.ones_like(qs))),
                         torch.zeros_like(qf))
        rows = fixed.unsqueeze(0).expand(hg, n_forced)
        want = 0
        if k > n_forced:
            want = min(n - n_forced, int(math.ceil(lay.rerank * float(k))) - n_forced)
        if want > 0:
            # The candidates as the C++ core takes them (ties to the lower id).
            ranked = torch.where(forced, torch.full_like(acc, -math.inf), acc)
            cand = _mask_indices(_top_k_mask(ranked, want), want)
            rows = torch.cat([rows, cand], dim=1)
        r = _sketch_scores(lay, rows, qi, qs, g)                             # [hg, R]
        sel = forced.unsqueeze(0).expand(hg, n).clone()
        if want > 0:
            # cand is ascending, so ties to the lower position are ties to the
            # lower id; no candidate is forced, so the scatter only adds picks.
            sel.scatter_(1, cand, _top_k_mask(r[:, n_forced:], k - n_forced))
        inv_sqrt_d = 1.0 / math.sqrt(d)
        logits = logits.scatter(1, rows, r * inv_sqrt_d)
        return sel.view(h, g, n), logits.view(h, g, n)


def _token_mask(page_mask: torch.Tensor, page_size: int, n: int) -> torch.Tensor:
    """[..., P] page flags -> [..., n] token flags (every token of a page)."""
    return page_mask.unsqueeze(-1).expand(*page_mask.shape, page_size).reshape(
        *page_mask.shape[:-1], -1)[..., :n]


class TorchStreamingSession(_TorchPlanner):
    """Client-side streaming selection (``StreamingSelector``) on a torch
    device: every q head selects the first ``min(sinks, k)`` tokens and the
    last ``k - that`` of the budget k. Exact (no arithmetic)."""

    method = "streaming"

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 device: Any = "cpu") -> None:
        super().__init__(ContextTables(artifacts, n_q_heads, params, method="streaming"),
                         device)
        n = self.n_tokens
        k = min(self.params.token_budget(n), n)
        self.masks = []  # per layer [H, n]: the same for every step
        for layer in range(self.n_layers):
            m = torch.zeros(self.n_kv_heads, n, dtype=torch.bool)
            for h, a in enumerate(self.tables.layer(layer)):
                n_sink = min(a.n_sink, k)
                m[h, :n_sink] = True
                m[h, max(n_sink, n - (k - n_sink)):] = True
            self.masks.append(m.to(self.device))

    def _select(self, layer: int, q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        m = self.masks[layer]
        return m.unsqueeze(1).expand(-1, self.group_size, -1).contiguous(), None


def quest_page_scores_torch(q: torch.Tensor, page_min: torch.Tensor,
                            page_max: torch.Tensor) -> torch.Tensor:
    """``QuestSelector::PageScore`` for q [H, G, d] and bounds [H, P, d] ->
    [H, G, P] float32, summed over d in order like the compiled loop (each
    product, max and sum an elementwise float32 op, so the result is the
    C++ one bit for bit): d small kernels per call."""
    s = torch.zeros(q.shape[0], q.shape[1], page_min.shape[1], dtype=torch.float32,
                    device=q.device)
    for j in range(q.shape[-1]):
        qj = q[:, :, j:j + 1]                                   # [H, G, 1]
        s = s + torch.maximum(qj * page_min[:, None, :, j], qj * page_max[:, None, :, j])
    return s


def quest_take_pages(scores: torch.Tensor, n: int, page: int, budget: int) -> torch.Tensor:
    """The Quest pages ``QuestSelector::Select`` takes, as a mask [..., P],
    from the page bounds [..., P] and the token budget (at most n).

    The C++ walks the pages by descending bound (ties: the lower page) and
    takes each one that fits the budget (the first always) until the budget
    is reached. All pages hold ``page`` tokens except the last (r tokens), so
    the walk has a closed form: with k = budget, F = k // page and ip the
    last page's position in the order, if ip < max(1, F) the last page is
    taken with the first ``(k - r) // page`` other pages (none when r >= k);
    else the first ``max(1, F)`` other pages are taken, and the last page
    too when F >= 1 and F * page + r <= k.
    """
    n_pages = scores.shape[-1]
    k = min(budget, n)
    r = n - (n_pages - 1) * page
    f_ = k // page
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    is_last = order == n_pages - 1
    ip = is_last.to(torch.int64).argmax(dim=-1, keepdim=True)          # [..., 1]
    early = ip < max(1, f_)
    f_early = (k - r) // page if k > r else 0
    f_late = max(1, f_)
    last_late = f_ >= 1 and f_ * page + r <= k
    f = torch.where(early, torch.full_like(ip, f_early), torch.full_like(ip, f_late))
    rank = torch.cumsum((~is_last).to(torch.int64), dim=-1) - 1       # rank among the others
    take_last = early | last_late
    take = (~is_last & (rank < f)) | (is_last & take_last)
    mask = torch.zeros_like(take)
    return mask.scatter_(-1, order, take)


class TorchQuestSession(_TorchPlanner):
    """Client-side Quest selection (``QuestSelector``) on a torch device: the
    page bounds of :func:`quest_page_scores_torch`, the pages of
    :func:`quest_take_pages`, every token of them. Exact: the same
    selections as the C++ selector (float32 elementwise ops in its order)."""

    method = "quest"

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 device: Any = "cpu") -> None:
        super().__init__(ContextTables(artifacts, n_q_heads, params, method="quest"), device)
        self.bounds = []  # per layer: (page size, min [H, P, d], max [H, P, d])
        for layer in range(self.n_layers):
            arts = self.tables.layer(layer)
            if len({a.page_size for a in arts}) != 1:
                raise ValueError(f"TorchQuestSession: the kv heads of layer {layer} have "
                                 "different Quest page sizes")
            mn = torch.as_tensor(np.stack([a.page_min for a in arts]), device=self.device)
            mx = torch.as_tensor(np.stack([a.page_max for a in arts]), device=self.device)
            self.bounds.append((arts[0].page_size, mn, mx))

    def _select(self, layer: int, q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        page, mn, mx = self.bounds[layer]
        h, g = self.n_kv_heads, self.group_size
        scores = quest_page_scores_torch(q.view(h, g, self.head_dim), mn, mx)
        pages = quest_take_pages(scores, self.n_tokens, page,
                                 self.params.token_budget(self.n_tokens))
        return _token_mask(pages, page, self.n_tokens), None


class TorchOracleSession(_TorchPlanner):
    """Client-side oracle selection (``OracleSelector``) on a torch device:
    the top k of q.k over every key (ties: the lower id), logits q.k / sqrt(d)
    for the page cap's mass ranking.

    keys: the context's stored keys as a tensor [n_layers, n_kv_heads, n, d]
    (or a mapping ``{(layer, kv_head): [n, d]}``); held on the session's
    device in their dtype (bf16 and fp16 are exact in float32; others become
    float32), one layer widened to float32 per step.

    Not bit-exact: q.k is a batched matmul (another summation order than the
    C++ GEMV), so keys whose scores tie or nearly tie at the budget's edge
    may be chosen differently; python/tests/test_gpu_selection.py checks it
    against the server and the C++ core through the library on real contexts.
    """

    method = "oracle"

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 keys: Any, params: Union[SessionParams, Mapping[str, Any], None] = None,
                 device: Any = "cpu") -> None:
        if keys is None:
            raise ValueError("oracle: needs the context's keys (keys=[n_layers, n_kv_heads, "
                             "n_tokens, head_dim])")
        dev = torch.device(device)
        if isinstance(keys, Mapping):
            n_layers = 1 + max(l for l, _ in keys)
            n_kv = 1 + max(h for _, h in keys)
            keys = torch.stack([torch.stack([torch.as_tensor(keys[(l, h)]) for h in range(n_kv)])
                                for l in range(n_layers)])
        keys = torch.as_tensor(keys)
        if keys.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            keys = keys.float()
        keys = keys.to(dev)  # bf16/fp16 stay so (exact in float32): half the memory
        super().__init__(ContextTables(artifacts, n_q_heads, params, method="oracle"), dev)
        if tuple(keys.shape) != (self.n_layers, self.n_kv_heads, self.n_tokens, self.head_dim):
            raise ValueError(f"oracle: keys have shape {list(keys.shape)}, expected "
                             f"[{self.n_layers}, {self.n_kv_heads}, {self.n_tokens}, "
                             f"{self.head_dim}]")
        if not bool(torch.isfinite(keys).all()):
            raise ValueError("oracle: keys have NaN/Inf")
        self.keys = keys
        rho = self.tables.artifacts[(0, 0)].rho
        self.k = budget_for(self.params.token_budget(self.n_tokens), rho, self.n_tokens)
        self.inv = float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))

    def _select(self, layer: int, q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        h, g = self.n_kv_heads, self.group_size
        scores = torch.einsum("hgd,hnd->hgn", q.view(h, g, self.head_dim),
                              self.keys[layer].float())
        return _top_k_mask(scores, self.k), scores * self.inv


TORCH_SESSIONS = {"csa": TorchCsaSession, "quest": TorchQuestSession,
                  "streaming": TorchStreamingSession, "oracle": TorchOracleSession}


def torch_session(method: str, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                  params: Union[SessionParams, Mapping[str, Any], None] = None,
                  device: Any = "cpu", keys: Any = None,
                  cuda_graphs: bool = False) -> _TorchPlanner:
    """The torch session of ``method`` (csa, quest, streaming or oracle; keys
    for oracle only). ValueError for a method without one. ``cuda_graphs``:
    see :meth:`_TorchPlanner.use_cuda_graphs` (CUDA devices only)."""
    if method not in TORCH_SESSIONS:
        raise ValueError(f"method '{method}' has no torch session; expected one of "
                         f"{', '.join(TORCH_SESSIONS)}")
    if method == "oracle":
        sess = TorchOracleSession(artifacts, n_q_heads, keys, params=params, device=device)
    elif keys is not None:
        raise ValueError(f"keys are for method oracle, not {method}")
    else:
        sess = TORCH_SESSIONS[method](artifacts, n_q_heads, params=params, device=device)
    if cuda_graphs:
        sess.use_cuda_graphs()
    return sess
