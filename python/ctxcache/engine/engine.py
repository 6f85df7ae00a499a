"""Batched decode over stored contexts: the sequences' own tokens and the
step's order of work (plan, resolve, attend).

:class:`ContextDecoder` is what a model adapter calls once per layer of a
decode step, for B sequences that read the same context: they share its
host tier, HBM pool and planner index, and each owns its appended tokens.
:class:`DenseDecoder` is the same seam over the whole context resident on
the device (the baseline). :class:`BatchDecoder` puts decoders of several
contexts in one batch (rows in order: the first decoder's sequences, then
the next's). None touches the network or syncs the host inside a step, so
a model's whole step can be captured as one CUDA graph.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ctxcache.engine.attention import DenseContextAttention, PagedAttention, UnionAttention
from ctxcache.engine.planner import QuestPlanner
from ctxcache.engine.pool import HostTier, PagePool, PoolOptions

__all__ = ["BatchDecoder", "ContextDecoder", "DenseDecoder", "EngineOptions", "OwnTokens"]


@dataclass
class EngineOptions:
    # Budget: the pages a kv head attends per step, as a fraction of the
    # context's pages (the session core's rho / page_fraction). Default: 0.05.
    rho: float = 0.05
    # Recent pages forced besides page 0 (the core's recent_blocks). Default: 1.
    recent_blocks: int = 1
    # The HBM pool's share of the context's units (pool.PoolOptions). Default: 0.1.
    pool_fraction: float = 0.1
    # Slots of the pool; 0 = by pool_fraction. Default: 0.
    pool_slots: int = 0
    # The planner's top-k algorithm (kernels.select_top_pages). Default: ""
    # = that module's default.
    select_algo: str = ""
    # Search period P: the planner runs on every P-th step and the P - 1
    # steps after it attend the same stored pages (plus their own tokens,
    # which always grow), with no planning and no pool traffic: the
    # session core's "search every P steps" schedules (index/csa.h). The
    # pool then holds a planning step's pages of all layers until the next
    # one. Default: 1 (plan every step).
    period: int = 1
    # With a period above 1 (and per-sequence pages): the step before each
    # planning step plans the next pages from its own queries, and the pool
    # resolves them on a side stream while the step's later layers run, so
    # their copies over PCIe overlap the step's compute; the steps after
    # attend those pages with no planning at all. Each plan is then one
    # step older when used (1..P steps instead of 0..P-1), and the pool
    # holds two plans' pages. Step 0 (and the first step after a capture)
    # plans in line. Default: True.
    lookahead: bool = True
    # CUDA: the planner's page cap as one counting kernel
    # (QuestPlanner.fused_cap; the same pages as the scatter and top-k).
    # Default: True.
    fused_cap: bool = True
    # How a kv head ranks pages for its budget (QuestPlanner.rank; the
    # session core's page_rank): "votes" or "max". Default: "votes".
    rank: str = "votes"
    # Floor of the token and page budgets in tokens (the core's min_budget):
    # short contexts keep at least this many tokens' pages. Default: 0.
    min_budget: int = 0
    # When the pool has a slot for every page of the context (pool_fraction
    # 1, or a large batch's working set), load them all before the first
    # step (PagePool.preload): no step then misses. Default: True.
    preload: bool = True
    # Batch union: > 0 makes the whole batch attend one table per kv head of
    # this fraction of the context's pages (plus page 0 and the recent
    # pages), the pages with the largest Quest bound over every sequence's
    # queries and the group's heads (prefill.chunk_pages); each page is read
    # once per layer-step for all the sequences. 0: each sequence attends
    # its own rho of the pages. Default: 0.
    union_rho: float = 0.0

    def planner_options(self) -> Dict[str, Any]:
        """The QuestPlanner constructor's keyword arguments these options set."""
        return dict(rho=self.rho, recent_blocks=self.recent_blocks, select_algo=self.select_algo,
                    fused_cap=self.fused_cap, rank=self.rank, union_rho=self.union_rho,
                    min_budget=self.min_budget)


