"""The planner of the GPU engine: which pages each (sequence, kv head) attends
at a layer-step.

:class:`QuestPlanner` follows the session core (index/quest.h, then the
page cap of session/session_params.h) with fixed shapes, so that a step needs
no host sync:
  1. per q head, the Quest bound U(page) = sum_j max(q_j min_j, q_j max_j)
     of every page, and its top ``k_head`` pages (ties: the lower page);
     k_head = max(1, token_budget // page), the pages QuestSelector takes
     when the context is whole pages;
  2. per kv head, the pages ranked by how many of its q heads took them
     (ties: the later page), the top ``page_budget`` kept (the core's
     CapSelectedPages ranking for selections without logits), plus page 0
     and the last ``recent_blocks + 1`` pages, which the core keeps beyond
     the budget: ``kp = page_budget + recent_blocks + 2`` pages a row. On
     CUDA one kernel a layer counts the picks and takes the cap from a
     histogram of the counts (the threshold count, then the latest pages
     of that count), with no second top-k.
When the union of step 1 holds fewer than kp pages the core keeps only
those; the planner fills the rest with pages no q head took (the latest
ones), a superset: attention over more pages, never fewer.

Its index is the context's Quest bounds, min and max of the keys per page
and dim, 2 * head_dim values per page of 16 tokens: 6.25% of the KV bytes
in bf16. Either computed on the device from the loaded keys
(:meth:`QuestPlanner.from_tier`), or read from the stored Quest artifacts
(:meth:`QuestPlanner.from_index`: float bounds of bf16 keys, so the bf16
bounds are the same bits, which tests check), which needs no key loaded.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Tuple

import torch

from ctxcache.engine.pool import HostTier

__all__ = ["QuestPlanner", "chunk_pages", "chunk_scores", "decode_pages", "head_scores",
           "page_budget", "page_cap", "quest_bounds", "token_budget", "warm_decode_pages"]


def page_budget(rho: float, n_pages: int, page: int = 16, min_budget: int = 0) -> int:
    """The session core's page budget (index::PageBudget): max(1,
    ceil(rho * n_pages), ceil(min_budget / page)), at most n_pages."""
    floor_pages = -(-max(0, min_budget) // page)
    return max(1, min(n_pages, max(int(math.ceil(rho * n_pages)), floor_pages)))


def token_budget(rho: float, n_tokens: int, min_budget: int = 0) -> int:
    """The session core's token budget per q head (SessionParams::TokenBudget
    without ``budget``): max(ceil(rho * n), min_budget), in [1, n]."""
    return max(1, min(max(n_tokens, 1), max(int(math.ceil(rho * n_tokens)), min_budget)))


def page_cap(rho: float, n_pages: int, recent_blocks: int, page: int = 16,
             min_budget: int = 0) -> Tuple[int, int]:
    """(n_recent, kp): the last pages forced besides page 0 (recent_blocks + 1,
    as the session core keeps), and the pages a table holds: the core's page
    budget (:func:`page_budget`) plus page 0 and those, at most all."""
    n_recent = min(n_pages, recent_blocks + 1)
    budget = page_budget(rho, n_pages, page, min_budget)
    return n_recent, min(n_pages, budget + n_recent + 1)


def _bounds_like(tier: HostTier, device: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    shape = (tier.n_layers, tier.n_kv_heads, tier.n_pages, tier.head_dim)
    dev = torch.device(device)
    return (torch.empty(shape, dtype=tier.dtype, device=dev),
            torch.empty(shape, dtype=tier.dtype, device=dev))


def _copy_quest_layer(index: Any, layer: int, tier: HostTier, kmin: torch.Tensor,
                      kmax: torch.Tensor) -> None:
    """One layer's stored Quest artifacts (``index.view(layer, h)``, read in
    place: header and size checked by artifacts.quest_layout) into
    kmin/kmax[layer] (QuestPlanner.from_index's checks)."""
    import warnings

    from ctxcache.torch.artifacts import quest_layout
    p, d = tier.n_pages, tier.head_dim
    for h in range(tier.n_kv_heads):
        view = index.view(layer, h)
        where = f"quest index (layer {layer}, kv head {h})"
        if view is None:
            raise ValueError(f"{where}: missing; the context needs a 'quest' index "
                             "(ingest or build it with indexes including 'quest')")
        try:
            lay = quest_layout(view)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if (lay.n_tokens, lay.head_dim, lay.page_size) != (tier.n_tokens, d, tier.page):
            raise ValueError(f"{where}: n_tokens {lay.n_tokens}, head_dim {lay.head_dim}, "
                             f"page {lay.page_size}; expected the tier's {tier.n_tokens}, {d}, "
                             f"{tier.page}")
        dtype = torch.bfloat16 if lay.item == 2 else torch.float32
        with warnings.catch_warnings():  # read-only buffer: only read here
            warnings.simplefilter("ignore")
            src = torch.frombuffer(view, dtype=dtype, count=2 * p * d, offset=32).view(2, p, d)
        kmin[layer, h].copy_(src[0])  # to the device, then narrowed (version 1)
        kmax[layer, h].copy_(src[1])


class _IndexLoad:
    """QuestPlanner.from_server_index's background load: a thread fetches the
    layers in order, ``streams`` in flight (one FetchIndex call each), copies
    each into the bounds as it comes (on a CUDA stream of its own) and sets
    its event once the copies are complete on the device."""

    def __init__(self, client: Any, context_id: str, tier: HostTier, kmin: torch.Tensor,
                 kmax: torch.Tensor, streams: int) -> None:
        self._t0 = time.perf_counter()
        self.seconds = 0.0  # from the start to the last layer's bounds (once loaded)
        self._ready = [threading.Event() for _ in range(tier.n_layers)]
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._run, args=(client, context_id, tier, kmin, kmax, max(1, streams)),
            name="ctxcache-index-load", daemon=True)
        self._thread.start()

    def _run(self, client: Any, context_id: str, tier: HostTier, kmin: torch.Tensor,
             kmax: torch.Tensor, streams: int) -> None:
        try:
            with ThreadPoolExecutor(streams) as pool:
                futures = [pool.submit(client.open_index, context_id, "quest", [layer])
                           for layer in range(tier.n_layers)]
                try:
                    # The copies on a stream of their own: on the decoder's,
                    # the first step's kernels would queue behind them.
                    side = torch.cuda.Stream(kmin.device) if kmin.is_cuda else None
                    for layer, f in enumerate(futures):
                        with f.result() as index:
                            if side is None:
                                _copy_quest_layer(index, layer, tier, kmin, kmax)
                            else:
                                with torch.cuda.stream(side):
                                    _copy_quest_layer(index, layer, tier, kmin, kmax)
                                side.synchronize()  # complete before a reader on any stream
                        if layer == tier.n_layers - 1:
                            self.seconds = time.perf_counter() - self._t0
                        self._ready[layer].set()
                finally:
                    for f in futures:
                        f.cancel()
        except BaseException as e:  # noqa: BLE001 (handed to the waiting planner)
            self._error = e
        finally:
            for ev in self._ready:
                ev.set()

    def wait(self, layer: Optional[int]) -> None:
        if layer is None:
            self._thread.join()
        else:
            self._ready[layer].wait()
        if self._error is not None:
            raise self._error


