"""Batched decode over one stored context: the sequences' own tokens and the
step's order of work (plan, resolve, attend).

:class:`ContextDecoder` is what a model adapter calls once per layer of a
decode step, for B sequences that read the same context: they share its
host tier, HBM pool and planner index, and each owns its appended tokens.
:class:`DenseDecoder` is the same seam over the whole context resident on
the device (the baseline). Neither touches the network or syncs the host
inside a step, so a model's whole step can be captured as one CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ctxcache.engine.attention import DenseContextAttention, PagedAttention
from ctxcache.engine.planner import QuestPlanner
from ctxcache.engine.pool import HostTier, PagePool, PoolOptions

__all__ = ["ContextDecoder", "DenseDecoder", "EngineOptions", "OwnTokens"]


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


class OwnTokens:
    """Each sequence's appended K and V per layer: [n_layers, B, H, T, d], and
    how many each holds (int32 [B] on the device)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_tokens: int,
                 head_dim: int, dtype: torch.dtype, device: Any) -> None:
        shape = (n_layers, batch, n_kv_heads, max_tokens, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = torch.zeros(batch, dtype=torch.int32, device=device)
        self._now = torch.zeros(batch, dtype=torch.int32, device=device)
        self._b = torch.arange(batch, device=device)
        self.max_tokens = max_tokens

    def begin_step(self) -> None:
        """Before a step's layers: each sequence takes one more token."""
        torch.add(self.length, 1, out=self._now)

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K, V [B, H, d] at each sequence's next position."""
        pos = self.length.long()
        self.k[layer][self._b, :, pos] = k
        self.v[layer][self._b, :, pos] = v

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
        return 2 * self.k.numel() * self.k.element_size()


class _Decoder:
    """The seam a model adapter calls: begin_step, attend per layer (the
    step's k and v join each sequence's own tokens first), end_step.
    Subclasses set ``own`` and implement ``_attend``."""

    own: OwnTokens

    def begin_step(self) -> None:
        self.own.begin_step()

    def end_step(self) -> None:
        self.own.end_step()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, d], the step's k, v [B, H, d] -> [B, Hq, d]."""
        self.own.put(layer, k, v)
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
                 planner: Optional[QuestPlanner] = None) -> None:
        o = options or EngineOptions()
        self.tier, self.device, self.batch = tier, torch.device(device), batch
        self.planner = planner or QuestPlanner.from_tier(
            tier, device, n_q_heads, batch, rho=o.rho, recent_blocks=o.recent_blocks,
            select_algo=o.select_algo)
        kp = self.planner.kp
        self.pool = PagePool(tier, device, PoolOptions(n_slots=o.pool_slots,
                                                       fraction=o.pool_fraction),
                             max_requests=batch * tier.n_kv_heads * kp)
        self.own = OwnTokens(tier.n_layers, batch, tier.n_kv_heads, max_new_tokens,
                             tier.head_dim, tier.dtype, device)
        self.attention = PagedAttention(self.pool, batch, n_q_heads, kp)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        pages = self.planner.plan(layer, q)
        self.pool.resolve(layer, pages)
        return self.attention(layer, q, pages, self.own.k[layer], self.own.v[layer],
                              self.own.now)

    def memory(self) -> Dict[str, int]:
        """Device bytes by part: pool, planner index, own tokens."""
        return {"pool": self.pool.hbm_bytes, "index": self.planner.hbm_bytes,
                "own": self.own.nbytes}


class DenseDecoder(_Decoder):
    """The same seam over the whole context resident on the device.
    shared=False: each sequence reads the context as if it held its own copy
    (what a server without prefix sharing does; DenseContextAttention)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, batch: int, max_new_tokens: int,
                 shared: bool = True) -> None:
        self.attention = DenseContextAttention(k, v, shared=shared)
        self.own = OwnTokens(k.shape[0], batch, k.shape[1], max_new_tokens, k.shape[3],
                             k.dtype, k.device)
        self.batch = batch

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.attention(layer, q, self.own.k[layer], self.own.v[layer], self.own.now)

    def memory(self) -> Dict[str, int]:
        """Device bytes: the context (B copies' worth when not shared), own tokens."""
        a = self.attention
        ctx = 2 * a.k.numel() * a.k.element_size() * (1 if a.shared else self.batch)
        return {"context": ctx, "own": self.own.nbytes}
