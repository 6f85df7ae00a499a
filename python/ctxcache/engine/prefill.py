"""Sparse chunked prefill of an extension to a stored context (an agent's new
turn, a question after a document): CompactAttention's block-union KV
selection over the engine's compact index.

Per layer and chunk of new tokens (q [T, Hq, d] at positions n, n + 1, ...):
  1. selection: every (query, q head) of a kv head's group bounds every
     stored page with Quest, U(q, page) = sum_j max(q_j min_j, q_j max_j);
     a page's score for the chunk is the largest bound any of them gives
     (the union over the chunk's query blocks and the group's heads, at one
     threshold), and the ``kp`` best pages per kv head are kept, plus page 0
     and the last ``recent_blocks + 1`` pages (``planner.chunk_pages``). One table
     per kv head serves all of the chunk's queries and heads.
  2. attention: each query attends the selected stored pages (non-causal:
     they all precede it), the extension's earlier chunks and its own
     chunk causally; the parts are merged by log-sum-exp. The stored pages
     are read from the context's K/V by page (a gather of the table's
     pages; ``kp`` * page tokens per kv head), the rest in place.

With ``rho`` = 1 every page is kept and the result is dense attention over
context + extension (tests check it). ``DenseExtendAttention`` is the dense
baseline: the whole stored context for every query.

The extension's post-RoPE K/V (``k_new``/``v_new``) are what the server
stores: :meth:`ctxcache.engine.WriteBack.append_extension` sends them as a
child of the stored context (an ExtendContext's result, without the server
running the model).

Shapes: the stored context ``k``/``v`` [n_layers, H, n_pad, d] (page-padded
as a :class:`~ctxcache.engine.pool.HostTier`; tokens past ``n_tokens`` are
never attended); a chunk's q [T, Hq, d], k/v [T, H, d]; q head j reads kv
head j // G.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ctxcache.engine.planner import chunk_pages, page_cap, quest_bounds
from ctxcache.engine.pool import table_rows

__all__ = ["DenseExtendAttention", "ExtendOptions", "SparseExtendAttention", "attend_part",
           "merge_with_chunk"]


@dataclass
class ExtendOptions:
    # Stored pages each kv head's chunk attends, as a fraction of the
    # context's pages (page 0 and the recent pages come on top). Default: 0.1.
    rho: float = 0.1
    # Recent pages forced besides page 0 and the last page. Default: 1.
    recent_blocks: int = 1


def _merge(parts) -> torch.Tensor:
    """Log-sum-exp merge of (o [..., d] float, lse [...]) parts."""
    lse = parts[0][1]
    for _, x in parts[1:]:
        lse = torch.logaddexp(lse, x)
    out = sum(o * torch.exp(x - lse).unsqueeze(-1) for o, x in parts)
    return out


def attend_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [H, M, d], k/v [H, S, d] (one kv head per row block): (o [H, M, d]
    float, lse [H, M]). causal: M == S, row i sees keys <= i. CUDA with fp16 or
    bf16: flash SDPA; otherwise plain torch."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, False,
            scale=scale)[:2]
        return o[0].float(), lse[0].float()
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.float(), lse


def merge_with_chunk(parts, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A chunk's attention: its queries ``q`` [Hq, T, d] attend their own
    K/V ``k``/``v`` [H, T, d] causally, merged by log-sum-exp with ``parts``,
    the (o [H, G*T, d] float, lse [H, G*T]) attention of the same queries
    over earlier keys (row g*T + t: q head h*G + g, query t). Returns
    [H, G*T, d] float."""
    hq, t, d = q.shape
    h = k.shape[0]
    g = hq // h
    oc, lc = attend_part(q, k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0),
                         True, scale)                                     # [Hq, T, ...]
    return _merge(list(parts) + [(oc.reshape(h, g * t, d), lc.reshape(h, g * t))])