class OwnTokens:
    """Each sequence's appended K and V per layer: [n_layers, B, H, T, d], and
    how many each holds (int32 [B] on the device). Row t of sequence b holds
    the post-RoPE K/V of the token fed at its step t;
    :meth:`ctxcache.engine.WriteBack.append_own` stores rows on the server.
    With ``n_q_heads`` > 0 it also keeps their post-RoPE queries ``q``
    [n_layers, B, Hq, T, d] (what a query-centric index such as csa needs
    when the rows are stored); otherwise ``q`` is None."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_tokens: int,
                 head_dim: int, dtype: torch.dtype, device: Any, n_q_heads: int = 0) -> None:
        shape = (n_layers, batch, n_kv_heads, max_tokens, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.q: Optional[torch.Tensor] = None
        if n_q_heads > 0:
            self.q = torch.zeros((n_layers, batch, n_q_heads, max_tokens, head_dim),
                                 dtype=dtype, device=device)
        self.length = torch.zeros(batch, dtype=torch.int32, device=device)
        self._now = torch.zeros(batch, dtype=torch.int32, device=device)
        self._b = torch.arange(batch, device=device)
        self.max_tokens = max_tokens

    def begin_step(self) -> None:
        """Before a step's layers: each sequence takes one more token."""
        torch.add(self.length, 1, out=self._now)

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor,
            q: Optional[torch.Tensor] = None) -> None:
        """The step's K, V [B, H, d] (and q [B, Hq, d] when queries are kept)
        at each sequence's next position."""
        pos = self.length.long()
        self.k[layer][self._b, :, pos] = k
        self.v[layer][self._b, :, pos] = v
        if self.q is not None and q is not None:
            self.q[layer][self._b, :, pos] = q

    def end_step(self) -> None:
        self.length.add_(1)

    def reset(self) -> None:
        self.length.zero_()

    @property
    def now(self) -> torch.Tensor:
        """Tokens each sequence attends of its own during the current step."""
        return self._now

    @property
    def nbytes(self) -> int:
        q = 0 if self.q is None else self.q.numel() * self.q.element_size()
        return 2 * self.k.numel() * self.k.element_size() + q


