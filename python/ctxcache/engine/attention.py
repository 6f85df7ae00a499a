"""The attention backend of the GPU engine: decode attention of B sequences
over their pages of one stored context, read in place from the page pool,
plus each sequence's own tokens; and the dense baseline over the whole
context resident on the device.

Shapes: q [B, Hq, d] with q head j reading kv head j // G (G = Hq / H, as
HF Llama); own tokens ``tail_k``/``tail_v`` [B, H, T, d], the first
``tail_len[b]`` of them valid for sequence b; the result [B, Hq, d].
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ctxcache.engine.pool import PagePool, table_rows

__all__ = ["DenseContextAttention", "PagedAttention", "UnionAttention", "shared_attend"]


class PagedAttention:
    """Attention over each row's planned pages in the pool, plus own tokens.
    CUDA: one Triton flash-decoding kernel (splits over the pages, one split
    for the own tokens) and a combine; CPU: a reference in torch."""

    def __init__(self, pool: PagePool, batch: int, n_q_heads: int, kp: int) -> None:
        t = pool.tier
        self.pool, self.batch, self.hq, self.kp = pool, batch, n_q_heads, kp
        self.h, self.d, self.g = t.n_kv_heads, t.head_dim, n_q_heads // t.n_kv_heads
        self._kernel: Any = None
        if pool.device.type == "cuda":
            from ctxcache.engine import _triton
            self._kernel = _triton.PoolAttention(batch * self.h, self.g, self.d, kp,
                                                 pool.device, t.dtype, page=t.page)

    def __call__(self, layer: int, q: torch.Tensor, pages: torch.Tensor, tail_k: torch.Tensor,
                 tail_v: torch.Tensor, tail_len: torch.Tensor) -> torch.Tensor:
        t = self.pool.tier
        b = q.shape[0]
        if self._kernel is not None:
            out = self._kernel(q.contiguous().view(b * self.h, self.g, self.d), self.pool.k,
                               self.pool.v, pages, self.pool.slot_of, layer, self.h, t.n_pages,
                               t.n_tokens, tail_k, tail_v, tail_len)
            return out.view(b, self.hq, self.d)
        return self._reference(layer, q, pages, tail_k, tail_v, tail_len)

    def _reference(self, layer, q, pages, tail_k, tail_v, tail_len) -> torch.Tensor:
        t, pool = self.pool.tier, self.pool
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tok = torch.arange(t.page, device=q.device)
        for bi in range(q.shape[0]):
            n_t = int(tail_len[bi])
            for h in range(self.h):
                pg = pages[bi, h].long()
                slots = pool.slot_of[pool.units(layer, pages[bi:bi + 1])[0, h]].long()
                if bool((slots < 0).any()):
                    raise RuntimeError("attention: a planned page is not resident")
                pos = (pg.view(-1, 1) * t.page + tok).view(-1)
                rows = (slots.view(-1, 1) * t.page + tok).view(-1)[pos < t.n_tokens]
                k = torch.cat([pool.k[rows], tail_k[bi, h, :n_t]]).float()
                v = torch.cat([pool.v[rows], tail_v[bi, h, :n_t]]).float()
                qs = q[bi, h * self.g:(h + 1) * self.g].float()
                w = torch.softmax(qs @ k.T / math.sqrt(self.d), dim=-1)
                out[bi, h * self.g:(h + 1) * self.g] = (w @ v).to(q.dtype)
        return out


class DenseContextAttention:
    """The dense baseline: every sequence attends the whole context, resident
    on the device as ``k``/``v`` [n_layers, H, n, d], plus its own tokens.

    The context is shared by the batch: on CUDA the B sequences' queries of a
    kv head are one query block of B * G rows against the context's keys (one
    SDPA flash call per layer reads the context once for the whole batch),
    merged with the own tokens' attention by log-sum-exp (as cascade
    attention does). CPU: the same in plain torch.

    shared=False (CUDA): one flash call with a batch of B over the context
    expanded to B copies (stride 0: no memory, but every sequence's keys are
    read from HBM, as with per-sequence copies), the G q heads of a kv head
    as its query rows."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, shared: bool = True) -> None:
        self.k, self.v, self.shared = k, v, shared
        self.h, self.n, self.d = k.shape[1], k.shape[2], k.shape[3]

    def __call__(self, layer: int, q: torch.Tensor, tail_k: torch.Tensor,
                 tail_v: torch.Tensor, tail_len: torch.Tensor) -> torch.Tensor:
        b, hq, d = q.shape
        g = hq // self.h
        if q.is_cuda and not self.shared:
            scale = 1.0 / math.sqrt(d)
            kb = self.k[layer].unsqueeze(0).expand(b, -1, -1, -1)
            vb = self.v[layer].unsqueeze(0).expand(b, -1, -1, -1)
            o_ctx, lse_ctx = torch.ops.aten._scaled_dot_product_flash_attention(
                q.view(b, self.h, g, d), kb, vb, 0.0, False, False, scale=scale)[:2]
            return _merge_own(q, o_ctx, lse_ctx, tail_k, tail_v, tail_len)
        return shared_attend(q, self.k[layer], self.v[layer], tail_k, tail_v, tail_len)


