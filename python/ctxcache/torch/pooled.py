"""The page pool and the pooled decode attention of
:func:`ctxcache.torch.hf.generate_client` with ``selection="torch"``, and the
decode attention that every decode path of :mod:`ctxcache.torch.hf` runs.

* :class:`GpuPagePool`: the stored KV pages of one context on the device, in
  a fixed number of slots under a byte budget, least recently used out. The
  slot map and the stamps are device tensors (a lookup needs no host-side
  loop); the missing pages come in one FetchPages per layer-step, crc32c
  checked (on the device for full pages on a GPU), and one host-to-device
  copy.
* :class:`PooledAttention`: one layer-step of a torch session
  (:mod:`ctxcache.torch.gpu_session`): the session core's plan, the pool's
  probe and the attention over the selected pages plus the decoded tokens,
  at fixed shapes (:func:`max_step_pages` pages per kv head), so that on a
  GPU it is two CUDA graph replays and one host sync; optional speculative
  next-layer prefetch into the pool.
* :func:`attend`: one decode token's attention over per-kv-head context rows
  plus the decoded tokens, in float32 (the server-session, library-session,
  dense and pooled paths all attend with it, so ``method="full"`` decodes
  exactly like dense attention).

Contract: needs torch and numpy only (no transformers). A pool and its
PooledAttention serve one decode at a time: only :meth:`GpuPagePool.fetch`
(a prefetch's network half) runs on another thread, and it touches no pool
state. Pages that come back wrong (out of range, twice, bad size, dtype or
crc) are :class:`ctxcache.errors.DataLoss`, nothing of the batch kept.
:mod:`ctxcache.torch.hf` imports from this module and re-exports its names;
this module never imports it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["attend", "GpuPagePool", "PooledAttention", "max_step_pages"]


# ---------------------------------------------------------------- attention --


def _stage(name: str) -> Any:
    """A named range in torch.profiler traces (python/bench/gpu_e2e.py
    --profile-steps); without a profiler it is one dispatcher call, four per
    layer-step."""
    return torch.autograd.profiler.record_function(name)


def attend(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
           ctx_mask: Optional[torch.Tensor], dec_k: torch.Tensor, dec_v: torch.Tensor,
           scale: float, dec_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode token's attention for every kv head at once, in float32.

    Args:
        q: ``[n_q_heads, d]`` post-RoPE queries.
        ctx_k, ctx_v: ``[n_kv_heads, N, d]``: per kv head the K/V rows of the
            context tokens its group of query heads may attend (the union of
            their selections padded to N rows, or all tokens).
        ctx_mask: ``[n_kv_heads, g, N]`` bool: the rows each query head of the
            group attends (padding rows False); None = every row, every head.
        dec_k, dec_v: ``[n_kv_heads, t, d]`` K/V of the decoded tokens so far
            (including the current one), attended by every head of the group.
        scale: the softmax scale (1/sqrt(d) unless the model says otherwise).
        dec_valid: ``[t]`` bool, the rows of ``dec_k``/``dec_v`` that hold
            decoded tokens (a fixed-size buffer); None = every row.

    Returns:
        ``[n_q_heads, d]`` float32: per query head, softmax over its context
        rows and the decoded tokens.
    """
    n_q, d = q.shape
    n_kv = dec_k.shape[0]
    g = n_q // n_kv
    n_ctx = ctx_k.shape[1]
    k = torch.cat([ctx_k.float(), dec_k.float()], dim=1)  # [H, N + t, d]
    v = torch.cat([ctx_v.float(), dec_v.float()], dim=1)
    logits = torch.einsum("hgd,hnd->hgn", q.float().view(n_kv, g, d), k) * scale
    if ctx_mask is not None and n_ctx:
        logits[:, :, :n_ctx].masked_fill_(~ctx_mask, float("-inf"))
    if dec_valid is not None:
        logits[:, :, n_ctx:].masked_fill_(~dec_valid, float("-inf"))
    out = torch.einsum("hgn,hnd->hgd", torch.softmax(logits, dim=-1), v)
    return out.reshape(n_q, d)


# -------------------------------------------------------------------- pool --

