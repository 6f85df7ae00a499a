"""HF transformers integration: prefill a context with a LLaMA-family model,
ingest its KV into ctxcache, and decode against ctxcache with sparse
attention over the pages it selects.

    from transformers import AutoModelForCausalLM
    from ctxcache.torch import hf
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    info, prefill = hf.prefill_and_ingest(client, model, context_ids, indexes=["csa"])
    out = hf.generate(client, model, info, last_token, n_new=64, method="csa")
    out.tokens, out.step_s, out.bytes_received

How decoding works: the model runs one token at a time with its own
attention modules (projections, RoPE) but a custom attention function
(``transformers.AttentionInterface``, registered as ``"ctxcache"``). For
each layer the function sends the post-RoPE queries to a ctxcache decode
session (server-side selection, ``Session.step``), gets the selected
context tokens' K/V from the pages, and attends, per query head, over its
selected context tokens plus every token generated so far (those live in the
model's own decode cache, dense, on the GPU). After each step the input
token's K/V/Q of every layer go back to the session with Append
(``append=True``, the default), as the C++ worker does, so the session's
indexes keep up; the session's selections of appended tokens are not used
(the worker already holds them). ``method="full"``
selects every context token: it must decode exactly like dense attention
over the same KV, which ``generate_dense`` computes with the same attention
code (``attend``) over the prefill cache.

Needs torch and, for the model parts, transformers (>= 4.48, the attention
interface); ``attend``, ``gather_selected`` and ``GpuPagePool`` need torch only.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["attend", "gather_selected", "pad_heads", "model_spec", "prefill", "prefill_and_ingest",
           "generate", "generate_client", "generate_dense", "GenerateResult", "GpuPagePool",
           "LibrarySession", "PooledAttention", "PrefillResult", "max_step_pages"]


# ---------------------------------------------------------------- attention --

def _stage(name: str) -> Any:
    """A named range in torch.profiler traces (python/bench/gpu_e2e.py
    --profile-steps); without a profiler it is one dispatcher call, four per
    layer-step."""
    return torch.autograd.profiler.record_function(name)


def pad_heads(rows: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per kv head ``[n_h, d]`` rows as one zero-padded ``[H, N, d]`` tensor
    (N = the longest) and its ``[H, N]`` bool validity."""
    n = max((int(r.shape[0]) for r in rows), default=0)
    d = int(rows[0].shape[1])
    out = rows[0].new_zeros(len(rows), n, d)
    valid = torch.zeros(len(rows), n, dtype=torch.bool, device=rows[0].device)
    for h, r in enumerate(rows):
        out[h, :r.shape[0]] = r
        valid[h, :r.shape[0]] = True
    return out, valid


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


def gather_selected(step: Any, n_q_heads: int, device: Any, dtype: Any,
                    n_context: Optional[int] = None) -> tuple:
    """From a :class:`ctxcache.StepResult` (server-side selection): the
    ``[H, N, d]`` K and V of the union of each kv head's query heads'
    selections (padded) and the ``[H, g, N]`` mask of each query head's own
    rows, on ``device``. ``n_context``: keep only ids below it (the stored
    context; a worker attends its appended tokens from its own cache)."""
    ks: List[torch.Tensor] = []
    vs: List[torch.Tensor] = []
    masks: List[np.ndarray] = []
    g = n_q_heads // len(step.heads)
    for head in step.heads:
        union = np.asarray(head.ids)
        keep = slice(None) if n_context is None else union < int(n_context)
        union = union[keep]
        mask = np.zeros((g, union.size), dtype=bool)
        for j in range(g):
            mine = np.asarray(head.per_q_head[j])
            if n_context is not None:
                mine = mine[mine < int(n_context)]
            mask[j, np.searchsorted(union, mine)] = True
        ks.append(torch.as_tensor(np.asarray(head.k)[keep]).to(device=device, dtype=dtype))
        vs.append(torch.as_tensor(np.asarray(head.v)[keep]).to(device=device, dtype=dtype))
        masks.append(mask)
    k, valid = pad_heads(ks)
    v, _ = pad_heads(vs)
    m = np.zeros((len(masks), g, k.shape[1]), dtype=bool)
    for h, mk in enumerate(masks):
        m[h, :, :mk.shape[1]] = mk
    return k, v, torch.as_tensor(m).to(device)


# ------------------------------------------------------------------ models --

def _layers(model: Any) -> Any:
    return model.model.layers