class _Decoder:
    """The seam a model adapter calls: begin_step, attend per layer (the
    step's k and v join each sequence's own tokens first), end_step.
    Subclasses set ``own`` and implement ``_attend``."""

    own: OwnTokens

    def begin_step(self) -> None:
        self.own.begin_step()

    def end_step(self) -> None:
        self.own.end_step()

    def reset(self) -> None:
        """Forgets every sequence's own tokens (a new batch of sequences)."""
        self.own.reset()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, d], the step's k, v [B, H, d] -> [B, Hq, d]."""
        self.own.put(layer, k, v, q)
        return self._attend(layer, q)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ContextDecoder(_Decoder):
    """B sequences decoding over one stored context through the engine: per
    layer, the planner picks pages from the queries, the pool makes them
    resident (misses copied from the host tier on the device), attention
    reads them in place with the sequence's own tokens."""

    def __init__(self, tier: HostTier, device: Any, n_q_heads: int, batch: int,
                 max_new_tokens: int, options: Optional[EngineOptions] = None,
                 planner: Optional[QuestPlanner] = None, keep_queries: bool = False) -> None:
        """keep_queries: the own tokens keep their queries too (OwnTokens.q),
        for a write-back to contexts with query-centric indexes. Default: False."""
        o = options or EngineOptions()
        if o.period < 1:
            raise ValueError(f"EngineOptions.period: expected >= 1, got {o.period}")
        self.tier, self.device, self.batch = tier, torch.device(device), batch
        self.period = o.period
        # Whether the current step plans (the model adapter sets it from its
        # step counter: steps 0, P, 2P, ... plan; with lookahead, step 0
        # only), and whether it plans the next steps' pages after attending
        # (lookahead: steps P - 1, 2P - 1, ...).
        self.planning = True
        self.prefetching = False
        if planner is None and tier.present is not None:
            raise ValueError("ContextDecoder: a tier filled on demand holds no keys to plan "
                             "from; pass planner=QuestPlanner.from_index(...) (the stored "
                             "Quest index)")
        self.planner = planner or QuestPlanner.from_tier(tier, device, n_q_heads, batch,
                                                         **o.planner_options())
        kp = self.planner.kp
        self.union_kp = self.planner.union_kp
        self.lookahead = bool(o.lookahead and o.period > 1 and not self.union_kp)
        # The pool holds at least one step's pages of every layer: otherwise
        # pages used every step are evicted before their next use (CLOCK, like
        # LRU, gets no hits on a cyclic sweep larger than the cache), and a
        # period > 1 could not keep its planning step's pages.
        need = (tier.n_layers * tier.n_kv_heads * self.union_kp if self.union_kp
                else self.planner.step_units())
        if self.lookahead:
            need *= 2  # the plan in use and the next one
        if o.pool_slots and o.period > 1 and o.pool_slots < min(need, tier.n_units):
            raise ValueError(f"EngineOptions.pool_slots: {o.pool_slots} cannot hold "
                             f"{'two plans' if self.lookahead else 'one step'}'s pages with "
                             f"period {o.period}: expected >= {min(need, tier.n_units)} "
                             f"(or 0 to size it)")
        self.pool = PagePool(tier, device,
                             PoolOptions(n_slots=o.pool_slots, fraction=o.pool_fraction,
                                         min_slots=0 if o.pool_slots else need),
                             max_requests=tier.n_kv_heads * (self.union_kp or batch * kp))
        # With a tier that fills on demand, the preload waits for it to complete
        # (on_tier_complete).
        self._preload = o.preload
        if o.preload and tier.present is None:
            self.pool.preload()
        self.own = OwnTokens(tier.n_layers, batch, tier.n_kv_heads, max_new_tokens,
                             tier.head_dim, tier.dtype, device,
                             n_q_heads if keep_queries else 0)
        # Lookahead: each layer's queries of the step before a planning step
        # (what the side stream plans from), and that stream.
        self._q_next: Optional[torch.Tensor] = None
        self._side: Any = None
        if self.lookahead and self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)
        # Per-sequence tables, or the batch union (then no per-sequence buffers).
        self.attention = None if self.union_kp else PagedAttention(self.pool, batch,
                                                                   n_q_heads, kp)
        self.union_attention = (UnionAttention(self.pool, self.union_kp, keep=o.period > 1)
                                if self.union_kp else None)

    def begin_step(self) -> None:
        super().begin_step()
        if self.planning and self.period > 1:
            self.pool.hold()
        elif self.prefetching:
            self.pool.hold_next()

    def end_step(self) -> None:
        if self.prefetching and self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        super().end_step()

    def on_tier_complete(self) -> None:
        """Call once an on-demand tier has become complete (between steps): a
        pool with a slot for every unit then preloads them (EngineOptions.preload)."""
        if self._preload and self.tier.present is None:
            self.pool.preload()

    def _resolve(self, layer: int, pages: torch.Tensor) -> None:
        if self.tier.present is not None:
            # An on-demand tier: the planned units are fetched into it first
            # (a host sync and fetch_pages_into calls: steps before the tier is
            # complete run eagerly, not as CUDA graphs).
            self.tier.fill(self.pool.units(layer, pages))
        self.pool.resolve(layer, pages)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self.union_attention is not None:
            pages = self.planner.union_pages[layer]
            if self.planning:
                self.planner.plan_union(layer, q)
                self._resolve(layer, pages.unsqueeze(0))
            return self.union_attention(layer, q, pages, self.own.k[layer], self.own.v[layer],
                                        self.own.now, refresh=self.planning)
        if self.planning:
            pages = self.planner.plan(layer, q)
            self._resolve(layer, pages)
        else:
            pages = self.planner.pages[layer]
        out = self.attention(layer, q, pages, self.own.k[layer], self.own.v[layer],
                             self.own.now)
        if self.prefetching:
            self._plan_next(layer, q)
        return out

    def _plan_next(self, layer: int, q: torch.Tensor) -> None:
        """Lookahead: plans the layer's next pages from this step's queries
        and resolves them, on the side stream (after this layer's attention,
        which read the plan being replaced; the step's end waits for it).
        The pool's two windows keep the current plan resident meanwhile."""
        if self._q_next is None:  # at the first (eager) step, before any capture
            self._q_next = torch.zeros((self.tier.n_layers,) + tuple(q.shape), dtype=q.dtype,
                                       device=q.device)
        self._q_next[layer].copy_(q)
        side = contextlib.nullcontext()
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            side = torch.cuda.stream(self._side)
        with side:
            self._resolve(layer, self.planner.plan(layer, self._q_next[layer]))

    def memory(self) -> Dict[str, int]:
        """Device bytes by part: pool, planner index, own tokens."""
        out = {"pool": self.pool.hbm_bytes, "index": self.planner.hbm_bytes,
               "own": self.own.nbytes}
        if self.union_attention is not None and self.union_attention.hbm_bytes:
            out["union_tables"] = self.union_attention.hbm_bytes
        return out


