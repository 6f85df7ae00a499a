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

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["attend", "gather_selected", "pad_heads", "model_spec", "prefill", "prefill_and_ingest",
           "generate", "generate_client", "generate_dense", "GenerateResult", "GpuPagePool",
           "PrefillResult"]


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
           scale: float) -> torch.Tensor:
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

    Attributes: hits, misses (pages), bytes_fetched.
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
        self._stamp = torch.full((n_slots,), -1, **i64)
        self._clock = 0
        self.hits = self.misses = self.bytes_fetched = 0

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
        dev = self.k.device
        pages = pages.to(dev)
        valid = valid.to(dev)
        h = torch.arange(pages.shape[0], device=dev).view(-1, 1)
        keys = self._key(layer, h, pages.clamp(0, max(0, self.n_pages - 1)))
        need = int(valid.sum())
        if need > self.n_slots:
            raise ValueError(f"GpuPagePool: a layer-step needs {need} pages, the pool holds "
                             f"{self.n_slots}; raise budget_bytes")
        self._clock += 1
        slots = self._slot_of[keys]
        miss = valid & (slots < 0)
        self._stamp[slots[valid & ~miss]] = self._clock
        miss_keys = keys[miss]  # row-major: by kv head, then position
        n_miss = int(miss_keys.numel())
        self.hits += need - n_miss
        if n_miss:
            with _stage("ctxcache.pool_fill"):
                self._fill(layer, miss_keys)
            slots = self._slot_of[keys]
        return torch.where(valid, slots, torch.zeros_like(slots))

    def _fill(self, layer: int, miss_keys: torch.Tensor) -> None:
        n_miss = int(miss_keys.numel())
        host = miss_keys.cpu().tolist()
        by_head: Dict[int, List[int]] = {}
        for key in host:
            by_head.setdefault((key // self.n_pages) % self.n_kv_heads, []).append(
                key % self.n_pages)
        wire = self.client.fetch_wire_pages(
            self.context_id, [(layer, hh, sorted(b)) for hh, b in sorted(by_head.items())])
        if len(wire) != n_miss:
            raise RuntimeError(f"GpuPagePool: asked for {n_miss} pages, got {len(wire)}")
        kv = self._checked_rows(wire)  # [n_miss, 2, block, d] on the device
        # Victims: free slots first, then the least recently used; the slots
        # this lookup uses carry the newest stamp, and need <= n_slots.
        victims = torch.topk(self._stamp, n_miss, largest=False).indices
        old = self._page_of[victims]
        self._slot_of[old[old >= 0]] = -1
        self.k[victims] = kv[:, 0]
        self.v[victims] = kv[:, 1]
        new = torch.tensor([self._key(layer, int(p.kv_head), int(p.block)) for p in wire],
                           dtype=torch.int64, device=self.k.device)
        self._page_of[victims] = new
        self._slot_of[new] = victims
        self._stamp[victims] = self._clock
        self.misses += n_miss
        self.bytes_fetched += sum(len(p.k) + len(p.v) for p in wire)

    def _checked_rows(self, wire: Sequence[Any]) -> torch.Tensor:
        """The K and V of wire pages as ``[n, 2, block, d]`` in the pool's
        dtype on its device (a partial page zero-padded), each page's crc32c
        checked: on the device for full pages when it is a GPU (one bulk copy,
        ``crc32c_rows_torch``), else on the host. DataLoss for a bad crc, size
        or dtype."""
        from ctxcache import errors
        from ctxcache import tensors as _t
        from ctxcache.client import check_page_crcs, page_crc_error

        dev = self.k.device
        n, (b, d) = len(wire), self.k.shape[1:]
        wdt = int(wire[0].dtype)
        item = _t._ITEMSIZE.get(wdt)
        if item is None or any(int(p.dtype) != wdt for p in wire):
            raise errors.DataLoss("GpuPagePool: pages of unknown or mixed dtypes",
                                  rpc="FetchPages")
        page_bytes = b * d * item
        for p in wire:
            if not (0 < p.n_tokens <= b and len(p.k) == len(p.v) == p.n_tokens * d * item):
                raise errors.DataLoss(f"page of layer {p.layer}, kv head {p.kv_head}, block "
                                      f"{p.block} has the wrong size", rpc="FetchPages")
        full = all(p.n_tokens == b for p in wire)
        if full:  # each row is exactly the page's k || v: its crc is the page's
            blob = bytearray(b"".join(x for p in wire for x in (p.k, p.v)))
            rows = torch.frombuffer(blob, dtype=torch.uint8).view(n, 2 * page_bytes)
        else:
            rows = torch.zeros(n, 2 * page_bytes, dtype=torch.uint8)
            for i, p in enumerate(wire):
                rows[i, :len(p.k)] = torch.frombuffer(bytearray(p.k), dtype=torch.uint8)
                rows[i, page_bytes:page_bytes + len(p.v)] = torch.frombuffer(
                    bytearray(p.v), dtype=torch.uint8)
        rows = rows.to(dev)
        if full and dev.type == "cuda":
            from ctxcache.crc32c import crc32c_rows_torch

            want = torch.tensor([p.crc32c for p in wire], dtype=torch.int64, device=dev)
            bad = torch.nonzero(crc32c_rows_torch(rows) != want)
            if bad.numel():
                raise page_crc_error(wire[int(bad[0, 0])], rpc="FetchPages")
        else:
            check_page_crcs(wire, rpc="FetchPages")
        tdt = {_t._st.DTYPE_BF16: torch.bfloat16, _t._st.DTYPE_F16: torch.float16,
               _t._st.DTYPE_F32: torch.float32}[wdt]
        return rows.view(tdt).view(n, 2, b, d).to(self.k.dtype)

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


class _Decoder:
    """The state the registered attention function reads: the session (or
    the client-side selector and page pool, or the dense context KV), and
    the session that receives the generated tokens (``appender``)."""

    def __init__(self, session: Any = None, dense_kv: Optional[List[tuple]] = None,
                 selector: Any = None, pool: Optional[GpuPagePool] = None,
                 planner: Any = None, appender: Any = None, n_context: int = 0,
                 n_layers: int = 0) -> None:
        self.session = session
        self.dense_kv = dense_kv
        self.selector = selector  # numpy ClientSession (any client-side method)
        self.planner = planner    # a torch session (gpu_session.torch_session)
        self.pool = pool
        self.appender = appender  # a Session: Append per generated token
        self.n_context = n_context
        self.queries: List[Optional[torch.Tensor]] = [None] * n_layers
        self.bytes_received = 0
        self.appended = 0  # the appender's n_tokens after the last Append


_ACTIVE: List[_Decoder] = []


def _ctxcache_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple:
    dec = _ACTIVE[-1]
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
    elif dec.selector is not None:
        ks, vs, masks = _client_step(dec, layer, q)
    elif dec.planner is not None:
        ks, vs, masks = _planned_step(dec, layer, q)
    else:
        ks, vs = dec.dense_kv[layer]  # [n_kv, n, d] on the device
        masks = None
    with _stage("ctxcache.attend"):
        out = attend(q, ks, vs, masks, key[0], value[0], scale)  # [n_q, d]
    return out.to(query.dtype)[None, None], None  # [1, 1, n_q, d]


def _pool_kv(dec: _Decoder, layer: int, pages: torch.Tensor, valid: torch.Tensor) -> tuple:
    """``[H, P * block, d]`` K and V of each kv head's pages from the GPU
    page pool (which fetches the missing ones); adds the fetched bytes to
    the decoder's count."""
    before = dec.pool.bytes_fetched
    with _stage("ctxcache.pool"):
        k, v = dec.pool.gather(layer, pages, valid)
    dec.bytes_received += dec.pool.bytes_fetched - before
    return k, v


def _client_step(dec: _Decoder, layer: int, q: torch.Tensor) -> tuple:
    """Client-side selection (ctxcache.torch.selection, the server's
    pipeline) and the selected pages from the GPU page pool."""
    b = dec.pool.block
    steps = dec.selector.step(layer, q.float().cpu().numpy(), as_torch=False)
    by_head = [[int(x) for x in st.pages] for st in steps]
    pages, valid = _pad_pages(by_head, q.device)
    k, v = _pool_kv(dec, layer, pages, valid)
    mask = np.zeros((len(steps), len(steps[0].per_q_head), k.shape[1]), dtype=bool)
    for h, st in enumerate(steps):
        pg = np.asarray(st.pages, dtype=np.int64)
        for j, ids in enumerate(st.per_q_head):
            ids = np.asarray(ids, dtype=np.int64)
            mask[h, j, np.searchsorted(pg, ids // b) * b + ids % b] = True
    return k, v, torch.as_tensor(mask).to(q.device)


def _planned_step(dec: _Decoder, layer: int, q: torch.Tensor) -> tuple:
    """Client-side selection as tensor ops on the device
    (ctxcache.torch.gpu_session) and the selected pages read from the GPU
    page pool; host syncs: the page count and the pool's miss list."""
    with _stage("ctxcache.plan"):
        plan = dec.planner.step(layer, q)
    h, n_pages = plan.pages.shape
    counts = plan.pages.sum(dim=1)
    p = int(counts.max())
    # Each head's pages ascending, first: a stable sort of the page flags.
    pages = torch.sort(plan.pages.to(torch.int8), dim=1, descending=True,
                       stable=True).indices[:, :p]
    valid = torch.arange(p, device=q.device).view(1, -1) < counts.view(-1, 1)
    k, v = _pool_kv(dec, layer, pages, valid)
    tok = dec.planner.by_page(plan.token_mask)  # [H, G, n_pages, block]
    g, b = tok.shape[1], tok.shape[3]
    mask = tok.gather(2, pages.view(h, 1, p, 1).expand(h, g, p, b))
    mask = mask & valid.view(h, 1, p, 1)
    return k, v, mask.reshape(h, g, p * b)


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register("ctxcache", _ctxcache_attention)


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
    _ACTIVE.append(dec)
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
                        use_cache=True)
            logits = out.logits[0, -1].float()
            if dec.appender is not None:  # the input token's K/V/Q go back to the session
                with _stage("ctxcache.append"):
                    kv = [_cache_kv(cache, l) for l in range(n_layers)]
                    rows = (torch.stack([k[0, :, -1] for k, _ in kv]),
                            torch.stack([v[0, :, -1] for _, v in kv]),
                            torch.stack([dec.queries[l] for l in range(n_layers)]))
                    if pending is not None:
                        dec.appended = pending.result()
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
        if appends is not None:
            appends.shutdown(wait=True)
        _ACTIVE.pop()
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
                    warm_pool: bool = False) -> GenerateResult:
    """As :func:`generate`, but selecting on the client and reading pages
    from a :class:`GpuPagePool` that fetches only pages it does not hold: no
    round trip per layer-step once the pool is warm.

    method: ``csa``, ``quest``, ``streaming`` or ``oracle`` (the methods with
    a client-side selection; ValueError for another), selected from the
    artifacts FetchIndex returns for it. ``oracle`` scores every stored key:
    ``keys`` ``[n_layers, n_kv_heads, n_tokens, d]`` (default: read once with
    :func:`fetch_context_keys`, so the keys are resident on the device).
    selection: ``"torch"`` runs the session core as tensor ops on the
    model's device (``ctxcache.torch.gpu_session.torch_session``, one CUDA
    graph per layer on a GPU; csa's and
    oracle's float sums run in another order than the server's, so a
    near-tie may resolve differently; quest and streaming are exact);
    ``"exact"`` runs the numpy copy of the C++ core
    (``ctxcache.torch.selection.ClientSession``: the server's selections
    exactly, on the CPU). Both select over the stored context.
    append: the generated tokens go to a server session of ``method`` with
    Append, one round trip per token (on a worker thread, one in flight), as
    a worker that shares its tokens does; the server opens that session while
    the client sets up.
    warm_pool: load every page of the context into the pool before the first
    step (:meth:`GpuPagePool.load_all`; the pool must hold them all), as a
    worker keeping a hot context resident; the load counts in ``ttft_s`` and
    in the pool's misses.
    The result carries ``pool_hits``, ``pool_misses`` and ``ttft_s`` (from the
    call to the first token: index fetch, set-up, the Append session's open,
    the first step)."""
    from ctxcache.torch.gpu_session import TORCH_SESSIONS, torch_session
    from ctxcache.torch.selection import METHODS, ClientSession

    if selection not in ("torch", "exact"):
        raise ValueError(f"selection '{selection}', expected 'torch' or 'exact'")
    known = TORCH_SESSIONS if selection == "torch" else METHODS
    if method not in known:
        raise ValueError(f"method '{method}' has no client-side selection "
                         f"(selection='{selection}'); expected one of {', '.join(known)}")
    if keys is not None and method != "oracle":
        raise ValueError(f"keys are for method oracle, not {method}")
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    opener = ThreadPoolExecutor(max_workers=1)
    # The server opens the Append session while the client sets up.
    opening = opener.submit(client.open_session, info.context_id, method=method,
                            params=params or {}) if append else None
    session = None
    try:
        arts = client.fetch_index(info.context_id, method)
        n_q = int(info.model.n_q_heads)
        n_layers = int(info.model.n_layers)
        if method == "oracle" and keys is None:
            keys = fetch_context_keys(client, info, dev if selection == "torch" else "cpu")
        if selection == "torch":
            dec = _Decoder(planner=torch_session(method, arts, n_q_heads=n_q,
                                                 params=params or {}, device=dev, keys=keys,
                                                 cuda_graphs=dev.type == "cuda"),
                           n_layers=n_layers)
        else:
            dec = _Decoder(selector=ClientSession(arts, n_q_heads=n_q, params=params or {},
                                                  method=method,
                                                  keys=None if keys is None else keys.cpu()),
                           n_layers=n_layers)
        dec.n_context = int(info.n_tokens)
        pool = GpuPagePool(client, info, dev, pool_bytes)
        if warm_pool:
            pool.load_all()
        dec.pool = pool
        session = opening.result() if opening is not None else None
        setup_s = time.perf_counter() - t0
        dec.appender = session
        res = _decode(model, dec, first_token, int(info.n_tokens), n_new, forced)
    finally:
        if opening is not None and session is None and opening.exception() is None:
            opening.result().close()  # set-up failed after the session opened
        opener.shutdown(wait=True)
        if session is not None:
            session.close()
    res.pool_hits, res.pool_misses = pool.hits, pool.misses
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