def model_spec(model: Any, name: str) -> Dict[str, Any]:
    """The ModelSpec of an HF LLaMA-family model for ``Client.ingest``: its
    shape, kv_dtype bf16, and a fingerprint = SHA-256 over the parameters
    (names and bytes, in name order), so different weights never share ids."""
    cfg = model.config
    n_q = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    h = hashlib.sha256()
    for pname, p in sorted(model.state_dict().items()):
        h.update(pname.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return {"name": name, "n_layers": cfg.num_hidden_layers, "n_q_heads": n_q,
            "n_kv_heads": getattr(cfg, "num_key_value_heads", n_q), "head_dim": d,
            "kv_dtype": "bf16", "fingerprint": h.digest()}


@dataclass
class PrefillResult:
    """The prefill of a context: per layer post-RoPE K, V ``[n_kv, n, d]`` and
    Q ``[n_q, n, d]`` (bf16, CPU), and the time it took."""

    k: List[torch.Tensor]
    v: List[torch.Tensor]
    q: List[torch.Tensor]
    seconds: float
    cache: Any = None  # the model's cache after the prefill (for generate_dense)


@torch.no_grad()
def prefill(model: Any, input_ids: Sequence[int], keep_cache: bool = False,
            chunk: int = 4096) -> PrefillResult:
    """Runs the model over ``input_ids`` (in chunks of ``chunk`` tokens) and
    captures every layer's post-RoPE Q (through a pre-hook on the attention
    module, recomputing its projection and RoPE) and K/V (from the cache)."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dev = next(model.parameters()).device
    layers = _layers(model)
    qs: List[List[torch.Tensor]] = [[] for _ in layers]
    hooks = []

    def make_hook(i: int, attn: Any) -> Any:
        def hook(module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = hidden.shape
            q = module.q_proj(hidden).view(b, t, -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            qs[i].append(q[0].to("cpu", torch.bfloat16))
        return attn.register_forward_pre_hook(hook, with_kwargs=True)

    for i, layer in enumerate(layers):
        hooks.append(make_hook(i, layer.self_attn))
    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=dev)[None]
    cache = DynamicCache()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        for s in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True)
    finally:
        for hk in hooks:
            hk.remove()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    ks, vs = [], []
    for i in range(len(layers)):
        k, v = _cache_kv(cache, i)
        ks.append(k[0].to("cpu", torch.bfloat16))
        vs.append(v[0].to("cpu", torch.bfloat16))
    q_all = [torch.cat(x, dim=1) for x in qs]
    return PrefillResult(ks, vs, q_all, secs, cache if keep_cache else None)


def _cache_kv(cache: Any, layer: int) -> tuple:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def prefill_and_ingest(client: Any, model: Any, context_ids: Sequence[int], *,
                       name: str = "hf-context", model_name: str = "",
                       indexes: Any = None, keep_cache: bool = False) -> tuple:
    """Prefills ``context_ids`` with ``model`` and ingests the KV (and Q) into
    ctxcache. Returns ``(ContextInfo, PrefillResult)``; the result carries
    ``ingest_s``, the ingest's wall time."""
    pre = prefill(model, context_ids, keep_cache=keep_cache)
    spec = model_spec(model, model_name or "hf:" + str(getattr(model.config, "_name_or_path",
                                                                  "model")).split("/")[-1])
    t0 = time.perf_counter()
    info = client.ingest(spec, list(context_ids),
                         ((pre.k[i], pre.v[i], pre.q[i]) for i in range(len(pre.k))),
                         indexes=indexes, name=name)
    pre.ingest_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    return info, pre


# ------------------------------------------------------------------ decode --

@dataclass
class GenerateResult:
    tokens: List[int] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)  # per step, float32 CPU
    step_s: List[float] = field(default_factory=list)
    bytes_received: int = 0
    appended_tokens: int = 0  # tokens the session received with Append
    pool_hits: int = 0        # generate_client: pages found in / fetched into the pool
    pool_misses: int = 0
    prefetch_hits: int = 0    # generate_client(prefetch=True): missing pages a prefetch brought
    ttft_s: float = 0.0       # generate_client: index fetch + set-up + first step


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