class GpuPagePool:
    """Stored KV pages of one context on the GPU, in a fixed number of slots
    under a byte budget; least recently used out. The slot map, the pages of
    the slots and their last-use stamps are device tensors, so a layer-step
    looks its pages up without host-side loops; the missing ones come in one
    FetchPages call (crc-checked by the client) and one host-to-device copy.

    >>> pool = GpuPagePool(client, info, "cuda", budget_bytes=1 << 30)
    >>> slots = pool.lookup(layer, pages, valid)  # [H, P] page ids -> slots
    >>> k = pool.k[slots]                         # [H, P, block, d], in place

    Attributes: hits, misses (pages fetched on a step's path), prefetch_hits
    (missing pages a prefetch had brought), bytes_fetched (prefetches
    included).
    """

    def __init__(self, client: Any, info: Any, device: Any, budget_bytes: int = 1 << 30,
                 dtype: Any = torch.bfloat16) -> None:
        self.client, self.context_id = client, info.context_id
        self.block = int(info.block_tokens) or 16
        d = int(info.model.head_dim)
        self.n_layers, self.n_kv_heads = int(info.model.n_layers), int(info.model.n_kv_heads)
        self.n_pages = (int(info.n_tokens) + self.block - 1) // self.block
        per_page = 2 * self.block * d * torch.tensor([], dtype=dtype).element_size()
        n_slots = max(1, int(budget_bytes) // per_page)
        dev = torch.device(device)
        self.k = torch.zeros(n_slots, self.block, d, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        i64 = dict(dtype=torch.int64, device=dev)
        # (layer, kv head, page) -> slot or -1; slot -> flat page key or -1;
        # slot -> the lookup that last used it (-1: free).
        self._slot_of = torch.full((self.n_layers * self.n_kv_heads * self.n_pages,), -1, **i64)
        self._page_of = torch.full((n_slots,), -1, **i64)
        # One stamp past the slots: probe() writes the stamps of non-hits
        # there (fixed shapes, no host sync).
        self._stamp = torch.full((n_slots + 1,), -1, **i64)
        self._clock = torch.zeros(1, **i64)  # on the device: probe() may run in a CUDA graph
        self.hits = self.misses = self.bytes_fetched = self.prefetch_hits = 0
        self._count_lock = threading.Lock()
        self._host: Optional[torch.Tensor] = None  # _staging's pinned buffer
        self._staged: Any = None                   # its last copy's event

    @property
    def n_slots(self) -> int:
        return self.k.shape[0]

    def _key(self, layer: int, kv_head: Any, page: Any) -> Any:
        return (layer * self.n_kv_heads + kv_head) * self.n_pages + page

    def holds(self, layer: int, kv_head: int, page: int) -> bool:
        """Whether the page is in the pool."""
        return int(self._slot_of[self._key(layer, kv_head, page)]) >= 0

    def lookup(self, layer: int, pages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The slots ``[H, P]`` of kv head h's pages ``pages[h]`` (int64 page
        ids, ``valid`` marks the real entries; the rest map to slot 0),
        fetching the missing pages. A layer-step needing more pages than the
        pool holds is a ValueError (raise the budget)."""
        pages = pages.to(self.k.device)
        valid = valid.to(self.k.device)
        need = int(valid.sum())
        if need > self.n_slots:
            raise ValueError(f"GpuPagePool: a layer-step needs {need} pages, the pool holds "
                             f"{self.n_slots}; raise budget_bytes")
        keys, miss = self.probe(layer, pages, valid)
        self.hits += need - self.fill(layer, keys, miss)
        return self.slots(keys, valid)

    def probe(self, layer: int, pages: torch.Tensor,
              valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first half of :meth:`lookup`, without a host sync (it can be
        captured in a CUDA graph): the pages' keys ``[H, P]`` and which of
        the valid ones are missing; the pages present are stamped as used
        now. Contract: at most ``n_slots`` valid pages (the caller checks),
        then :meth:`fill` with the result before the next probe, and the
        hits counted by the caller."""
        keys, slots, miss = self._peek(layer, pages, valid)
        self._clock.add_(1)
        used = torch.where(valid & ~miss, slots, torch.full_like(slots, self.n_slots))
        self._stamp.index_put_((used.view(-1),), self._clock.expand(used.numel()))
        return keys, miss

    def _peek(self, layer: int, pages: torch.Tensor, valid: torch.Tensor) -> tuple:
        """Keys, slots and misses of ``[H, P]`` pages; changes nothing."""
        h = torch.arange(pages.shape[0], device=pages.device).view(-1, 1)
        keys = self._key(layer, h, pages.clamp(0, max(0, self.n_pages - 1)))
        slots = self._slot_of[keys]
        return keys, slots, valid & (slots < 0)

    def fill(self, layer: int, keys: torch.Tensor, miss: torch.Tensor,
             ready: Optional[Dict[int, Any]] = None) -> int:
        """Brings in the pages :meth:`probe` found missing (one host sync to
        list them): those in ``ready`` (flat key -> wire page, e.g. from a
        prefetch; the rest of it is dropped) as they are, the others with one
        FetchPages; one install for all. Returns how many were fetched here
        (counted in ``misses``; the ready ones in ``prefetch_hits``)."""
        want = keys[miss].tolist()  # row-major: by kv head, then position
        if not want:
            return 0
        ready = ready or {}
        rest = [k for k in want if k not in ready]
        with _stage("ctxcache.pool_fill"):
            wire = self.fetch(layer, rest) if rest else []
            got = {self.wire_key(p): p for p in wire}
            if len(wire) != len(rest) or any(k not in got for k in rest):
                raise RuntimeError(f"GpuPagePool: asked for {len(rest)} pages, got "
                                   f"{len(wire)} others")
            self.install([ready[k] if k in ready else got[k] for k in want])
        self.misses += len(rest)
        self.prefetch_hits += len(want) - len(rest)
        return len(rest)

    def slots(self, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The slots of probed (and filled) keys; invalid entries read slot 0."""
        slots = self._slot_of[keys]
        return torch.where(valid, slots, torch.zeros_like(slots))

    def wire_key(self, page: Any) -> Optional[int]:
        """The flat key of a wire page, None when its layer, kv head or
        block is outside the context."""
        if not (page.layer < self.n_layers and page.kv_head < self.n_kv_heads and
                page.block < self.n_pages):
            return None
        return self._key(int(page.layer), int(page.kv_head), int(page.block))

    def fetch(self, layer: int, keys: Sequence[int]) -> List[Any]:
        """FetchPages of the pages with these flat keys (all of ``layer``),
        as wire pages, crcs unchecked: the network half of a fill, which
        touches no pool state (a prefetch runs it on a worker thread)."""
        by_head: Dict[int, List[int]] = {}
        for key in keys:
            by_head.setdefault((key // self.n_pages) % self.n_kv_heads, []).append(
                key % self.n_pages)
        wire = self.client.fetch_wire_pages(
            self.context_id, [(layer, hh, sorted(b)) for hh, b in sorted(by_head.items())])
        with self._count_lock:  # a prefetch fetches on a worker thread
            self.bytes_fetched += sum(len(p.k) + len(p.v) for p in wire)
        return wire

    def install(self, wire: Sequence[Any]) -> None:
        """Puts fetched wire pages into slots (crc-checked, nothing kept of a
        bad batch): free slots first, then the least recently used.
        Contract: none of the pages is in the pool, and the pages the current
        layer-step uses carry the newest stamp (so they are not evicted)."""
        n = len(wire)
        if not n:
            return
        if n > self.n_slots:
            raise ValueError(f"GpuPagePool: {n} pages to install, the pool holds {self.n_slots}")
        from ctxcache import errors

        keys = []
        for p in wire:
            key = self.wire_key(p)
            if key is None:
                raise errors.DataLoss(f"FetchPages sent layer {p.layer}, kv head {p.kv_head}, "
                                      f"block {p.block}: out of the context's range",
                                      rpc="FetchPages")
            keys.append(key)
        if len(set(keys)) != n:
            raise errors.DataLoss("FetchPages sent a page twice", rpc="FetchPages")
        kv = self._checked_rows(wire)  # [n, 2, block, d] on the device
        victims = torch.topk(self._stamp[:self.n_slots], n, largest=False).indices
        old = self._page_of[victims]
        self._slot_of[old[old >= 0]] = -1
        self.k[victims] = kv[:, 0]
        self.v[victims] = kv[:, 1]
        new = torch.tensor(keys, dtype=torch.int64, device=self.k.device)
        self._page_of[victims] = new
        self._slot_of[new] = victims
        self._stamp[victims] = self._clock

    def _staging(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of at least ``nbytes`` for fills: pinned and
        reused on a GPU (after the last copy out of it finished)."""
        if self.k.device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._host is None or self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            self._staged = torch.cuda.Event()
            self._staged.record()
        self._staged.synchronize()
        return self._host

    def _checked_rows(self, wire: Sequence[Any]) -> torch.Tensor:
        """The K and V of wire pages as ``[n, 2, block, d]`` in the pool's
        dtype on its device (a partial page zero-padded), each page's crc32c
        checked: on the device for full pages when it is a GPU (one bulk copy,
        ``crc32c_rows_torch``), else on the host. DataLoss for a bad crc, size
        or dtype."""
        from ctxcache import errors
        from ctxcache import tensors as _t
        from ctxcache.page_codec import check_page_crcs, page_crc_error

        dev = self.k.device
        n, (b, d) = len(wire), self.k.shape[1:]
        wdt = int(wire[0].dtype)
        item = _t.wire_itemsize(wdt)
        if item is None or any(int(p.dtype) != wdt for p in wire):
            raise errors.DataLoss("GpuPagePool: pages of unknown or mixed dtypes",
                                  rpc="FetchPages")
        page_bytes = b * d * item
        for p in wire:
            if not (0 < p.n_tokens <= b and len(p.k) == len(p.v) == p.n_tokens * d * item):
                raise errors.DataLoss(f"page of layer {p.layer}, kv head {p.kv_head}, block "
                                      f"{p.block} has the wrong size", rpc="FetchPages")
        full = all(p.n_tokens == b for p in wire)
        # One host buffer (pinned on a GPU, reused) holds the rows, each a
        # page's k || v zero-padded, then the crcs: one copy to the device.
        row = 2 * page_bytes
        off = (n * row + 7) // 8 * 8  # the crcs, 8-byte aligned
        host = self._staging(off + 8 * n)
        view = host.numpy()
        rows_np = view[:n * row].reshape(n, row)
        for i, p in enumerate(wire):
            nk = len(p.k)
            rows_np[i, :nk] = np.frombuffer(p.k, dtype=np.uint8)
            rows_np[i, page_bytes:page_bytes + nk] = np.frombuffer(p.v, dtype=np.uint8)
            if nk < page_bytes:
                rows_np[i, nk:page_bytes] = 0
                rows_np[i, page_bytes + nk:] = 0
        view[off:off + 8 * n].view(np.int64)[:] = [p.crc32c for p in wire]
        on_gpu = dev.type == "cuda"
        blob = host[:off + 8 * n].to(dev, non_blocking=on_gpu)
        if on_gpu:
            self._staged.record()  # the buffer is reused once this copy is done
        rows = blob[:n * row].view(n, row)
        if full and on_gpu:  # each row is exactly the page's k || v: its crc is the page's
            from ctxcache.crc32c import crc32c_rows_torch

            bad = crc32c_rows_torch(rows) != blob[off:].view(torch.int64)
            if bool(bad.any()):
                raise page_crc_error(wire[int(torch.nonzero(bad)[0, 0])], rpc="FetchPages")
        else:
            check_page_crcs(wire, rpc="FetchPages")
        return rows.view(_t.wire_torch_dtype(wdt)).view(n, 2, b, d).to(self.k.dtype)

    def load_all(self) -> None:
        """Fetches every page of the context into the pool, a layer per
        FetchPages (a worker keeping a hot context resident: every later
        lookup hits). ValueError when the pool cannot hold them all. Counts
        as misses and fetched bytes like any fill."""
        total = self.n_layers * self.n_kv_heads * self.n_pages
        if total > self.n_slots:
            raise ValueError(f"GpuPagePool.load_all: the context has {total} pages, the pool "
                             f"holds {self.n_slots}; raise budget_bytes")
        pages = torch.arange(self.n_pages, device=self.k.device).repeat(self.n_kv_heads, 1)
        valid = torch.ones_like(pages, dtype=torch.bool)
        for layer in range(self.n_layers):
            self.lookup(layer, pages, valid)

    def gather(self, layer: int, pages: torch.Tensor, valid: torch.Tensor) -> tuple:
        """``[H, P * block, d]`` K and V of the pages (looked up, fetched
        where missing), page after page; padding entries read slot 0."""
        slots = self.lookup(layer, pages, valid)
        hh, pp = slots.shape
        return (self.k[slots].reshape(hh, pp * self.block, -1),
                self.v[slots].reshape(hh, pp * self.block, -1))


def _pad_pages(by_head: Sequence[Sequence[int]], device: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per kv head page lists as ``[H, P]`` int64 ids and validity."""
    p = max((len(b) for b in by_head), default=0)
    pages = torch.zeros(len(by_head), p, dtype=torch.int64)
    valid = torch.zeros(len(by_head), p, dtype=torch.bool)
    for h, b in enumerate(by_head):
        pages[h, :len(b)] = torch.as_tensor(list(b), dtype=torch.int64)
        valid[h, :len(b)] = True
    return pages.to(device), valid.to(device)


# -------------------------------------------------------- pooled attention --

def max_step_pages(planner: Any) -> int:
    """The most pages one kv head's layer-step of ``planner`` (a torch
    session) can use: the page cap's budget, page 0 and the last
    ``recent_blocks + 1`` pages (``_TorchPlanner._cap``); every page when
    the session has no page cap."""
    from ctxcache.torch.tables import page_budget

    p = planner.params
    if p.page_fraction <= 0:
        return planner.n_pages
    return min(planner.n_pages,
               page_budget(p.page_fraction, planner.n_tokens, p.page_size) + p.recent_blocks + 2)


class PooledAttention:
    """The client-side decode path of :func:`generate_client` with a torch
    session: per layer-step the session core (stages 1-4), the page pool's
    lookup and the attention over the selected pages plus the decoded tokens,
    all at fixed shapes (``max_step_pages`` pages per kv head, a decoded-token
    buffer of ``capacity`` rows), so that on a GPU a layer-step is two CUDA
    graph replays and one host sync: the miss count, read after the
    attention was queued. A step with misses fetches them
    (:meth:`GpuPagePool.fill`) and replays the attention. Without
    ``cuda_graphs`` the same code runs eagerly (CPU, or csa with a search
    period, whose selection keeps host state).

    >>> pa = PooledAttention(planner, pool, capacity=64, cuda_graphs=True)
    >>> out = pa(layer, q, key, value, scale)   # [n_q, d] float32

    ValueError when the pool cannot hold one layer-step's pages
    (``n_kv_heads * max_step_pages``) or for non-finite queries.
    """

    def __init__(self, planner: Any, pool: GpuPagePool, capacity: int = 64,
                 cuda_graphs: bool = False) -> None:
        self.planner, self.pool = planner, pool
        self.p_max = max_step_pages(planner)
        self.h, self.g = planner.n_kv_heads, planner.group_size
        if self.h * self.p_max > pool.n_slots:
            raise ValueError(f"PooledAttention: a layer-step may need {self.h * self.p_max} "
                             f"pages, the pool holds {pool.n_slots}; raise its budget_bytes")
        if planner.params.page_size != pool.block:
            raise ValueError(f"PooledAttention: session pages of {planner.params.page_size} "
                             f"tokens, the pool's of {pool.block}")
        if cuda_graphs and planner.device.type != "cuda":
            raise ValueError(f"PooledAttention: cuda_graphs on {planner.device}, not CUDA")
        self.device = planner.device
        self.use_graphs = cuda_graphs
        self.capacity = max(1, int(capacity))
        self.q = torch.zeros(planner.n_q_heads, planner.head_dim, dtype=torch.float32,
                             device=self.device)
        self.dec_k: Optional[torch.Tensor] = None  # [H, capacity, d], the model's dtype
        self.dec_v: Optional[torch.Tensor] = None
        self.dec_len = torch.zeros((), dtype=torch.int64, device=self.device)
        self.scale: Optional[float] = None
        # layer -> (front outputs, out buffer, graph A, graph B) once captured
        self._layers: Dict[int, Any] = {}
        # Speculative prefetch (prefetch()): predicted queries, per layer the
        # prediction's (keys, misses) outputs and graph, the fetches in flight.
        self.q_pred = torch.zeros_like(self.q)
        self._pred: Dict[int, Any] = {}
        self._pending: Dict[int, Future] = {}
        self._fetcher: Optional[ThreadPoolExecutor] = None
        self.prefetch_requests = self.prefetch_failures = 0

    def _pages(self, layer: int, q: torch.Tensor) -> tuple:
        """Stages 1-4 for queries q: the plan, each kv head's pages ascending
        in ``p_max`` entries, their validity and the heads' page counts."""
        plan = self.planner.plan_queries(layer, q)
        counts = plan.pages.sum(dim=1)                                  # [H]
        # Each head's pages ascending, first: a stable sort of the page flags.
        pages = torch.sort(plan.pages.to(torch.int8), dim=1, descending=True,
                           stable=True).indices[:, :self.p_max]
        valid = torch.arange(self.p_max, device=q.device).view(1, -1) < counts.view(-1, 1)
        return plan, pages, valid, counts

    # Stage A: plan, the fixed-size page list, the pool probe, the masks.
    def _front(self, layer: int) -> Dict[str, torch.Tensor]:
        planner, q = self.planner, self.q
        plan, pages, valid, counts = self._pages(layer, q)
        keys, miss = self.pool.probe(layer, pages, valid)
        tok = planner.by_page(plan.token_mask)                           # [H, G, n_pages, b]
        b = tok.shape[3]
        mask = tok.gather(2, pages.view(self.h, 1, -1, 1).expand(self.h, self.g, -1, b))
        mask = (mask & valid.view(self.h, 1, -1, 1)).reshape(self.h, self.g, -1)
        status = torch.stack([valid.sum(), miss.sum(), (~torch.isfinite(q)).any().long(),
                              (counts > self.p_max).any().long()])
        return {"keys": keys, "miss": miss, "valid": valid, "mask": mask, "status": status}

    # Stage B: attention over the pool's pages plus the decoded tokens.
    def _back(self, front: Dict[str, torch.Tensor], out: torch.Tensor) -> None:
        slots = self.pool.slots(front["keys"], front["valid"])
        hh, pp = slots.shape
        k = self.pool.k[slots].reshape(hh, pp * self.pool.block, -1)
        v = self.pool.v[slots].reshape(hh, pp * self.pool.block, -1)
        dec_valid = torch.arange(self.capacity, device=self.device) < self.dec_len
        out.copy_(attend(self.q, k, v, front["mask"], self.dec_k, self.dec_v, self.scale,
                         dec_valid))

    def _entry(self, layer: int) -> Any:
        entry = self._layers.get(layer)
        if entry is not None:
            return entry
        if not (self.use_graphs and self.planner.graphable(layer)):
            return None
        from ctxcache.torch.gpu_session import capture_graph

        out = torch.zeros_like(self.q)
        ga, front = capture_graph(self.device, lambda: self._front(layer))
        ga.replay()  # B's warm-up reads A's outputs
        gb, _ = capture_graph(self.device, lambda: self._back(front, out), pool=ga.pool())
        entry = self._layers[layer] = (front, out, ga, gb)
        return entry

    def _reserve(self, key: torch.Tensor) -> None:
        t = key.shape[2]
        if self.dec_k is not None and t <= self.capacity and self.dec_k.dtype == key.dtype:
            return
        if self.dec_k is not None and t > self.capacity:
            self.capacity = max(t, 2 * self.capacity)
        self.capacity = max(self.capacity, t)
        shape = (self.h, self.capacity, key.shape[3])
        self.dec_k = torch.zeros(shape, dtype=key.dtype, device=self.device)
        self.dec_v = torch.zeros_like(self.dec_k)
        self._layers.clear()  # the graphs read the old buffers: capture again

    def _predict(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        _, pages, valid, _ = self._pages(layer, self.q_pred)
        keys, _, miss = self.pool._peek(layer, pages, valid)
        return keys, miss

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Speculative fill: plans ``layer`` for predicted queries ``q``
        ``[n_q, d]`` and fetches the pages that plan misses on a worker
        thread (one FetchPages). The next step of ``layer`` uses those of
        them it misses (``GpuPagePool.fill``'s ``ready``; the pool's state
        is then what it would be without the prefetch) and drops the rest.
        Changes no pool or session state now (one host sync: the miss list).
        At most one in flight per layer (another request for it is ignored).
        A failed prefetch RPC is counted in ``prefetch_failures``, never
        raised: the step fetches what it misses itself (a corrupt page is
        the step's DataLoss, as if it had fetched it)."""
        if layer in self._pending or not 0 <= layer < self.planner.n_layers:
            return
        if not self.planner.graphable(layer):
            return  # a csa search period: predicting would advance its schedule
        self.q_pred.copy_(q)
        if self.use_graphs:
            entry = self._pred.get(layer)
            if entry is None:
                from ctxcache.torch.gpu_session import capture_graph

                graph, (keys, miss) = capture_graph(self.device, lambda: self._predict(layer))
                entry = self._pred[layer] = (graph, keys, miss)
            graph, keys, miss = entry
            graph.replay()
        else:
            keys, miss = self._predict(layer)
        with _stage("ctxcache.prefetch_plan"):
            want = keys[miss].tolist()
        if not want:
            return
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(max_workers=1)
        self.prefetch_requests += 1
        self._pending[layer] = self._fetcher.submit(self.pool.fetch, layer, want)

    def _take_prefetch(self, layer: int, wait: bool) -> Dict[int, Any]:
        """The pages of ``layer``'s prefetch by flat key ({} when none, when
        it failed, or without ``wait`` when it is still in flight)."""
        fut = self._pending.pop(layer, None)
        if fut is None or not (wait or fut.done()):
            return {}
        from ctxcache import errors
        try:
            with _stage("ctxcache.prefetch_wait"):
                wire = fut.result()
        except errors.Error:
            self.prefetch_failures += 1
            return {}
        return {self.pool.wire_key(p): p for p in wire
                if p.layer == layer and self.pool.wire_key(p) is not None}

    def close(self) -> None:
        """Waits for the prefetches in flight (their pages are dropped)."""
        for fut in self._pending.values():
            fut.exception()
        self._pending.clear()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
            self._fetcher = None

    def __call__(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Attention of one decode token at ``layer``: ``q`` ``[n_q, d]``
        post-RoPE, ``key``/``value`` ``[1, H, t, d]`` the decoded tokens so
        far (the current one last); returns ``[n_q, d]`` float32, a buffer
        the next step of the layer overwrites."""
        if not 0 <= layer < self.planner.n_layers:
            raise ValueError(f"step.layer {layer} out of range [0, {self.planner.n_layers})")
        if tuple(q.shape) != (self.planner.n_q_heads, self.planner.head_dim):
            raise ValueError(f"queries have shape {list(q.shape)}, expected "
                             f"[{self.planner.n_q_heads}, {self.planner.head_dim}]")
        if self.scale is None:
            self.scale = float(scale)
        elif float(scale) != self.scale:
            raise ValueError(f"PooledAttention: scale {scale}, the session's is {self.scale}")
        self._reserve(key)
        t = key.shape[2]
        self.q.copy_(q)
        self.dec_k[:, :t].copy_(key[0])
        self.dec_v[:, :t].copy_(value[0])
        self.dec_len.fill_(t)
        entry = self._entry(layer)
        if entry is None:  # eager
            front, out = self._front(layer), torch.zeros_like(self.q)
            self._back(front, out)
            replay_back = lambda: self._back(front, out)  # noqa: E731
        else:
            front, out, ga, gb = entry
            with _stage("ctxcache.replay"):
                ga.replay()
                gb.replay()
            replay_back = gb.replay
        with _stage("ctxcache.sync"):
            need, n_miss, nonfinite, overflow = front["status"].tolist()
        if nonfinite:
            raise ValueError(f"{self.planner.method}: queries have NaN/Inf")
        if overflow:
            raise RuntimeError(f"PooledAttention: a kv head selected more than {self.p_max} "
                               "pages (max_step_pages is wrong)")
        if n_miss:
            ready = self._take_prefetch(layer, wait=True)
            with _stage("ctxcache.pool"):
                self.pool.fill(layer, front["keys"], front["miss"], ready)
            replay_back()
        else:
            self._take_prefetch(layer, wait=False)  # not needed: dropped
        self.pool.hits += need - n_miss
        return out
