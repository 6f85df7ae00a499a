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
model's own decode cache, dense, on the GPU; they are not appended to the
session, so the stored index covers the context only). ``method="full"``
selects every context token: it must decode exactly like dense attention
over the same KV, which ``generate_dense`` computes with the same attention
code (``attend``) over the prefill cache.

Needs torch and, for the model parts, transformers (>= 4.48, the attention
interface); ``attend`` and ``gather_selected`` need torch only.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["attend", "gather_selected", "model_spec", "prefill", "prefill_and_ingest",
           "generate", "generate_client", "generate_dense", "GenerateResult", "GpuPagePool",
           "PrefillResult"]


# ---------------------------------------------------------------- attention --

def attend(q: torch.Tensor, ctx_k: Sequence[torch.Tensor], ctx_v: Sequence[torch.Tensor],
           ctx_mask: Optional[Sequence[Optional[torch.Tensor]]], dec_k: torch.Tensor,
           dec_v: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token's attention, one matmul per kv head.

    Args:
        q: ``[n_q_heads, d]`` post-RoPE queries.
        ctx_k, ctx_v: per kv head, the ``[n_h, d]`` K/V of the context tokens
            its group of query heads attends to (the union of their
            selections, or all).
        ctx_mask: per kv head, ``[g, n_h]`` bool: which of those rows each
            query head of the group selected (None = all rows, for every head).
        dec_k, dec_v: ``[n_kv_heads, t, d]`` K/V of the decoded tokens so far
            (including the current one), attended by every head of the group.
        scale: the softmax scale (1/sqrt(d) unless the model says otherwise).

    Returns:
        ``[n_q_heads, d]`` in float32: per query head, softmax over its
        selected context rows and the decoded tokens.
    """
    n_q, n_kv = q.shape[0], dec_k.shape[0]
    g = n_q // n_kv
    out = torch.empty(n_q, q.shape[1], dtype=torch.float32, device=q.device)
    qf = q.float()
    for h in range(n_kv):
        n_ctx = ctx_k[h].shape[0]
        k = torch.cat([ctx_k[h].float(), dec_k[h].float()], dim=0)
        v = torch.cat([ctx_v[h].float(), dec_v[h].float()], dim=0)
        logits = (qf[h * g:(h + 1) * g] @ k.T) * scale  # [g, n_ctx + t]
        mask = ctx_mask[h] if ctx_mask is not None else None
        if mask is not None and n_ctx:
            logits[:, :n_ctx].masked_fill_(~mask, float("-inf"))
        out[h * g:(h + 1) * g] = torch.softmax(logits, dim=-1) @ v
    return out


def gather_selected(step: Any, n_q_heads: int, device: Any, dtype: Any) -> tuple:
    """From a :class:`ctxcache.StepResult` (server-side selection): per kv
    head the K/V rows of the union of its query heads' selections and the
    ``[g, n_h]`` mask of each query head's own rows, on ``device``."""
    ks: List[torch.Tensor] = []
    vs: List[torch.Tensor] = []
    masks: List[torch.Tensor] = []
    g = n_q_heads // len(step.heads)
    for head in step.heads:
        union = np.asarray(head.ids)
        mask = np.zeros((g, union.size), dtype=bool)
        for j in range(g):
            mask[j, np.searchsorted(union, np.asarray(head.per_q_head[j]))] = True
        ks.append(torch.as_tensor(np.asarray(head.k)).to(device=device, dtype=dtype))
        vs.append(torch.as_tensor(np.asarray(head.v)).to(device=device, dtype=dtype))
        masks.append(torch.as_tensor(mask).to(device))
    return ks, vs, masks


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


class GpuPagePool:
    """Stored KV pages of one context on the GPU, by (layer, kv head, block),
    least recently used first out, under a byte budget. ``ensure`` fetches
    the missing pages of a layer in one FetchPages call.

    Attributes: hits, misses (pages), bytes_fetched.
    """

    def __init__(self, client: Any, context_id: str, block: int, head_dim: int, device: Any,
                 budget_bytes: int = 1 << 30, dtype: Any = torch.bfloat16) -> None:
        per_page = 2 * block * head_dim * torch.tensor([], dtype=dtype).element_size()
        n_slots = max(1, int(budget_bytes) // per_page)
        self.client, self.context_id, self.block = client, context_id, block
        self.k = torch.zeros(n_slots, block, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self._slot: "OrderedDict[Tuple[int, int, int], int]" = OrderedDict()
        self._free = list(range(n_slots))
        self.hits = self.misses = self.bytes_fetched = 0

    @property
    def n_slots(self) -> int:
        return self.k.shape[0]

    def ensure(self, layer: int, blocks_by_head: Dict[int, Sequence[int]]) -> Dict[int, torch.Tensor]:
        """The slots of each kv head's ``blocks`` (in that order), fetching the
        missing pages. A layer needing more pages than the pool holds is a
        ValueError (raise the budget)."""
        need = sum(len(b) for b in blocks_by_head.values())
        if need > self.n_slots:
            raise ValueError(f"GpuPagePool: a layer-step needs {need} pages, the pool holds "
                             f"{self.n_slots}; raise budget_bytes")
        keep = {(layer, h, int(b)) for h, bl in blocks_by_head.items() for b in bl}
        missing: Dict[int, List[int]] = {}
        for key in keep:
            if key in self._slot:
                self._slot.move_to_end(key)
                self.hits += 1
            else:
                missing.setdefault(key[1], []).append(key[2])
        if missing:
            tables = [(layer, h, sorted(bl)) for h, bl in missing.items()]
            pages = self.client.fetch_pages(self.context_id, tables, dtype="raw", as_torch=True)
            for p in pages:
                key = (layer, int(p.kv_head), int(p.block))
                if self._free:
                    slot = self._free.pop()
                else:  # evict the least recently used page not needed now
                    victim = next(k for k in self._slot if k not in keep)
                    slot = self._slot.pop(victim)
                n = int(p.n_tokens)
                self.k[slot, :n].copy_(p.k.view(n, -1), non_blocking=True)
                self.v[slot, :n].copy_(p.v.view(n, -1), non_blocking=True)
                self._slot[key] = slot
                self.misses += 1
                self.bytes_fetched += 2 * p.k.numel() * p.k.element_size()
        dev = self.k.device
        return {h: torch.tensor([self._slot[(layer, h, int(b))] for b in bl], dtype=torch.long,
                                device=dev)
                for h, bl in blocks_by_head.items()}


class _Decoder:
    """The state the registered attention function reads: the session (or
    the client-side selector and page pool, or the dense context KV)."""

    def __init__(self, session: Any = None, dense_kv: Optional[List[tuple]] = None,
                 selector: Any = None, pool: Optional[GpuPagePool] = None,
                 planner: Any = None) -> None:
        self.session = session
        self.dense_kv = dense_kv
        self.selector = selector  # numpy CsaSession
        self.planner = planner    # TorchCsaSession
        self.pool = pool
        self.bytes_received = 0


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
    if dec.session is not None:
        step = dec.session.step(layer, q.float().cpu().numpy())
        dec.bytes_received += step.bytes_received
        ks, vs, masks = gather_selected(step, n_q, q.device, torch.float32)
    elif dec.selector is not None:
        ks, vs, masks = _client_step(dec, layer, q)
    elif dec.planner is not None:
        ks, vs, masks = _planned_step(dec, layer, q)
    else:
        k_all, v_all = dec.dense_kv[layer]  # [n_kv, n, d] on the device
        ks, vs, masks = list(k_all), list(v_all), None
    out = attend(q, ks, vs, masks, key[0], value[0], scale)  # [n_q, d]
    return out.to(query.dtype)[None, None], None  # [1, 1, n_q, d]


def _client_step(dec: _Decoder, layer: int, q: torch.Tensor) -> tuple:
    """Client-side csa selection (ctxcache.torch.selection, the server's
    pipeline) and the selected pages from the GPU page pool."""
    b = dec.pool.block
    steps = dec.selector.step(layer, q.float().cpu().numpy(), as_torch=False)
    ks, vs = _pool_kv(dec, layer, {h: [int(x) for x in st.pages] for h, st in enumerate(steps)})
    masks = []
    for st in steps:
        pages = np.asarray(st.pages, dtype=np.int64)
        mask = np.zeros((len(st.per_q_head), pages.size * b), dtype=bool)
        for j, ids in enumerate(st.per_q_head):
            ids = np.asarray(ids, dtype=np.int64)
            mask[j, np.searchsorted(pages, ids // b) * b + ids % b] = True
        masks.append(torch.as_tensor(mask).to(q.device))
    return ks, vs, masks


def _planned_step(dec: _Decoder, layer: int, q: torch.Tensor) -> tuple:
    """Client-side csa selection as tensor ops on the device
    (ctxcache.torch.gpu_session) and the selected pages from the GPU page
    pool; one device-to-host copy per layer (the page ids, for the pool)."""
    plan = dec.planner.step(layer, q)
    n_kv = plan.pages.shape[0]
    pages = [plan.page_ids(h) for h in range(n_kv)]
    host = torch.cat(pages).cpu().tolist()
    by_head, at = {}, 0
    for h in range(n_kv):
        by_head[h] = host[at:at + pages[h].numel()]
        at += pages[h].numel()
    ks, vs = _pool_kv(dec, layer, by_head)
    tok = dec.planner.by_page(plan.token_mask)  # [H, G, n_pages, page]
    masks = [tok[h][:, pages[h]].reshape(tok.shape[1], -1) for h in range(n_kv)]
    return ks, vs, masks


def _pool_kv(dec: _Decoder, layer: int, by_head: Dict[int, List[int]]) -> tuple:
    """Per kv head (in key order), the K and V rows of its pages in the given
    order, from the GPU page pool, which fetches the missing ones; adds the
    fetched bytes to the decoder's count."""
    pool = dec.pool
    before = pool.bytes_fetched
    slots = pool.ensure(layer, by_head)
    dec.bytes_received += pool.bytes_fetched - before
    d = pool.k.shape[-1]
    return ([pool.k[slots[h]].reshape(-1, d) for h in sorted(by_head)],
            [pool.v[slots[h]].reshape(-1, d) for h in sorted(by_head)])


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
            token = int(torch.argmax(logits))
            next_input = int(forced[i]) if forced is not None else token
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res.step_s.append(time.perf_counter() - t0)
            res.logits.append(logits.cpu())
            res.tokens.append(token)
            token = next_input
    finally:
        _ACTIVE.pop()
        model.config._attn_implementation = previous
        for layer in _layers(model):
            layer.self_attn.config._attn_implementation = previous
    res.bytes_received = dec.bytes_received
    return res


def generate(client: Any, model: Any, info: Any, first_token: int, n_new: int, *,
             method: str = "csa", params: Optional[Dict[str, Any]] = None,
             forced: Optional[Sequence[int]] = None) -> GenerateResult:
    """Greedy decoding of ``n_new`` tokens after the context ``info``
    (``first_token`` goes at position ``info.n_tokens``), with ``method``'s
    selection done by ctxcache (a server-side session) at every layer-step.
    ``forced``: teacher forcing, step i+1 is fed forced[i] (the argmax is
    still what ``tokens`` records), for agreement measurements."""
    with client.open_session(info.context_id, method=method, params=params or {}) as s:
        return _decode(model, _Decoder(session=s), first_token, int(info.n_tokens), n_new, forced)


def generate_client(client: Any, model: Any, info: Any, first_token: int, n_new: int, *,
                    params: Optional[Dict[str, Any]] = None,
                    forced: Optional[Sequence[int]] = None,
                    pool_bytes: int = 1 << 30, selection: str = "torch") -> GenerateResult:
    """As :func:`generate` with csa, but selecting on the client and reading
    pages from a :class:`GpuPagePool` that fetches only pages it does not
    hold: no round trip per layer-step once the pool is warm.

    selection: ``"torch"`` runs the session core as tensor ops on the
    model's device (``ctxcache.torch.gpu_session.TorchCsaSession``; float
    sums in another order than the server's, so a near-tie may resolve
    differently); ``"exact"`` runs the numpy copy of the C++ core
    (``ctxcache.torch.selection.CsaSession``: the server's selections
    exactly, on the CPU)."""
    dev = next(model.parameters()).device
    arts = client.fetch_index(info.context_id, "csa")
    n_q = int(info.model.n_q_heads)
    if selection == "torch":
        from ctxcache.torch.gpu_session import TorchCsaSession
        dec = _Decoder(planner=TorchCsaSession(arts, n_q_heads=n_q, params=params or {},
                                               device=dev))
    elif selection == "exact":
        from ctxcache.torch.selection import CsaSession
        dec = _Decoder(selector=CsaSession(arts, n_q_heads=n_q, params=params or {}))
    else:
        raise ValueError(f"selection '{selection}', expected 'torch' or 'exact'")
    pool = GpuPagePool(client, info.context_id, int(info.block_tokens) or 16,
                       int(info.model.head_dim), dev, pool_bytes)
    dec.pool = pool
    res = _decode(model, dec, first_token, int(info.n_tokens), n_new, forced)
    res.pool_hits, res.pool_misses = pool.hits, pool.misses  # type: ignore[attr-defined]
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