class DenseDecoder(_Decoder):
    """The same seam over the whole context resident on the device.
    shared=False: each sequence reads the context as if it held its own copy
    (what a server without prefix sharing does; DenseContextAttention)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, batch: int, max_new_tokens: int,
                 shared: bool = True, n_q_heads_kept: int = 0) -> None:
        """n_q_heads_kept: > 0 makes the own tokens keep their queries (that
        many q heads; OwnTokens.q). Default: 0."""
        self.attention = DenseContextAttention(k, v, shared=shared)
        self.own = OwnTokens(k.shape[0], batch, k.shape[1], max_new_tokens, k.shape[3],
                             k.dtype, k.device, n_q_heads_kept)
        self.batch = batch

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.attention(layer, q, self.own.k[layer], self.own.v[layer], self.own.now)

    def memory(self) -> Dict[str, int]:
        """Device bytes: the context (B copies' worth when not shared), own tokens."""
        a = self.attention
        ctx = 2 * a.k.numel() * a.k.element_size() * (1 if a.shared else self.batch)
        return {"context": ctx, "own": self.own.nbytes}


class BatchDecoder:
    """One batch over several contexts: ``decoders`` (ContextDecoder or
    DenseDecoder, each over its own context with its own batch) take
    consecutive rows of the batch, in order. A model adapter sees one decoder
    of batch sum(d.batch); each context keeps its own pool and index, shared
    by its rows only. The decoders' search periods must agree."""

    def __init__(self, decoders: List[Any]) -> None:
        if not decoders:
            raise ValueError("BatchDecoder: expected at least one decoder")
        periods = {int(getattr(d, "period", 1)) for d in decoders}
        if len(periods) != 1:
            raise ValueError(f"BatchDecoder: the decoders' periods differ: {sorted(periods)}")
        looks = {bool(getattr(d, "lookahead", False)) for d in decoders}
        if len(looks) != 1:
            raise ValueError("BatchDecoder: the decoders' lookahead differs (a batch union "
                             "or a period of 1 has none)")
        self.decoders = list(decoders)
        self.period = periods.pop()
        self.lookahead = looks.pop()
        self.batch = sum(d.batch for d in decoders)
        self._bounds = []
        start = 0
        for d in decoders:
            self._bounds.append((start, start + d.batch))
            start += d.batch

    @property
    def planning(self) -> bool:
        return bool(getattr(self.decoders[0], "planning", True))

    @planning.setter
    def planning(self, value: bool) -> None:
        for d in self.decoders:
            d.planning = value

    @property
    def prefetching(self) -> bool:
        return bool(getattr(self.decoders[0], "prefetching", False))

    @prefetching.setter
    def prefetching(self, value: bool) -> None:
        for d in self.decoders:
            d.prefetching = value

    def begin_step(self) -> None:
        for d in self.decoders:
            d.begin_step()

    def end_step(self) -> None:
        for d in self.decoders:
            d.end_step()

    def reset(self) -> None:
        for d in self.decoders:
            d.reset()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, d], k, v [B, H, d] with B = sum of the decoders' batches."""
        if q.shape[0] != self.batch:
            raise ValueError(f"BatchDecoder.attend: batch {q.shape[0]}, expected {self.batch}")
        return torch.cat([d.attend(layer, q[a:b], k[a:b], v[a:b])
                          for d, (a, b) in zip(self.decoders, self._bounds)])

    def memory(self) -> Dict[str, int]:
        """Device bytes by part, summed over the decoders."""
        out: Dict[str, int] = {}
        for d in self.decoders:
            for key, val in d.memory().items():
                out[key] = out.get(key, 0) + val
        return out
