"""The csa session core in torch: a whole layer's selection, page cap and
page tables as tensor ops on the queries' device (the GPU in a decode worker).

:mod:`ctxcache.torch.selection` is the exact reference: numpy, following the
compiled C++ core operation for operation, one (layer, kv head) at a time.
This module runs the same four stages (docs/architecture.md, "Decode path:
one session core") for every kv head of a layer at once, with the selection
of each q head held as a dense token mask:

1. select (``CsaSelector::Select``): per q head and subspace the nearest
   centroid, or the top ``tau`` by similarity (ties: lower index) when the
   best cosine is below ``backoff_cos``; ``w * score + bias`` of every entry
   of the chosen lists scatter-added into a float32 accumulator per q head;
   the sinks and the recent window forced in; the top of the rest up to the
   token budget, ties to the lower id.
2. page cap (``CapSelectedPages``): pages ranked by estimated softmax mass
   (float64; by selected-token count when a search period reused the last
   selection), ties to the later page; page 0 and the last ``recent_blocks +
   1`` pages always kept.
3. block-union page tables per subgroup of q heads (``BuildPageTables``).
4. whole-page widening (``ExpandToTablePages``).

Not bit-exact: the float32 sums run in another order than the C++ loops
(scatter-add, fused or unfused multiply-add, the device's exp), so a token
whose accumulated score ties or nearly ties the budget's boundary may be
chosen differently. python/tests/test_gpu_session.py bounds the difference
against the numpy reference on real artifacts. Like the numpy reference, it
covers the stored context only (a session that has appended no tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ctxcache.torch.selection import CsaIndex, CsaSession, SessionParams, page_budget

__all__ = ["LayerPlan", "TorchCsaSession"]


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


class _Layer:
    """The csa tables of every kv head of one layer, stacked on a device."""

    def __init__(self, indexes: Sequence[CsaIndex], device: Any) -> None:
        first = indexes[0]
        for ix in indexes:
            if (ix.m, ix.C, ix.L, ix.head_dim, ix.n_tokens) != (first.m, first.C, first.L,
                                                                 first.head_dim, first.n_tokens):
                raise ValueError("TorchCsaSession: the kv heads of a layer have different "
                                 "table shapes")
        self.o = first.options
        self.m, self.C, self.L = first.m, first.C, first.L
        self.d, self.n, self.ds = first.head_dim, first.n_tokens, first.ds
        h = len(indexes)
        self.cent = torch.as_tensor(np.stack([ix._centroids for ix in indexes]),
                                    dtype=torch.float32, device=device)  # [H, m, C, ds]
        ids = np.stack([ix._ids for ix in indexes]).reshape(h * self.m * self.C, self.L)
        self.ids = torch.as_tensor(ids.astype(np.int64), device=device)
        sc = np.stack([ix._scores for ix in indexes]).reshape(h * self.m * self.C, self.L)
        self.scores = torch.as_tensor(sc, dtype=torch.float32, device=device)
        if self.o.impute_tail_mean:
            miss = np.stack([ix._tail_mean for ix in indexes])
        elif self.o.impute_min:
            miss = np.stack([ix._list_min for ix in indexes])
        else:
            miss = np.zeros((h, self.m, self.C), dtype=np.float32)
        self.missing = torch.as_tensor(np.asarray(miss, dtype=np.float32),
                                       device=device).reshape(-1)
        self.last: Optional[torch.Tensor] = None  # the last search's selection [H, G, n]
        self.since_search = 0


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


class TorchCsaSession:
    """Client-side csa selection for a whole context on a torch device.

    >>> arts = client.fetch_index(ctx.context_id, "csa")
    >>> sess = TorchCsaSession(arts, n_q_heads=ctx.model.n_q_heads, device="cuda")
    >>> plan = sess.step(layer, q)          # q: [n_q_heads, d] post-RoPE queries
    >>> plan.page_ids(0)                    # kv head 0's pages, ascending
    """

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 device: Any = "cpu") -> None:
        # The exact session parses and checks the artifacts and params (one
        # code path for both); this class keeps only its indexes' tables.
        exact = CsaSession(artifacts, n_q_heads=n_q_heads, params=params)
        self.params = exact.params
        self.n_layers, self.n_kv_heads = exact.n_layers, exact.n_kv_heads
        self.n_q_heads, self.group_size = exact.n_q_heads, exact.group_size
        indexes = exact.indexes
        self.device = torch.device(device)
        self.layers = [_Layer([indexes[(l, h)] for h in range(self.n_kv_heads)], self.device)
                       for l in range(self.n_layers)]
        self.n_tokens, self.head_dim = self.layers[0].n, self.layers[0].d
        b = self.params.page_size
        self.n_pages = (self.n_tokens + b - 1) // b

    def reset(self) -> None:
        """Forgets the search schedules (``period`` > 1)."""
        for lay in self.layers:
            lay.last, lay.since_search = None, 0

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
        vals = lay.scores[lid] * wj.reshape(-1, 1) + bias.view(-1, 1)
        acc = torch.zeros(h * g, n, dtype=torch.float32, device=q.device)
        acc.scatter_add_(1, lay.ids[lid].view(h * g, -1), vals.view(h * g, -1))
        n_sinks = min(o.sinks, n)
        recent_start = max(n_sinks, n - o.recent)
        forced = torch.zeros(n, dtype=torch.bool, device=q.device)
        forced[:n_sinks] = True
        forced[recent_start:] = True
        n_forced = n_sinks + (n - recent_start)
        ranked = torch.where(forced, torch.full_like(acc, math.inf), acc)
        sel = _top_k_mask(ranked, max(k, n_forced))
        if o.norm_weights or o.proj_weights:
            to_logit = torch.full((h * g, 1), 1.0 / math.sqrt(lay.d), device=q.device)
        else:
            to_logit = (norms.sum(dim=-1) / m).view(h * g, 1) / math.sqrt(lay.d)
        return sel.view(h, g, n), (acc * to_logit).view(h, g, n)

    # ------------------------------------------------------------ stages 2-4
    def by_page(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., n_pages, page_size], zero/False padded."""
        b = self.params.page_size
        pad = self.n_pages * b - x.shape[-1]
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.view(*x.shape[:-1], self.n_pages, b)

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
            keep[0] = True
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
            raise ValueError("csa: queries have NaN/Inf")
        lay = self.layers[layer]
        p = self.params
        period = lay.o.period
        if period > 1 and lay.last is not None and 0 < lay.since_search < period:
            sel, logits = lay.last, None  # reused: pages ranked by count, like the core
            lay.since_search += 1
        else:
            sel, logits = self._search(lay, q, p.token_budget(self.n_tokens))
            if period > 1:
                lay.last, lay.since_search = sel, 1
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
            sub_of = torch.arange(g, device=q.device) // sg
            tok = tables[:, sub_of].unsqueeze(-1).expand(-1, -1, -1, p.page_size)
            mask = tok.reshape(h, g, -1)[:, :, :self.n_tokens]
        return LayerPlan(token_mask=mask, table_pages=tables, pages=tables.any(dim=1),
                         selected=sel)
