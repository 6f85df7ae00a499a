"""Sparse attention over stored prefixes inside a serving engine's paged KV
cache (the attention half of the serving backend's ``attention="sparse"``).

A stored context that the backend seeded into the engine's paged cache is
shared, block for block, by every request whose prompt starts with it. In
dense mode each request's query tokens attend all of its prefix. Here a
request's query tokens attend:

1. the stored prefix's pages that the GPU engine's compact index picks
   (a decode step; chunks of several tokens, the prompt after the prefix,
   attend the whole prefix unless ``prefill_rho`` < 1)
   (:class:`PrefixIndex`: Quest bounds, min and max of the keys per page of
   16 tokens, 6.25% of the prefix's K/V in bf16; the block-union table of
   :func:`ctxcache.engine.planner.chunk_pages`: page 0, the recent pages and
   the best ``kp`` by the largest bound any of the request's queries and
   q heads gives; ``kp`` is the session core's page budget, ``max(ceil(rho
   * pages), min_tokens / 16)``), read in place from the paged cache rows;
2. the request's own earlier tokens (the rest of its prompt and its
   generated tokens), all of them;
3. its tokens of this forward, causally;

merged by log-sum-exp (:func:`ctxcache.engine.prefill.merge_with_chunk`), the
parts computed by flash SDPA with its log-sum-exp on CUDA. A request with
no stored prefix gets parts 2 and 3: dense attention. The decode steps of a
forward that read the same prefix are one batched call per layer instead
(:class:`ForwardPlan`): their tables at once
(:func:`ctxcache.engine.planner.decode_pages`), one gather of their rows
and one masked softmax over parts 1-3 together. The same selection
and merge as the engine's sparse chunked prefill of an extension
(:class:`ctxcache.engine.SparseExtendAttention`), with the prefix's rows
taken from the engine's block table instead of the engine's own tier.

Shapes follow transformers' packed paged attention: ``query`` [1, Hq, Q, d],
``key``/``value`` [1, H, Q, d] (the Q packed tokens of all requests), the
layer's caches [slots, H, d], ``read_index`` the cache rows each request
reads (its past then its new tokens, requests one after the other),
``write_index`` the rows of the new tokens. q head j reads kv head j // G.
Nothing here imports transformers; the adapter that calls it is
:mod:`ctxcache.serving.transformers_cb`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ctxcache.engine.planner import chunk_pages, decode_pages, page_cap, quest_bounds
from ctxcache.engine.pool import table_rows
from ctxcache.engine.prefill import attend_part, merge_with_chunk

__all__ = ["PAGE_TOKENS", "ForwardPlan", "PrefixIndex", "RequestSpan", "block_table_rows",
           "masked_attention", "paged_sparse_attention", "spans_from_lengths"]

# Tokens of a page of the compact index (the session core's page).
PAGE_TOKENS = 16
# Keys after its prefix above which a decode request is attended alone, not
# in its prefix's batched call (ForwardPlan).
MAX_BATCHED_OWN = 8192
# The most bytes of K and V one batched decode call gathers; a larger group
# is attended in slices of requests.
MAX_GATHER_BYTES = 256 << 20


class PrefixIndex:
    """The compact index of one stored prefix on the device: per layer and kv
    head, the Quest bounds of every page of its first ``n_tokens`` tokens.

    Args:
        k: the prefix's keys (post-RoPE, as the engine caches them)
            ``[n_layers, n_kv_heads, >= n_tokens, head_dim]``, on any device.
        n_tokens: the prefix tokens the index covers (those in the paged
            cache's shared blocks).
        device, dtype: where and in which dtype the engine caches keys (the
            bounds are taken after that cast, so they bound what is read).
        rho: stored pages a request attends, as a fraction of the prefix's.
        min_tokens: the budget floor in tokens (``min_budget`` of the core).
        recent_pages: recent pages forced besides page 0 and the last.
        prefill_rho: the fraction for a request's chunks of several tokens
            (its prompt after the prefix); 1 = they attend the whole prefix.
    """

    def __init__(self, k: torch.Tensor, n_tokens: int, device: torch.device,
                 dtype: torch.dtype, rho: float, min_tokens: int, recent_pages: int,
                 prefill_rho: float = 1.0) -> None:
        for name, v in (("rho", rho), ("prefill_rho", prefill_rho)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name}: {v!r}, expected in (0, 1]")
        if n_tokens < 1 or n_tokens > k.shape[2]:
            raise ValueError(f"n_tokens: {n_tokens}, expected 1..{k.shape[2]} (the keys given)")
        page = PAGE_TOKENS
        self.n_tokens = int(n_tokens)
        self.n_pages = -(-self.n_tokens // page)
        n_pad = self.n_pages * page
        mins, maxs = [], []
        for layer in range(k.shape[0]):  # one layer on the device at a time
            kl = k[layer, :, :self.n_tokens].to(device=device, dtype=dtype)
            if n_pad != self.n_tokens:
                kl = torch.nn.functional.pad(kl, (0, 0, 0, n_pad - self.n_tokens))
            mn, mx = quest_bounds(kl, self.n_tokens, page)
            mins.append(mn)
            maxs.append(mx)
        self.kmin = torch.stack(mins)           # [L, H, P, d]
        self.kmax = torch.stack(maxs)
        self.n_recent, self.kp = page_cap(rho, self.n_pages, recent_pages, page, min_tokens)
        self.kp_prefill = page_cap(prefill_rho, self.n_pages, recent_pages, page, min_tokens)[1]
        # chunks of several tokens attend the whole prefix
        self.prefill_dense = prefill_rho >= 1.0

    @property
    def nbytes(self) -> int:
        """Device bytes of the bounds."""
        return 2 * self.kmin.numel() * self.kmin.element_size()


@dataclass(frozen=True)
class RequestSpan:
    """One request of a packed forward: its query rows ``[q0, q1)``, its read
    rows ``[k0, k0 + n_k)`` of ``read_index`` (past tokens, then the
    ``q1 - q0`` new ones), and the stored prefix its first
    ``prefix.n_tokens`` read rows hold (None: no stored prefix)."""
    q0: int
    q1: int
    k0: int
    n_k: int
    prefix: Optional[PrefixIndex] = None


class ForwardPlan:
    """A packed forward's requests, arranged once for all its layers.

    Requests with one new token (decode steps) that read the same stored
    prefix form one group, attended by one batched call per layer (the
    block-union tables of all of them at once, one gather of their cache
    rows, one masked attention); a request with no prefix, or one whose
    read set does not yet hold all of it, joins the group without one.
    Requests with several new tokens (prompt chunks) are attended one by
    one, and so is a decode request with more than ``max_batched_own`` keys
    after its prefix (its group would pad every member to its length). Built
    on the host from the spans, with one copy of small index tensors to
    ``device``; raises ValueError when a span does not fit ``n_q`` packed
    queries and ``n_read`` read rows."""

    def __init__(self, spans: Sequence[RequestSpan], n_q: int, n_read: int,
                 device: torch.device, max_batched_own: int = MAX_BATCHED_OWN) -> None:
        """max_batched_own: Default: MAX_BATCHED_OWN (8,192 keys)."""
        self.n_q, self.n_read = n_q, n_read
        # Requests attended one by one: prompt chunks, long own histories.
        self.chunks: List[RequestSpan] = []
        groups: dict = {}
        for s in spans:
            t = s.q1 - s.q0
            if t <= 0:
                continue
            past = s.n_k - t
            if past < 0 or s.q0 < 0 or s.q1 > n_q or s.k0 < 0 or s.k0 + s.n_k > n_read:
                raise ValueError(f"request span {s} does not fit {n_q} queries and "
                                 f"{n_read} read rows")
            if t > 1:
                self.chunks.append(s)
                continue
            prefix = s.prefix if s.prefix is not None and past >= s.prefix.n_tokens else None
            if s.n_k - (prefix.n_tokens if prefix is not None else 0) > max_batched_own:
                self.chunks.append(s)
                continue
            groups.setdefault(id(prefix), (prefix, []))[1].append(s)
        self.groups: List[_DecodeGroup] = []
        for prefix, members in groups.values():
            c = prefix.n_tokens if prefix is not None else 0
            cols = torch.tensor([[m.q0, m.k0, m.n_k - c] for m in members], dtype=torch.long)
            cols = cols.to(device)
            max_own = max(m.n_k - c for m in members)
            self.groups.append(_DecodeGroup(prefix, cols[:, 0], cols[:, 1], cols[:, 2],
                                            -(-max_own // PAGE_TOKENS) * PAGE_TOKENS))

    @property
    def decode_requests(self) -> int:
        """Requests attended by the batched decode call."""
        return sum(g.q_rows.numel() for g in self.groups)


@dataclass(frozen=True)
class _DecodeGroup:
    prefix: Optional[PrefixIndex]
    q_rows: torch.Tensor      # long [n]: each request's packed query row
    k0: torch.Tensor          # long [n]: its first row in read_index
    own: torch.Tensor         # long [n]: its keys after the prefix (the new one last)
    max_own: int              # the largest of them, rounded up to a page


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, H, M, d] attends k/v [n, H, S, d] where ``keep`` [n, H, S] is
    True (each row keeps at least one key): [n, H, M, d] in q's dtype. CUDA
    with fp16 or bf16: torch's SDPA with a boolean mask (fp32 softmax);
    otherwise plain torch in fp32."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep.unsqueeze(2), scale=scale)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~keep.unsqueeze(2), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


def _decode_group(grp: _DecodeGroup, query: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, read_index: torch.Tensor, layer: int,
                  scale: float) -> torch.Tensor:
    """One group's attention, [n, Hq, d]: each request's block-union pages of
    the prefix and all its keys after it (ForwardPlan)."""
    hq, d = query.shape[1], query.shape[3]
    h = k_cache.shape[1]
    n, dev = grp.q_rows.numel(), query.device
    q = query[0, :, grp.q_rows].transpose(0, 1).to(k_cache.dtype)       # [n, Hq, d]
    p = grp.prefix
    c = p.n_tokens if p is not None else 0
    j = torch.arange(grp.max_own, device=dev)
    own_keep = j < grp.own.view(-1, 1)                                   # [n, Lmax]
    own_rows = read_index[grp.k0.view(-1, 1) + c + torch.minimum(j, grp.own.view(-1, 1) - 1)]
    if p is None:
        rows = own_rows.unsqueeze(1).expand(n, h, -1)
        keep = own_keep.unsqueeze(1).expand(n, h, -1)
    else:
        pages = decode_pages(q, p.kmin, p.kmax, layer, p.kp, p.n_recent)    # [n, H, kp]
        tok = torch.arange(PAGE_TOKENS, device=dev)
        pos = (pages.unsqueeze(-1) * PAGE_TOKENS + tok).view(n, h, -1)
        pre_rows = read_index[grp.k0.view(-1, 1, 1) + pos.clamp(max=c - 1)]
        rows = torch.cat([pre_rows, own_rows.unsqueeze(1).expand(n, h, -1)], dim=2)
        keep = torch.cat([pos < c, own_keep.unsqueeze(1).expand(n, h, -1)], dim=2)
    heads = torch.arange(h, device=dev).view(1, h, 1)
    o = masked_attention(q.view(n, h, hq // h, d), k_cache[rows, heads], v_cache[rows, heads],
                         keep, scale)
    return o.reshape(n, hq, d)


def paged_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           read_index: torch.Tensor, write_index: torch.Tensor,
                           spans: Union[Sequence[RequestSpan], ForwardPlan], layer: int,
                           scaling: Optional[float] = None) -> torch.Tensor:
    """Writes the new tokens' K/V at ``write_index`` and returns the attention
    output ``[1, Q, Hq, d]`` (module docstring); rows of no span are zero.
    ``spans``: the forward's requests, or their :class:`ForwardPlan` (made
    once for all layers). Raises ValueError when a span does not fit the
    packed tensors."""
    _, hq, n_q, d = query.shape
    h = key.shape[1]
    if hq % h:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {h}")
    g = hq // h
    if isinstance(spans, ForwardPlan):
        plan = spans
        if (plan.n_q, plan.n_read) != (n_q, read_index.numel()):
            raise ValueError(f"forward plan for {plan.n_q} queries and {plan.n_read} read rows "
                             f"given {n_q} and {read_index.numel()}")
    else:
        plan = ForwardPlan(spans, n_q, read_index.numel(), query.device)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    new_k = key[0].transpose(0, 1)                # [Q, H, d]
    new_v = value[0].transpose(0, 1)
    n_w = write_index.numel()
    k_cache.index_copy_(0, write_index, new_k[:n_w].to(k_cache.dtype))
    v_cache.index_copy_(0, write_index, new_v[:n_w].to(v_cache.dtype))
    out = torch.zeros(n_q, hq, d, dtype=query.dtype, device=query.device)
    row_bytes = 2 * h * d * k_cache.element_size()               # a key row, K and V
    for grp in plan.groups:
        keys = (grp.prefix.kp * PAGE_TOKENS if grp.prefix is not None else 0) + grp.max_own
        step = max(1, MAX_GATHER_BYTES // (keys * row_bytes))
        for i in range(0, grp.q_rows.numel(), step):
            sub = _DecodeGroup(grp.prefix, grp.q_rows[i:i + step], grp.k0[i:i + step],
                               grp.own[i:i + step], grp.max_own)
            o = _decode_group(sub, query, k_cache, v_cache, read_index, layer, scale)
            out.index_copy_(0, sub.q_rows, o.to(out.dtype))
    heads = torch.arange(h, device=query.device).view(-1, 1)
    for s in plan.chunks:
        t = s.q1 - s.q0
        past = s.n_k - t
        q = query[0, :, s.q0:s.q1].to(k_cache.dtype)              # [Hq, T, d]
        rows = q.reshape(h, g * t, d)                            # kv head's G q heads
        parts = []
        c = s.prefix.n_tokens if s.prefix is not None and past >= s.prefix.n_tokens else 0
        if c and t > 1 and s.prefix.prefill_dense:
            c = 0                                                # dense prefill
        r = read_index[s.k0:s.k0 + past] if past else None
        if c:
            p = s.prefix
            pages = chunk_pages(q.transpose(0, 1), p.kmin[layer], p.kmax[layer],
                                p.kp if t == 1 else p.kp_prefill, p.n_recent)
            pages = torch.sort(pages, dim=1).values
            slots = r[:c][table_rows(pages, PAGE_TOKENS, c)]     # [H, S] cache rows
            parts.append(attend_part(rows, k_cache[slots, heads], v_cache[slots, heads],
                                     False, scale))
        if past > c:
            own = r[c:past]
            parts.append(attend_part(rows, k_cache[own].transpose(0, 1),
                                     v_cache[own].transpose(0, 1), False, scale))
        o = merge_with_chunk(parts, q, key[0, :, s.q0:s.q1].to(k_cache.dtype),
                             value[0, :, s.q0:s.q1].to(v_cache.dtype), scale)  # [H, G*T, d]
        out[s.q0:s.q1] = o.view(hq, t, d).transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0)


def spans_from_lengths(cu_q: List[int], cu_k: List[int],
                       prefixes: Sequence[Optional[PrefixIndex]]) -> List[RequestSpan]:
    """Spans from the cumulative query and key lengths of a packed batch and
    each request's stored prefix (or None)."""
    return [RequestSpan(cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1] - cu_k[i], prefixes[i])
            for i in range(len(cu_q) - 1)]