def quest_bounds(keys: torch.Tensor, n_tokens: int, page: int) -> tuple:
    """Per-page min and max of ``keys`` [..., n_pages * page, d] over the first
    ``n_tokens`` tokens: ([..., n_pages, d], same), keys' dtype."""
    *lead, n_pad, d = keys.shape
    n_pages = n_pad // page
    kp = keys.reshape(*lead, n_pages, page, d)
    if n_tokens == n_pad:
        return kp.amin(dim=-2), kp.amax(dim=-2)
    valid = (torch.arange(n_pad, device=keys.device) < n_tokens).view(n_pages, page, 1)
    big = torch.finfo(keys.dtype).max
    mn = torch.where(valid, kp, torch.full((), big, dtype=keys.dtype, device=keys.device))
    mx = torch.where(valid, kp, torch.full((), -big, dtype=keys.dtype, device=keys.device))
    return mn.amin(dim=-2), mx.amax(dim=-2)


class QuestPlanner:
    """Fixed-shape Quest page plans for B sequences over one context (module
    docstring). ``plan(layer, ...)`` writes ``pages[layer]``, which holds that
    layer's last plan until the next (a decoder that searches every P steps
    reuses it): one call at a time."""

    def __init__(self, kmin: torch.Tensor, kmax: torch.Tensor, n_tokens: int, n_q_heads: int,
                 batch: int, page: int = 16, rho: float = 0.05, recent_blocks: int = 1,
                 select_algo: str = "", fused_cap: bool = True, rank: str = "votes",
                 union_rho: float = 0.0, min_budget: int = 0) -> None:
        """kmin/kmax [n_layers, n_kv_heads, n_pages, d] on the engine's device;
        select_algo: kernels.select_top_pages's algorithm (Default: "" = its
        default); fused_cap: on CUDA, step 2 is one kernel that counts the q
        heads' picks and takes the cap by a histogram of the counts, instead
        of a scatter and a second top-k (Default: True; the same pages);
        rank: the core's ``page_rank``: "votes" (per q head top pages, a kv
        head's pages ranked by how many of its heads took them) or "max"
        (the same per-head pages, ranked by the largest bound any of its q
        heads gives) (Default: "votes"); union_rho: > 0 also keeps a
        batch-union table of that fraction of the pages per kv head
        (:meth:`plan_union`) (Default: 0); min_budget: the core's
        ``min_budget``, a floor in tokens of the token and page budgets
        (Default: 0)."""
        if rank not in ("votes", "max"):
            raise ValueError(f"rank: expected 'votes' or 'max', got {rank!r}")
        self.rank = rank
        if kmin.shape != kmax.shape or kmin.dim() != 4:
            raise ValueError("QuestPlanner: kmin and kmax must both be [L, H, P, d]")
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"rho: expected in (0, 1], got {rho}")
        self.kmin, self.kmax = kmin, kmax
        # Bounds loading in the background (from_server_index), or None.
        self.index_load: Optional[_IndexLoad] = None
        self.index_wait_s = 0.0  # seconds planning waited for it (wait_index)
        self.n_layers, self.h, self.n_pages, self.d = kmin.shape
        if n_q_heads % self.h:
            raise ValueError(f"n_q_heads {n_q_heads} is not a multiple of n_kv_heads {self.h}")
        self.g, self.batch, self.page, self.n_tokens = n_q_heads // self.h, batch, page, n_tokens
        self.select_algo, self.fused_cap, self.rho = select_algo, fused_cap, rho
        if min_budget < 0:
            raise ValueError(f"min_budget: expected >= 0 tokens, got {min_budget}")
        self.min_budget = min_budget
        budget = token_budget(rho, n_tokens, min_budget)
        self.k_head = min(self.n_pages, max(1, budget // page))
        # The core's page budget, plus the pages it keeps beyond it.
        self.page_budget = page_budget(rho, self.n_pages, page, min_budget)
        self.n_recent, self.kp = page_cap(rho, self.n_pages, recent_blocks, page, min_budget)
        dev = kmin.device
        # Per-sequence tables, unless the planner keeps the batch union only.
        self.per_sequence = not union_rho
        if self.per_sequence:
            self._alloc_rows(batch, n_q_heads, rank, dev)
        self.union_kp = 0
        if union_rho:
            if not 0.0 < union_rho <= 1.0:
                raise ValueError(f"union_rho: expected in (0, 1] (or 0: off), got {union_rho}")
            self.union_kp = page_cap(union_rho, self.n_pages, recent_blocks)[1]
            # The last union table of each layer: [L, H, union_kp], sorted.
            self.union_pages = torch.zeros(self.n_layers, self.h, self.union_kp,
                                           dtype=torch.int32, device=dev)
            self._union_scores = torch.empty(self.h, self.n_pages, dtype=torch.float32,
                                             device=dev)
            self._union_top = torch.empty(self.h, self.union_kp, dtype=torch.int64, device=dev)

    def _alloc_rows(self, batch: int, n_q_heads: int, rank: str, dev: Any) -> None:
        # The last plan of each layer: [L, B, H, kp].
        self.pages = torch.zeros(self.n_layers, batch, self.h, self.kp, dtype=torch.int32,
                                 device=dev)
        # Column 0 of each q head's row is a stand-in for "no page": the top-k
        # kernel always takes a row's first entry, which must not be page 0.
        self._scores = torch.zeros(batch * n_q_heads, self.n_pages + 1, dtype=torch.float32,
                                   device=dev)
        # One bin per (kv row, page), and a last one that the stand-ins go to.
        self._counts = torch.zeros(batch * self.h * self.n_pages + 1, dtype=torch.float32,
                                   device=dev)
        # Ties of equal counts go to the later page: a fraction below 1 / G.
        p = torch.arange(self.n_pages, device=dev, dtype=torch.float32)
        self._later = (0.5 * (p + 1) / (self.n_pages + 1)).view(1, self.n_pages)
        self._cap = torch.zeros(batch * self.h, self.n_pages, dtype=torch.float32, device=dev)
        rows = torch.arange(batch * n_q_heads, device=dev, dtype=torch.int64)
        self._kv_base = ((rows // self.g) * self.n_pages).view(-1, 1)
        self._row_base = (torch.arange(batch * self.h, device=dev, dtype=torch.int64)
                          * self.n_pages).view(-1, 1)
        self._ones = torch.ones(batch * n_q_heads * (self.k_head + 1), dtype=torch.float32,
                                device=dev)
        self._head_top = torch.zeros(batch * n_q_heads, self.k_head + 1, dtype=torch.int64,
                                     device=dev)
        self._trash = batch * self.h * self.n_pages
        self._top = torch.zeros(batch * self.h, self.kp, dtype=torch.int64, device=dev)
        self._icounts = torch.zeros(batch * self.h, self.n_pages, dtype=torch.int32, device=dev)
        if rank == "max":
            self._picked = torch.empty_like(self._scores)

    @classmethod
    def from_tier(cls, tier: HostTier, device: Any, n_q_heads: int, batch: int,
                  rho: float = 0.05, recent_blocks: int = 1,
                  layers: Optional[range] = None, select_algo: str = "",
                  fused_cap: bool = True, rank: str = "votes",
                  union_rho: float = 0.0, min_budget: int = 0) -> "QuestPlanner":
        """Bounds from the tier's keys, one layer at a time through the device
        (waits for each layer of a background load)."""
        dev = torch.device(device)
        kmin, kmax = _bounds_like(tier, dev)
        for layer in layers or range(tier.n_layers):
            if tier.load is not None:
                tier.load.wait_layer(layer)
            mn, mx = quest_bounds(tier.k[layer].to(dev, non_blocking=True), tier.n_tokens,
                                  tier.page)
            kmin[layer].copy_(mn)
            kmax[layer].copy_(mx)
        return cls(kmin, kmax, tier.n_tokens, n_q_heads, batch, tier.page, rho, recent_blocks,
                   select_algo, fused_cap, rank, union_rho, min_budget)

    @classmethod
    def from_index(cls, index: Any, tier: HostTier, device: Any, n_q_heads: int, batch: int,
                   **options: Any) -> "QuestPlanner":
        """Bounds from the context's stored Quest artifacts (``index``: a
        :class:`ctxcache.native.IndexArtifacts` of method "quest", or any
        object whose ``view(layer, kv_head)`` gives a ``QST1`` artifact,
        docs/storage-format.md), converted to the tier's dtype; no key is
        read. ``options``: the constructor's (rho, rank, ...). ValueError
        when an artifact is missing, malformed, or of another page size,
        token count or head_dim than the tier's."""
        kmin, kmax = _bounds_like(tier, device)
        for layer in range(tier.n_layers):
            _copy_quest_layer(index, layer, tier, kmin, kmax)
        return cls(kmin, kmax, tier.n_tokens, n_q_heads, batch, tier.page, **options)

    @classmethod
    def from_server_index(cls, client: Any, context_id: str, tier: HostTier, device: Any,
                          n_q_heads: int, batch: int, streams: int = 4,
                          **options: Any) -> "QuestPlanner":
        """:meth:`from_index` with the artifacts fetched in the background,
        layer by layer in order (``streams`` layers in flight, through
        ``client``, a :class:`ctxcache.native.NativeClient`): returns at once,
        and planning a layer waits for that layer's bounds only, so a first
        step overlaps the rest of the index. :meth:`wait_index` waits for
        all (and raises what the load raised)."""
        kmin, kmax = _bounds_like(tier, device)
        planner = cls(kmin, kmax, tier.n_tokens, n_q_heads, batch, tier.page, **options)
        planner.index_load = _IndexLoad(client, context_id, tier, kmin, kmax, streams)
        return planner

    def wait_index(self, layer: Optional[int] = None) -> None:
        """Until ``layer``'s bounds (None: every layer's) are on the device,
        when they are loading in the background (:meth:`from_server_index`)."""
        if self.index_load is not None:
            t0 = time.perf_counter()
            self.index_load.wait(layer)
            self.index_wait_s += time.perf_counter() - t0
            if layer is None:
                self.index_load = None

    @property
    def hbm_bytes(self) -> int:
        """The index (the bounds) on the device."""
        return 2 * self.kmin.numel() * self.kmin.element_size()

    def step_units(self) -> int:
        """The most distinct units (page of a layer's kv head) one step's plans
        can name over all layers, however the B sequences choose."""
        return self.n_layers * self.h * min(self.batch * self.kp, self.n_pages)

    def scores(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Quest bounds of every page for q [B, Hq, d]: [B * Hq, P + 1] float32,
        page p in column p + 1."""
        self.wait_index(layer)
        return head_scores(q, self.kmin, self.kmax, layer, self._scores)

    def plan(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The pages of every (sequence, kv head): int32 [B, H, kp], each row's
        pages distinct (any order), a view of ``pages[layer]``. q [B, Hq, d]."""
        if not self.per_sequence:
            raise ValueError("plan: this planner keeps the batch union only (union_rho > 0); "
                             "use plan_union")
        self.wait_index(layer)
        if q.shape[0] != self.batch:
            raise ValueError(f"plan: batch {q.shape[0]}, planner made for {self.batch}")
        s = self.scores(layer, q)
        out = self.pages[layer]
        # Each q head's k_head best pages, plus the stand-in (column 0).
        top = self._top_k(s, self.k_head + 1, 0, self._head_top, self.select_algo)
        if self.rank == "max":
            # The core ranks the pages some q head took by the best bound
            # they got; pages no head took rank last (a superset's fill).
            local = top % (self.n_pages + 1)
            self._picked.fill_(-3.0e38)
            self._picked.scatter_(1, local, s.gather(1, local))
            best = self._picked.view(self.batch * self.h, self.g, self.n_pages + 1)[:, :, 1:]
            top = self._top_k(best.amax(dim=1), self.kp, self.n_recent, self._top,
                              self.select_algo)
            out.view(-1, self.kp).copy_(top - self._row_base)
            return out
        if s.is_cuda and self.fused_cap:
            from ctxcache.engine import _triton
            _triton.cap_pages(top, self._icounts, out.view(-1, self.kp), self.n_pages, self.kp,
                              self.n_recent, self.g)
            return out
        top = top % (self.n_pages + 1)
        kv = torch.where(top > 0, self._kv_base + top - 1,
                         torch.full_like(top, self._trash))
        self._counts.index_add_(0, kv.view(-1), self._ones)
        torch.add(self._counts[:-1].view(-1, self.n_pages), self._later, out=self._cap)
        self._counts.zero_()
        top = self._top_k(self._cap, self.kp, self.n_recent, self._top, self.select_algo)
        out.view(-1, self.kp).copy_(top - self._row_base)
        return out

    def plan_union(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The batch's one table per kv head: the ``union_kp`` pages with the
        largest bound over every sequence's queries and the group's heads
        (page 0 and the recent pages first; :func:`chunk_pages` with the
        batch as the chunk), sorted: int32 [H, union_kp], a view of
        ``union_pages[layer]``. q [B, Hq, d]."""
        if not self.union_kp:
            raise ValueError("plan_union: the planner was made with union_rho 0")
        self.wait_index(layer)
        top = chunk_pages(q, self.kmin[layer], self.kmax[layer], self.union_kp, self.n_recent,
                          self._union_scores, self._union_top)
        out = self.union_pages[layer]
        out.copy_(torch.sort(top, dim=1).values)
        return out

    @staticmethod
    def _top_k(x: torch.Tensor, k: int, n_recent: int, out: torch.Tensor,
               algo: str = "") -> torch.Tensor:
        """Global ids (row * P + page) of each row's k largest, page 0 and the
        last n_recent pages first (as kernels.select_top_pages), ties to the
        lower page."""
        rows, p = x.shape
        if x.is_cuda and p < 65536:
            from ctxcache.torch import kernels
            return kernels.select_top_pages(x, k, n_recent=n_recent, out=out, algo=algo)
        y = x.clone()
        y[:, 0] = float("inf")
        if n_recent:
            y[:, p - n_recent:] = float("inf")
        # Stable descending sort: ties keep the lower page first.
        order = torch.sort(-y, dim=1, stable=True).indices[:, :k]
        base = torch.arange(rows, device=x.device, dtype=torch.int64).view(-1, 1) * p
        out.copy_(order + base)
        return out


def chunk_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per kv head and stored page, the largest Quest bound over the chunk's
    queries and the group's q heads: float32 [H, P]. q [T, Hq, d]; kmin/kmax
    [H, P, d] (one layer)."""
    t, hq, d = q.shape
    h, p, _ = kmin.shape
    g = hq // h
    if out is None:
        out = torch.empty(h, p, dtype=torch.float32, device=q.device)
    if q.is_cuda:
        from ctxcache.engine import _triton
        _triton.quest_max_scores(q.contiguous(), kmin, kmax, out)
        return out
    qf = q.float().view(t, h, g, d).permute(1, 0, 2, 3).reshape(h, t * g, 1, d)
    mn, mx = kmin.float().unsqueeze(1), kmax.float().unsqueeze(1)      # [H, 1, P, d]
    step = max(1, (1 << 22) // max(1, p * d))
    for r in range(0, t * g, step):
        s = torch.maximum(qf[:, r:r + step] * mn, qf[:, r:r + step] * mx).sum(-1)
        m = s.amax(dim=1)
        out.copy_(m if r == 0 else torch.maximum(out, m))
    return out


def head_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, layer: int,
                out: torch.Tensor) -> torch.Tensor:
    """Quest bounds of every page of ``layer`` for each (sequence, q head):
    q [B, Hq, d], kmin/kmax [L, H, P, d], ``out`` float32 [B * Hq, P + 1],
    page p's bound in column p + 1 (column 0 is left to the caller). CUDA:
    one Triton kernel; otherwise torch in fp32. Returns ``out``."""
    if q.is_cuda:
        from ctxcache.engine import _triton
        _triton.quest_scores(q.contiguous(), kmin, kmax, layer, out)
        return out
    b, hq, d = q.shape
    h, p = kmin.shape[1], kmin.shape[2]
    qf = q.float().view(b, h, hq // h, 1, d)
    mn = kmin[layer].float().unsqueeze(1)  # [H, 1, P, d]
    mx = kmax[layer].float().unsqueeze(1)
    s = torch.maximum(qf * mn, qf * mx).sum(dim=-1)  # [B, H, G, P]
    out[:, 1:].copy_(s.reshape(-1, p))
    return out


def _row_pages(ids: torch.Tensor, p: int) -> torch.Tensor:
    """Global ids (row * p + page) of :meth:`QuestPlanner._top_k` -> pages."""
    base = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64).view(-1, 1) * p
    return ids - base


def decode_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, layer: int, kp: int,
                 n_recent: int) -> torch.Tensor:
    """The block-union tables of B one-token steps at once: int64 [B, H, kp],
    for each row b exactly :func:`chunk_pages` of the one query ``q[b:b+1]``
    (page 0 and the last n_recent pages, then the best by the largest bound
    any q head of the kv head's group gives; any order). q [B, Hq, d];
    kmin/kmax [L, H, P, d] (the layer taken by ``layer``)."""
    b, hq, d = q.shape
    _, h, p, _ = kmin.shape
    n = b
    if q.is_cuda:
        # Rows padded to a power of two: the kernels are compiled for a few
        # batch shapes (warm_decode_pages), not for every batch size.
        n = 1 << max(0, b - 1).bit_length()
        if n != b:
            q = torch.cat([q, q.new_zeros(n - b, hq, d)])
    full = head_scores(q, kmin, kmax, layer,
                       torch.empty(n * hq, p + 1, dtype=torch.float32, device=q.device))
    s = full[:, 1:].reshape(n, h, hq // h, p).amax(dim=2).reshape(n * h, p)
    top = torch.empty(n * h, kp, dtype=torch.int64, device=q.device)
    ids = QuestPlanner._top_k(s, kp, n_recent, top)
    return _row_pages(ids, p).view(n, h, kp)[:b]


def warm_decode_pages(device: Any, dtype: torch.dtype, n_q_heads: int, n_kv_heads: int,
                      head_dim: int, n_pages: int, kp: int, n_recent: int,
                      max_batch: int) -> int:
    """Runs :func:`decode_pages` once for every batch shape it uses up to
    ``max_batch`` rows (powers of two) over ``n_pages`` pages, so that a
    server compiles its kernels before its first request instead of in it.
    Returns the shapes run (0 off CUDA, where nothing is compiled)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (1, n_kv_heads, n_pages, head_dim)
    kmin = torch.randn(shape, generator=gen, device=dev).to(dtype)
    kmax = kmin + torch.rand(shape, generator=gen, device=dev).to(dtype)
    n, runs = 1, 0
    while True:
        q = torch.randn(n, n_q_heads, head_dim, generator=gen, device=dev).to(dtype)
        decode_pages(q, kmin, kmax, 0, min(kp, n_pages), min(n_recent, n_pages))
        runs += 1
        if n >= max_batch:
            return runs
        n *= 2


def chunk_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kp: int,
                n_recent: int, scores: Optional[torch.Tensor] = None,
                top: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The block-union table of a chunk: int64 [H, kp] page ids per kv head,
    page 0 and the last n_recent pages first, then the best by
    :func:`chunk_scores` (ties: the lower page); any order."""
    h, p, _ = kmin.shape
    s = chunk_scores(q, kmin, kmax, scores)
    if top is None:
        top = torch.empty(h, kp, dtype=torch.int64, device=q.device)
    return _row_pages(QuestPlanner._top_k(s, kp, n_recent, top), p)