def shared_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tail_k: torch.Tensor,
                  tail_v: torch.Tensor, tail_len: torch.Tensor) -> torch.Tensor:
    """B sequences' attention over one set of context keys shared by all of
    them (k/v [H, S, d]: the B * G query rows of a kv head are one query
    block, one SDPA flash call on CUDA), plus each one's own tokens, merged
    by log-sum-exp. q [B, Hq, d] -> [B, Hq, d]."""
    b, hq, d = q.shape
    h = k.shape[0]
    g = hq // h
    scale = 1.0 / math.sqrt(d)
    qh = q.view(b, h, g, d).permute(1, 0, 2, 3).reshape(1, h, b * g, d)
    if q.is_cuda:
        o_ctx, lse_ctx = torch.ops.aten._scaled_dot_product_flash_attention(
            qh, k.unsqueeze(0), v.unsqueeze(0), 0.0, False, False, scale=scale)[:2]
    else:
        s = (qh.float() @ k.float().transpose(-1, -2).unsqueeze(0)) * scale
        lse_ctx = torch.logsumexp(s, dim=-1)
        o_ctx = (torch.softmax(s, dim=-1) @ v.float().unsqueeze(0)).to(q.dtype)
    # [1, H, B * G, ...] as views [B, H, G, ...]
    o_ctx = o_ctx.view(h, b, g, d).permute(1, 0, 2, 3)
    lse_ctx = lse_ctx.view(h, b, g).permute(1, 0, 2)
    return _merge_own(q, o_ctx, lse_ctx, tail_k, tail_v, tail_len)


def _merge_own(q, o_ctx, lse_ctx, tail_k, tail_v, tail_len) -> torch.Tensor:
    """The context part (o_ctx [B, H, G, d] normalized, lse_ctx [B, H, G] its
    natural-log normalizer; any strides) merged with each sequence's own
    tokens by log-sum-exp: one Triton kernel on CUDA, torch on the CPU."""
    b, hq, d = q.shape
    h = tail_k.shape[1]
    g = hq // h
    if q.is_cuda:
        from ctxcache.engine import _triton
        return _triton.tail_merge(q.contiguous(), tail_k, tail_v, tail_len, o_ctx,
                                  lse_ctx.float())
    scale = 1.0 / math.sqrt(d)
    o_ctx = o_ctx.float()
    lse_ctx = lse_ctx.float()
    qf = q.view(b, h, g, d).float()
    st = torch.einsum("bhgd,bhtd->bhgt", qf, tail_k.float()) * scale
    valid = torch.arange(tail_k.shape[2], device=q.device).view(1, 1, 1, -1) < \
        tail_len.view(b, 1, 1, 1)
    st = st.masked_fill(~valid, float("-inf"))
    lse_t = torch.logsumexp(st, dim=-1)                                   # [B, H, G]
    o_t = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(st, dim=-1).nan_to_num(0.0),
                       tail_v.float())
    lse = torch.logaddexp(lse_ctx, lse_t)
    o = (o_ctx * torch.exp(lse_ctx - lse).unsqueeze(-1)
         + o_t * torch.exp(lse_t - lse).unsqueeze(-1))
    return o.reshape(b, hq, d).to(q.dtype)


class UnionAttention:
    """Batch union: every sequence of the batch attends one table of pool
    pages per kv head (the union the planner chose for the whole batch),
    plus its own tokens. The table's pages are gathered from the pool once
    per layer-step and read by all B * G query rows of the kv head in one
    flash call (shared_attend), so a page chosen for several sequences is
    read once. Tokens past the context (the last page's padding) are
    dropped: tables hold the last page, last after the sort.

    With ``keep`` (a search period above 1), each layer's gathered table
    stays on the device between planning steps ([n_layers, H, S, d] for K
    and for V, S the table's tokens): the steps that reuse a plan read it
    without gathering again."""

    def __init__(self, pool: PagePool, table_pages: int = 0, keep: bool = False) -> None:
        """table_pages: the pages of a table (the planner's union_kp); needed
        with keep. keep: Default False."""
        self.pool = pool
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        if keep:
            t = pool.tier
            if table_pages < 1:
                raise ValueError("UnionAttention: keep needs table_pages >= 1")
            s = table_pages * t.page - (-t.n_tokens) % t.page
            shape = (t.n_layers, t.n_kv_heads, s, t.head_dim)
            self._k = torch.empty(shape, dtype=t.dtype, device=pool.device)
            self._v = torch.empty(shape, dtype=t.dtype, device=pool.device)

    @property
    def hbm_bytes(self) -> int:
        """Device bytes of the kept tables (0 without keep)."""
        if self._k is None:
            return 0
        return 2 * self._k.numel() * self._k.element_size()

    def __call__(self, layer: int, q: torch.Tensor, pages: torch.Tensor, tail_k: torch.Tensor,
                 tail_v: torch.Tensor, tail_len: torch.Tensor,
                 refresh: bool = True) -> torch.Tensor:
        """pages [H, kp] (sorted ascending per row). refresh: the plan is new
        (gather the table); False reads the kept table of this layer (only
        with keep)."""
        t, pool = self.pool.tier, self.pool
        if self._k is None or self._v is None:
            if not refresh:
                raise ValueError("UnionAttention: refresh=False needs keep")
            units = pool.units(layer, pages.unsqueeze(0))[0]                 # [H, kp]
            rows = table_rows(pool.slot_of[units], t.page, t.n_tokens)
            return shared_attend(q, pool.k[rows], pool.v[rows], tail_k, tail_v, tail_len)
        k, v = self._k[layer], self._v[layer]
        if refresh:
            units = pool.units(layer, pages.unsqueeze(0))[0]
            rows = table_rows(pool.slot_of[units], t.page, t.n_tokens).reshape(-1)
            torch.index_select(pool.k, 0, rows, out=k.view(-1, t.head_dim))
            torch.index_select(pool.v, 0, rows, out=v.view(-1, t.head_dim))
        return shared_attend(q, k, v, tail_k, tail_v, tail_len)