class LibrarySession:
    """A decode session of the native library (:class:`ctxcache.native.DecodeSession`:
    the C++ session core, in this process with ``client_mode``) with the
    interface the decoder reads from a :class:`ctxcache.Session`: ``step``
    takes the queries as a tensor and returns the kv heads (``ids``,
    ``per_q_head``, ``k``, ``v``) as ``heads``; ``append`` takes tensors
    (any device and float dtype) and returns the new ``n_tokens``. A step's
    ``bytes_received`` is the page payload the library fetched for it (pages
    found in its page cache cost none). Closing closes the session (and
    ``owner``, if given: the :class:`ctxcache.native.NativeClient` made for
    it)."""

    inline_append = True  # the decoder appends before the next step, on its own thread

    def __init__(self, session: Any, owner: Any = None) -> None:
        self.session = session
        self.owner = owner

    def step(self, layer: int, queries: Any) -> Any:
        q = queries.detach().float().cpu().numpy() if hasattr(queries, "detach") else queries
        heads = self.session.step(layer, q)
        return _LibraryStep(heads, self.session.last_step["bytes_received"])

    def append(self, k: Any, v: Any, q: Any = None, token_id: int = 0) -> int:
        """``token_id`` is not sent (the C ABI's Append takes K, V, Q only)."""
        rows = [x.detach().float().cpu().numpy() if hasattr(x, "detach") else x
                for x in (k, v, q)]
        self.session.append(*rows)
        return self.session.n_tokens

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            if self.owner is not None:
                self.owner.close()


@dataclass
class _LibraryStep:
    heads: List[Any]  # ctxcache.native.HeadStep per kv head
    bytes_received: int = 0


class _Decoder:
    """The state the registered attention function reads: the session (or
    the torch session's pooled attention, or the dense context KV), and the
    session that receives the generated tokens (``appender``)."""

    def __init__(self, session: Any = None, dense_kv: Optional[List[tuple]] = None,
                 appender: Any = None, n_context: int = 0, n_layers: int = 0,
                 pooled: Optional["PooledAttention"] = None) -> None:
        self.session = session    # a Session, or a LibrarySession: its steps' K/V
        self.dense_kv = dense_kv
        self.pooled = pooled      # a torch session's PooledAttention over a page pool
        self.prefetch = False     # speculative next-layer prefetch into it (_prefetch_hooks)
        self.appender = appender  # a Session (or LibrarySession): Append per generated token
        self.n_context = n_context
        self.queries: List[Optional[torch.Tensor]] = [None] * n_layers
        self.bytes_received = 0
        self.appended = 0  # the appender's n_tokens after the last Append


def _ctxcache_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple:
    # The decode's state comes with the forward (a model kwarg that HF passes
    # down to every attention call): no process-global state, so decodes on
    # several models or threads do not see each other's.
    dec = kwargs.get("ctxcache_decoder")
    if not isinstance(dec, _Decoder):
        raise ValueError("the 'ctxcache' attention needs the forward's ctxcache_decoder "
                         "(it runs inside ctxcache.torch.hf's generate functions only)")
    if query.shape[0] != 1 or query.shape[2] != 1:
        raise ValueError("ctxcache attention decodes one token of one sequence at a time")
    layer = module.layer_idx
    q = query[0, :, 0, :]  # [n_q, d]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    n_q = q.shape[0]
    if dec.appender is not None:
        dec.queries[layer] = q
    if dec.session is not None:
        step = dec.session.step(layer, q.float().cpu().numpy())
        dec.bytes_received += step.bytes_received
        ks, vs, masks = gather_selected(step, n_q, q.device, torch.float32, dec.n_context)
    elif dec.pooled is not None:
        before = dec.pooled.pool.bytes_fetched
        out = dec.pooled(layer, q, key, value, scale)
        dec.bytes_received += dec.pooled.pool.bytes_fetched - before
        return out.to(query.dtype)[None, None], None
    else:
        ks, vs = dec.dense_kv[layer]  # [n_kv, n, d] on the device
        masks = None
    with _stage("ctxcache.attend"):
        out = attend(q, ks, vs, masks, key[0], value[0], scale)  # [n_q, d]
    return out.to(query.dtype)[None, None], None  # [1, 1, n_q, d]


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


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register("ctxcache", _ctxcache_attention)