def block_table_rows(block_table: torch.Tensor, cu_q: List[int], cu_k: List[int],
                     block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The read and write rows of a packed batch given as a block table
    (``block_table`` [B, blocks], request b's position p at row
    ``block_table[b, p // block_size] * block_size + p % block_size``;
    ``cu_q``/``cu_k`` the cumulative query and key lengths, B + 1 of each,
    on the host): every request's positions 0 .. n_k - 1 one request after
    the other, as a read index, and each request's last n_q positions (its
    new tokens), as the write index. Device work only."""
    dev = block_table.device
    b = len(cu_k) - 1
    n_k = [cu_k[i + 1] - cu_k[i] for i in range(b)]
    n_q = [cu_q[i + 1] - cu_q[i] for i in range(b)]
    if any(q > k for q, k in zip(n_q, n_k)):
        raise ValueError(f"block table batch: query lengths {n_q} exceed key lengths {n_k}")
    total = cu_k[-1] - cu_k[0]
    req = torch.repeat_interleave(torch.arange(b, device=dev),
                                  torch.tensor(n_k, device=dev, dtype=torch.long))
    starts = torch.tensor(cu_k[:-1], device=dev, dtype=torch.long) - cu_k[0]
    pos = torch.arange(total, device=dev, dtype=torch.long) - starts[req]
    read = block_table[req, pos // block_size].long() * block_size + pos % block_size
    new = [r for i in range(b) for r in range(cu_k[i + 1] - cu_k[0] - n_q[i],
                                              cu_k[i + 1] - cu_k[0])]
    return read, read[torch.tensor(new, device=dev, dtype=torch.long)]