class _ExtendBase:
    """The chunk loop's state: per layer, the extension's K/V so far."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: Any) -> None:
        shape = (n_layers, n_kv_heads, max_tokens, head_dim)
        self.k_new = torch.zeros(shape, dtype=dtype, device=device)
        self.v_new = torch.zeros(shape, dtype=dtype, device=device)
        self.n_new = [0] * n_layers
        self.h, self.d = n_kv_heads, head_dim

    def reset(self) -> None:
        self.n_new = [0] * len(self.n_new)

    def _stored(self, layer: int, q: torch.Tensor,
                rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``rows`` [H, G * T, d] (the chunk's q [T, Hq, d]) over
        the stored context: (o float, lse)."""
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """A chunk: q [T, Hq, d], its k, v [T, H, d] -> [T, Hq, d]. The chunk's
        K/V join the extension's (``k_new``/``v_new``)."""
        t, hq, d = q.shape
        h, g = self.h, hq // self.h
        o0 = self.n_new[layer]
        if o0 + t > self.k_new.shape[2]:
            raise ValueError(f"extend: {o0 + t} new tokens > max_tokens {self.k_new.shape[2]}")
        self.k_new[layer, :, o0:o0 + t] = k.transpose(0, 1)
        self.v_new[layer, :, o0:o0 + t] = v.transpose(0, 1)
        self.n_new[layer] = o0 + t
        scale = 1.0 / math.sqrt(d)
        # The G q heads of a kv head are one block of G * T rows (non-causal
        # parts); the causal part needs each row's own position: per q head.
        rows = q.view(t, h, g, d).permute(1, 2, 0, 3).reshape(h, g * t, d)
        parts = [self._stored(layer, q, rows)]
        if o0:
            parts.append(attend_part(rows, self.k_new[layer, :, :o0],
                                     self.v_new[layer, :, :o0], False, scale))
        o = merge_with_chunk(parts, q.transpose(0, 1), self.k_new[layer, :, o0:o0 + t],
                             self.v_new[layer, :, o0:o0 + t], scale)      # [H, G*T, d]
        return o.view(h, g, t, d).permute(2, 0, 1, 3).reshape(t, hq, d).to(q.dtype)


class DenseExtendAttention(_ExtendBase):
    """Every query attends the whole stored context (the baseline)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, n_tokens: int, max_tokens: int) -> None:
        super().__init__(k.shape[0], k.shape[1], k.shape[3], max_tokens, k.dtype, k.device)
        self.k, self.v, self.n_tokens = k, v, n_tokens

    def _stored(self, layer, q, rows):
        n = self.n_tokens
        return attend_part(rows, self.k[layer, :, :n], self.v[layer, :, :n], False,
                           1.0 / math.sqrt(self.d))


class SparseExtendAttention(_ExtendBase):
    """Each chunk attends its block-union table of stored pages (module
    docstring). ``k``/``v``: the stored context, page-padded; ``kmin``/``kmax``
    its Quest bounds [L, H, P, d] (e.g. a decode planner's: the same index)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, n_tokens: int, max_tokens: int,
                 options: Optional[ExtendOptions] = None, page: int = 16,
                 bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        super().__init__(k.shape[0], k.shape[1], k.shape[3], max_tokens, k.dtype, k.device)
        o = options or ExtendOptions()
        if not 0.0 < o.rho <= 1.0:
            raise ValueError(f"ExtendOptions.rho: expected in (0, 1], got {o.rho}")
        if k.shape[2] % page or k.shape[2] < n_tokens:
            raise ValueError(f"extend: the stored K/V hold {k.shape[2]} tokens; expected "
                             f"{n_tokens} padded to a multiple of page {page}")
        self.k, self.v, self.n_tokens, self.page = k, v, n_tokens, page
        self.n_pages = (n_tokens + page - 1) // page
        if bounds is None:
            bounds = quest_bounds(k[:, :, :self.n_pages * page], n_tokens, page)
        self.kmin, self.kmax = bounds
        self.n_recent, self.kp = page_cap(o.rho, self.n_pages, o.recent_blocks)
        self._scores = torch.empty(self.h, self.n_pages, dtype=torch.float32, device=k.device)
        self._top = torch.empty(self.h, self.kp, dtype=torch.int64, device=k.device)
        self.last_pages: Optional[torch.Tensor] = None

    def _stored(self, layer, q, rows):
        pages = chunk_pages(q, self.kmin[layer], self.kmax[layer], self.kp, self.n_recent,
                            self._scores, self._top)
        pages = torch.sort(pages, dim=1).values
        self.last_pages = pages
        tok = table_rows(pages, self.page, self.n_tokens)
        idx = tok.unsqueeze(-1).expand(-1, -1, self.d)
        ks = torch.gather(self.k[layer], 1, idx)
        vs = torch.gather(self.v[layer], 1, idx)
        return attend_part(rows, ks, vs, False, 1.0 / math.sqrt(self.d))