def _prefetch_hooks(model: Any, pooled: PooledAttention) -> List[Any]:
    """Speculative next-layer prefetch, InfiniGen-style: at the start of
    decoder layer l, layer l+1's queries are predicted from layer l's input
    (the residual stream changes little across a layer) through layer l+1's
    input norm, q projection and RoPE, and ``pooled.prefetch(l + 1, ...)``
    fetches the pages that prediction misses while layer l runs. Returns the
    hook handles (LLaMA-family decoder layers: ``input_layernorm``,
    ``self_attn.q_proj``, ``position_embeddings`` passed to the layer)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = _layers(model)

    def make(l: int) -> Any:
        nxt = layers[l + 1]

        def hook(module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            pe = kwargs.get("position_embeddings")
            if x is None or pe is None or x.shape[:2] != (1, 1):
                return
            attn = nxt.self_attn
            with _stage("ctxcache.predict"):
                q = attn.q_proj(nxt.input_layernorm(x)).view(1, 1, -1, attn.head_dim)
                q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), *pe)
                pooled.prefetch(l + 1, q[0, :, 0, :])
        return hook

    return [layers[l].register_forward_pre_hook(make(l), with_kwargs=True)
            for l in range(len(layers) - 1)]


@torch.no_grad()
def _decode(model: Any, dec: _Decoder, first_token: int, position: int, n_new: int,
            forced: Optional[Sequence[int]] = None) -> GenerateResult:
    from transformers import DynamicCache

    _register()
    dev = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.config._attn_implementation = "ctxcache"
    for layer in _layers(model):
        layer.self_attn.config._attn_implementation = "ctxcache"
    hooks = _prefetch_hooks(model, dec.pooled) if dec.pooled is not None and dec.prefetch else []
    res = GenerateResult()
    cache = DynamicCache()  # the generated tokens only
    token = int(first_token)
    n_layers = len(_layers(model))
    # Append runs on a worker thread, one in flight: a step does not wait for
    # its round trip; the next step (or the end) collects it and its errors.
    appends = ThreadPoolExecutor(max_workers=1) if dec.appender is not None else None
    pending: Optional[Future] = None
    try:
        for i in range(n_new):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            pos = torch.tensor([[position + i]], device=dev)
            out = model(input_ids=torch.tensor([[token]], device=dev), position_ids=pos,
                        cache_position=torch.tensor([i], device=dev), past_key_values=cache,
                        use_cache=True, ctxcache_decoder=dec)
            logits = out.logits[0, -1].float()
            if dec.appender is not None:  # the input token's K/V/Q go back to the session
                with _stage("ctxcache.append"):
                    kv = [_cache_kv(cache, l) for l in range(n_layers)]
                    rows = (torch.stack([k[0, :, -1] for k, _ in kv]),
                            torch.stack([v[0, :, -1] for _, v in kv]),
                            torch.stack([dec.queries[l] for l in range(n_layers)]))
                    if pending is not None:
                        dec.appended = pending.result()
                        pending = None
                    if getattr(dec.appender, "inline_append", False):
                        dec.appended = dec.appender.append(*rows, token_id=token)
                    else:
                        pending = appends.submit(dec.appender.append, *rows, token_id=token)
            next_token = int(torch.argmax(logits))
            next_input = int(forced[i]) if forced is not None else next_token
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res.step_s.append(time.perf_counter() - t0)
            res.logits.append(logits.cpu())
            res.tokens.append(next_token)
            token = next_input
        if pending is not None:
            dec.appended = pending.result()
    finally:
        for hook in hooks:
            hook.remove()
        if appends is not None:
            appends.shutdown(wait=True)
        model.config._attn_implementation = previous
        for layer in _layers(model):
            layer.self_attn.config._attn_implementation = previous
    res.bytes_received = dec.bytes_received
    res.appended_tokens = dec.appended - position if dec.appender is not None else 0
    return res


def generate(client: Any, model: Any, info: Any, first_token: int, n_new: int, *,
             method: str = "csa", params: Optional[Dict[str, Any]] = None,
             forced: Optional[Sequence[int]] = None, append: bool = True) -> GenerateResult:
    """Greedy decoding of ``n_new`` tokens after the context ``info``
    (``first_token`` goes at position ``info.n_tokens``), with ``method``'s
    selection done by ctxcache (a server-side session) at every layer-step.
    ``forced``: teacher forcing, step i+1 is fed forced[i] (the argmax is
    still what ``tokens`` records), for agreement measurements.
    ``append``: stream each step's input token (K/V/Q of every layer) back
    to the session with Append, so its indexes keep up; its selections of
    appended tokens are ignored (they are attended from the model's cache).
    Appends run on a worker thread, at most one in flight (a step does not
    wait for its round trip); an Append's error is raised at the next step."""
    with client.open_session(info.context_id, method=method, params=params or {}) as s:
        dec = _Decoder(session=s, appender=s if append else None,
                       n_context=int(info.n_tokens), n_layers=int(info.model.n_layers))
        return _decode(model, dec, first_token, int(info.n_tokens), n_new, forced)


def fetch_context_keys(client: Any, info: Any, device: Any = "cpu") -> torch.Tensor:
    """The context's stored keys, ``[n_layers, n_kv_heads, n_tokens, d]``
    float32 on ``device`` (bf16 widened exactly), read with
    ``Client.fetch_pages``: what the oracle scores (the whole KV's keys pass
    through the host once)."""
    m = info.model
    n = int(info.n_tokens)
    b = int(getattr(info, "block_tokens", 0) or 16)
    n_pages = (n + b - 1) // b
    out = torch.zeros(int(m.n_layers), int(m.n_kv_heads), n, int(m.head_dim),
                      dtype=torch.float32)
    for layer in range(int(m.n_layers)):
        pages = client.fetch_pages(info.context_id, [(layer, h, list(range(n_pages)))
                                                     for h in range(int(m.n_kv_heads))])
        for p in pages:
            out[layer, p.kv_head, p.block * b:p.block * b + p.n_tokens] = torch.as_tensor(p.k)
    return out.to(device)


def generate_client(client: Any, model: Any, info: Any, first_token: int, n_new: int, *,
                    params: Optional[Dict[str, Any]] = None,
                    forced: Optional[Sequence[int]] = None,
                    pool_bytes: int = 1 << 30, selection: str = "torch",
                    append: bool = True, method: str = "csa",
                    keys: Optional[torch.Tensor] = None,
                    warm_pool: bool = False, prefetch: bool = False,
                    native: Any = None) -> GenerateResult:
    """As :func:`generate`, but selecting on the client.

    selection: ``"torch"`` runs the session core as tensor ops on the
    model's device (``ctxcache.torch.gpu_session.torch_session``) and reads
    pages from a :class:`GpuPagePool` that fetches only pages it does not
    hold (no round trip per layer-step once the pool is warm), with the pool
    lookup and the attention in :class:`PooledAttention` (on a GPU two CUDA
    graph replays and one host sync per layer-step); csa's and oracle's
    float sums run in another order than the server's, so a near-tie may
    resolve differently; quest and streaming are exact. It selects over the
    stored context. ``"exact"`` runs the C++ session core in this process
    through the native library (a client-mode
    :class:`ctxcache.native.DecodeSession`, :class:`LibrarySession`): the
    server's selections exactly, its pages from the library's page cache
    (FetchPages), one layer-step on the CPU per call.

    method: ``csa``, ``quest``, ``streaming`` or ``oracle`` with ``"torch"``
    (ValueError for another), any method of :data:`ctxcache.native.SESSION_METHODS`
    with ``"exact"``; selected from the artifacts FetchIndex returns for it.
    ``oracle`` scores every stored key: with ``"torch"``, ``keys``
    ``[n_layers, n_kv_heads, n_tokens, d]`` (default: read once with
    :func:`fetch_context_keys`, so the keys are resident on the device);
    ``"exact"`` reads them through its page fetcher (``keys`` is a
    ValueError).
    append: the generated tokens go to a server session of ``method`` with
    Append, one round trip per token, as a worker that shares its tokens
    does. ``"torch"``: a session of its own, opened by the server while the
    client sets up, Appends on a worker thread (one in flight). ``"exact"``:
    the library session itself, which sends each Append to the server and
    adds the token to its selectors before the next step, as the server's
    session does (so its selections follow the server's with appends too).
    warm_pool: load every page of the context into the pool before the first
    step (:meth:`GpuPagePool.load_all`; the pool must hold them all), as a
    worker keeping a hot context resident; the load counts in ``ttft_s`` and
    in the pool's misses. ``"torch"`` only.
    prefetch: speculative next-layer prefetch (``"torch"`` only; see
    :func:`_prefetch_hooks`): each layer's likely misses are fetched while
    the layer before it runs; ``prefetch_hits`` in the result.
    native: the :class:`ctxcache.native.NativeClient` of ``"exact"``
    (default: one to ``client.address`` with ``$CTXCACHE_API_KEY``, closed at
    the end; pass one for TLS or other options).
    The result carries ``pool_hits``, ``pool_misses`` (with ``"exact"``: the
    library's page cache look-ups), ``bytes_received`` and ``ttft_s`` (from the call to the first token:
    index fetch, set-up, the Append session's open, the first step)."""
    from ctxcache import native as native_lib
    from ctxcache.torch.gpu_session import TORCH_SESSIONS, torch_session

    if selection not in ("torch", "exact"):
        raise ValueError(f"selection '{selection}', expected 'torch' or 'exact'")
    known = TORCH_SESSIONS if selection == "torch" else native_lib.SESSION_METHODS
    if method not in known:
        raise ValueError(f"method '{method}' has no client-side selection "
                         f"(selection='{selection}'); expected one of {', '.join(known)}")
    if keys is not None and method != "oracle":
        raise ValueError(f"keys are for method oracle, not {method}")
    if selection == "exact":
        for name, on in (("prefetch", prefetch), ("warm_pool", warm_pool)):
            if on:
                raise ValueError(f"{name} needs selection='torch', not 'exact'")
        if keys is not None:
            raise ValueError("keys are for selection='torch'; selection='exact' scores the "
                             "stored keys in the C++ session core")
        return _generate_library(client, model, info, first_token, n_new, params, forced,
                                 append, method, native)
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    opener = ThreadPoolExecutor(max_workers=1)
    # The server opens the Append session while the client sets up.
    opening = opener.submit(client.open_session, info.context_id, method=method,
                            params=params or {}) if append else None
    session = None
    dec: Optional[_Decoder] = None
    try:
        arts = client.fetch_index(info.context_id, method)
        n_q = int(info.model.n_q_heads)
        n_layers = int(info.model.n_layers)
        if method == "oracle" and keys is None:
            keys = fetch_context_keys(client, info, dev)
        pool = GpuPagePool(client, info, dev, pool_bytes)
        planner = torch_session(method, arts, n_q_heads=n_q, params=params or {},
                                device=dev, keys=keys)
        dec = _Decoder(pooled=PooledAttention(planner, pool, capacity=n_new,
                                              cuda_graphs=dev.type == "cuda"),
                       n_layers=n_layers)
        dec.n_context = int(info.n_tokens)
        dec.prefetch = prefetch
        if warm_pool:
            pool.load_all()
        session = opening.result() if opening is not None else None
        setup_s = time.perf_counter() - t0
        dec.appender = session
        res = _decode(model, dec, first_token, int(info.n_tokens), n_new, forced)
    finally:
        if dec is not None and dec.pooled is not None:
            dec.pooled.close()
        if opening is not None and session is None and opening.exception() is None:
            opening.result().close()  # set-up failed after the session opened
        opener.shutdown(wait=True)
        if session is not None:
            session.close()
    res.pool_hits, res.pool_misses = pool.hits, pool.misses
    res.prefetch_hits = pool.prefetch_hits
    res.ttft_s = setup_s + (res.step_s[0] if res.step_s else 0.0)
    return res


def _generate_library(client: Any, model: Any, info: Any, first_token: int, n_new: int,
                      params: Optional[Dict[str, Any]], forced: Optional[Sequence[int]],
                      append: bool, method: str, native: Any) -> GenerateResult:
    """:func:`generate_client` with ``selection="exact"``: the C++ session
    core through the native library (a client-mode session) selects, and its
    steps' K/V are attended like a server session's (:func:`generate`)."""
    from ctxcache import native as native_lib

    t0 = time.perf_counter()
    owner = None
    if native is None:
        native = owner = native_lib.NativeClient(client.address)
    try:
        lib = LibrarySession(native.open_session(info.context_id, method, params or {},
                                                 client_mode=True), owner)
    except BaseException:
        if owner is not None:
            owner.close()
        raise
    with contextlib.closing(lib):
        dec = _Decoder(session=lib, appender=lib if append else None,
                       n_context=int(info.n_tokens), n_layers=int(info.model.n_layers))
        setup_s = time.perf_counter() - t0
        res = _decode(model, dec, first_token, int(info.n_tokens), n_new, forced)
        cache = lib.session.page_cache_stats()  # the library's page cache is its pool
        res.pool_hits, res.pool_misses = cache["hits"], cache["misses"]
    res.ttft_s = setup_s + (res.step_s[0] if res.step_s else 0.0)
    return res


def generate_dense(model: Any, pre: PrefillResult, first_token: int, n_new: int,
                   forced: Optional[Sequence[int]] = None) -> GenerateResult:
    """The same decoding with dense attention over the prefill's KV (as
    ctxcache stores it: bf16), through the same attention code."""
    dev = next(model.parameters()).device
    kv = [(pre.k[i].to(dev, torch.float32), pre.v[i].to(dev, torch.float32))
          for i in range(len(pre.k))]
    return _decode(model, _Decoder(dense_kv=kv), first_token, int(pre.k[0].shape[1]), n_new,
                   forced)
