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

On a GPU, :func:`generate_engine` is the decode path: the stored context
bulk-loaded once into a pinned host tier, B sequences through the GPU engine
(:mod:`ctxcache.engine`: the Quest planner, an HBM page pool whose misses
are copied on the device, attention over pool pages in place), the model's
whole step as CUDA graph replays, no RPC while decoding. This module only
adapts the HF model to it (:class:`ctxcache.engine.LlamaStepper`).

Needs torch and, for the model parts, transformers (>= 4.48, the attention
interface); ``attend`` and ``gather_selected`` need torch only.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


__all__ = ["attend", "gather_selected", "pad_heads", "model_heads", "model_spec", "prefill",
           "prefill_and_ingest",
           "generate", "generate_client", "generate_dense", "generate_engine", "EngineDecoding",
           "EngineResult", "GenerateResult", "LibrarySession", "PrefillResult"]


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


def model_heads(model: Any) -> Tuple[int, int, int, int]:
    """An HF causal LM's attention shape from its (text) config: layers, q
    heads, kv heads, head_dim."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    n_q = int(cfg.num_attention_heads)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    return (int(cfg.num_hidden_layers), n_q, int(getattr(cfg, "num_key_value_heads", n_q)),
            int(d))


def model_spec(model: Any, name: str) -> Dict[str, Any]:
    """The ModelSpec of an HF LLaMA-family model for ``Client.ingest``: its
    shape, kv_dtype bf16, and a fingerprint = SHA-256 over the parameters
    (names and bytes, in name order), so different weights never share ids."""
    n_layers, n_q, n_kv, d = model_heads(model)
    h = hashlib.sha256()
    for pname, p in sorted(model.state_dict().items()):
        h.update(pname.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return {"name": name, "n_layers": n_layers, "n_q_heads": n_q, "n_kv_heads": n_kv,
            "head_dim": d, "kv_dtype": "bf16", "fingerprint": h.digest()}


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

    dev = next(model.parameters()).device
    layers = _layers(model)
    qs: List[List[torch.Tensor]] = [[] for _ in layers]
    hooks = _query_hooks(layers, lambda i, q: qs[i].append(q.to("cpu", torch.bfloat16)))
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


def _query_hooks(layers: Any, sink: Any) -> list:
    """Forward pre-hooks on every layer's attention that recompute its
    post-RoPE queries (the q projection and RoPE of the layer's input) and
    pass them to ``sink(layer, q [n_q_heads, T, d])`` on the device; the
    caller removes the returned handles."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def make_hook(i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = hidden.shape
            q = module.q_proj(hidden).view(b, t, -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            sink(i, q[0])
        return hook

    return [layer.self_attn.register_forward_pre_hook(make_hook(i), with_kwargs=True)
            for i, layer in enumerate(layers)]


def _cache_kv(cache: Any, layer: int) -> tuple:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def prefill_and_ingest(client: Any, model: Any, context_ids: Sequence[int], *,
                       name: str = "hf-context", model_name: str = "",
                       indexes: Any = None, keep_cache: bool = False, overlap: bool = False,
                       send_q: bool = True) -> tuple:
    """Prefills ``context_ids`` with ``model`` and ingests the KV (and Q) into
    ctxcache. Returns ``(ContextInfo, PrefillResult)``; the result carries
    ``ingest_s``, the ingest's wall time, and ``ready_after_prefill_s``, how
    long after the prefill's forward the context was READY.

    overlap: one forward over the whole context (no chunks), and each layer's
    K/V (and Q) go to the host on a side CUDA stream and into the ingest as
    soon as that layer has run: the ingest (a thread of its own) runs beside
    the rest of the forward instead of after it. The stored context is the
    same. Default: False (prefill in chunks, then ingest). send_q: send the
    queries (csa, tactic and lfps need them; quest, streaming, full and
    oracle do not). Default: True."""
    spec = model_spec(model, model_name or "hf:" + str(getattr(model.config, "_name_or_path",
                                                                  "model")).split("/")[-1])
    if overlap:
        return _prefill_and_ingest_overlapped(client, model, spec, list(context_ids), name,
                                              indexes, keep_cache, send_q)
    pre = prefill(model, context_ids, keep_cache=keep_cache)
    t0 = time.perf_counter()
    info = client.ingest(spec, list(context_ids),
                         ((pre.k[i], pre.v[i]) + ((pre.q[i],) if send_q else ())
                          for i in range(len(pre.k))),
                         indexes=indexes, name=name)
    pre.ingest_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    pre.ready_after_prefill_s = pre.ingest_s  # type: ignore[attr-defined]
    return info, pre


@torch.no_grad()
def _prefill_and_ingest_overlapped(client: Any, model: Any, spec: Any, ids: List[int],
                                   name: str, indexes: Any, keep_cache: bool,
                                   send_q: bool) -> tuple:
    """prefill_and_ingest(overlap=True). Three threads: this one runs the
    forward and, as the cache takes a layer's K/V, queues the layer's device
    tensors with an event; a copier waits for each event on a side stream
    and copies the layer to the host (releasing the device copy of Q); the
    ingest consumes the host layers in order. A failed forward ends the
    ingest's generator with an error (nothing is stored)."""
    import queue
    import threading
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    layers = _layers(model)
    n_layers = len(layers)
    on_cuda = dev.type == "cuda"
    qs: Dict[int, torch.Tensor] = {}
    to_copy: "queue.Queue[Any]" = queue.Queue()
    to_send: "queue.Queue[Any]" = queue.Queue()
    host: Dict[str, List[Any]] = {"k": [None] * n_layers, "v": [None] * n_layers,
                                  "q": [None] * n_layers}
    failed = object()
    seen = [0]
    result: Dict[str, Any] = {}

    class _Cache(DynamicCache):
        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
                   **kwargs: Any) -> Any:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            ev = None
            if on_cuda:
                ev = torch.cuda.Event()
                ev.record()
            to_copy.put((layer_idx, out[0][0], out[1][0], qs.pop(layer_idx, None), ev))
            seen[0] += 1
            return out

    def copier() -> None:
        # Device-to-host through pinned staging buffers (an async copy on a
        # side stream, then an event wait and a host copy with the GIL
        # released): a copy straight into pageable memory is synchronous in
        # the driver and slowed the forward beside it.
        stream = torch.cuda.Stream(dev) if on_cuda else None
        staging: Dict[int, torch.Tensor] = {}

        def to_host(x: Any, slot: int) -> Any:
            if x is None:
                return None
            if stream is None:
                return x.to("cpu", torch.bfloat16)
            buf = staging.get(slot)
            if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                buf = staging[slot] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            buf.copy_(x, non_blocking=True)
            return buf

        sent = 0
        try:
            for _ in range(n_layers):
                item = to_copy.get()
                if item is failed:
                    break
                layer, k, v, q, ev = item
                with (torch.cuda.stream(stream) if stream is not None
                      else contextlib.nullcontext()):
                    if ev is not None:
                        stream.wait_event(ev)
                    parts = [to_host(x, i) for i, x in enumerate((k, v, q))]
                    if stream is not None:
                        stream.synchronize()
                        parts = [torch.empty(x.shape, dtype=torch.bfloat16).copy_(x)
                                 if x is not None else None for x in parts]
                del k, v, q, item
                host["k"][layer], host["v"][layer], host["q"][layer] = parts
                to_send.put(layer)
                sent += 1
        except BaseException as e:  # noqa: BLE001 (re-raised by the caller's thread)
            result["copy_error"] = e
        finally:
            if sent < n_layers:  # the ingest's generator ends with an error
                to_send.put(failed)

    def sent_layers() -> Any:
        for want in range(n_layers):
            layer = to_send.get()
            if layer is failed:
                raise RuntimeError("prefill_and_ingest: the prefill or its copy to the host "
                                   "failed; nothing is stored")
            assert layer == want, (layer, want)
            yield ((host["k"][layer], host["v"][layer])
                   + ((host["q"][layer],) if send_q else ()))

    def ingest() -> None:
        try:
            result["info"] = client.ingest(spec, ids, sent_layers(), indexes=indexes, name=name)
        except BaseException as e:  # noqa: BLE001 (re-raised by the caller's thread)
            result["error"] = e
        result["ingest_done"] = time.perf_counter()

    hooks = _query_hooks(layers, qs.__setitem__) if send_q else []
    threads = [threading.Thread(target=copier, name="ctxcache-prefill-copy", daemon=True),
               threading.Thread(target=ingest, name="ctxcache-prefill-ingest", daemon=True)]
    # The ingest's wall time counts from here, before its thread starts (so
    # it never starts after the forward's end, however late the thread runs).
    t_start = time.perf_counter()
    for th in threads:
        th.start()
    cache = _Cache()
    x = torch.as_tensor(ids, dtype=torch.long, device=dev)[None]
    if on_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        if on_cuda:
            torch.cuda.synchronize()
        if seen[0] != n_layers:
            raise RuntimeError(f"prefill_and_ingest: the cache took {seen[0]} layers' K/V, "
                               f"the model has {n_layers}; nothing is stored")
    except BaseException:
        to_copy.put(failed)
        raise
    finally:
        t_prefill = time.perf_counter()
        secs = t_prefill - t0
        for hk in hooks:
            hk.remove()
        for th in threads:
            th.join()
    for key in ("copy_error", "error"):  # the copy's failure is the cause of the ingest's
        if key in result:
            raise result[key]
    pre = PrefillResult(host["k"], host["v"], host["q"] if send_q else [], secs,
                        cache if keep_cache else None)
    pre.ingest_s = result["ingest_done"] - t_start  # type: ignore[attr-defined]
    pre.ready_after_prefill_s = max(  # type: ignore[attr-defined]
        0.0, result["ingest_done"] - t_prefill)
    return result["info"], pre


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
    the dense context KV), and the session that receives the generated
    tokens (``appender``)."""

    def __init__(self, session: Any = None, dense_kv: Optional[List[tuple]] = None,
                 appender: Any = None, n_context: int = 0, n_layers: int = 0) -> None:
        self.session = session    # a Session, or a LibrarySession: its steps' K/V
        self.dense_kv = dense_kv
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
    else:
        ks, vs = dec.dense_kv[layer]  # [n_kv, n, d] on the device
        masks = None
    with _stage("ctxcache.attend"):
        out = attend(q, ks, vs, masks, key[0], value[0], scale)  # [n_q, d]
    return out.to(query.dtype)[None, None], None  # [1, 1, n_q, d]


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


def generate_client(client: Any, model: Any, info: Any, first_token: int, n_new: int, *,
                    params: Optional[Dict[str, Any]] = None,
                    forced: Optional[Sequence[int]] = None, selection: str = "exact",
                    append: bool = True, method: str = "csa", native: Any = None) -> GenerateResult:
    """As :func:`generate`, but selecting on the client: the C++ session core
    runs in this process through the native library (a client-mode
    :class:`ctxcache.native.DecodeSession`, :class:`LibrarySession`): the
    server's selections exactly, any method of
    :data:`ctxcache.native.SESSION_METHODS`, its pages from the library's page
    cache (FetchPages), one layer-step on the CPU per call. For decoding on a
    GPU use :func:`generate_engine` (no RPC while decoding).

    selection: ``"exact"`` (the only one; ``"torch"``, the session core as
    tensor ops with a page pool fetching its misses per layer-step, was
    replaced by :func:`generate_engine`: a ValueError says so).
    append: the library session sends each Append to the server and adds the
    token to its selectors before the next step, as the server's session
    does (so its selections follow the server's with appends too).
    native: the :class:`ctxcache.native.NativeClient` (default: one to
    ``client.address`` with ``$CTXCACHE_API_KEY``, closed at the end; pass
    one for TLS or other options).
    The result carries ``pool_hits``, ``pool_misses`` (the library's page
    cache look-ups), ``bytes_received`` and ``ttft_s`` (from the call to the
    first token: the session's open and the first step)."""
    from ctxcache import native as native_lib

    if selection != "exact":
        raise ValueError(f"selection '{selection}', expected 'exact' (GPU decoding: "
                         "hf.generate_engine)")
    if method not in native_lib.SESSION_METHODS:
        raise ValueError(f"method '{method}' has no client-side selection; expected one of "
                         f"{', '.join(native_lib.SESSION_METHODS)}")
    return _generate_library(client, model, info, first_token, n_new, params, forced,
                             append, method, native)


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


# ---------------------------------------------------------- through the engine --

@dataclass
class EngineResult:
    """What :func:`generate_engine` decoded and what it cost. ``tokens[b][i]``
    is sequence b's greedy token after step i (recorded before teacher
    forcing replaces it); seconds are wall time, the host synced only after
    the first step and after the last."""
    tokens: List[List[int]] = field(default_factory=list)
    logits: Optional[torch.Tensor] = None  # keep_logits: [B, n_new, vocab] float32, CPU
    load_s: float = 0.0     # the tier's bulk load (0 for a tier given; on demand: tier, planner)
    setup_s: float = 0.0    # decoder (index, pool, preload) and CUDA graphs
    ttft_s: float = 0.0     # from the call to the first tokens on the host
    decode_s: float = 0.0   # steps 2 .. n_new
    pool: Dict[str, int] = field(default_factory=dict)     # PagePool.stats() (sparse)
    memory: Dict[str, int] = field(default_factory=dict)   # the decoder's device bytes by part
    children: List[Any] = field(default_factory=list)      # write_back: each sequence's child
    # On demand: units (page of a layer's kv head) the first step fetched, and
    # all steps before the tier was complete.
    first_step_units: int = 0
    units_fetched: int = 0
    # On demand: seconds of the start (tier_s; index_s, the background index
    # load, when it ended before the first token; first_step_fill_s, of which
    # first_step_fill_wait_s waiting for the planned units and
    # first_step_fill_fetch_s in the fetch calls).
    start: Dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Tokens of all sequences per second over steps 2 .. n_new."""
        steps = len(self.tokens[0]) - 1 if self.tokens else 0
        return len(self.tokens) * steps / self.decode_s if self.decode_s > 0 else 0.0


def _engine_shape_error(tier: Any, model: Any) -> Optional[str]:
    n_layers, _, n_kv, d = model_heads(model)
    got = (tier.n_layers, tier.n_kv_heads, tier.head_dim)
    if got != (n_layers, n_kv, d):
        return (f"the stored context has (layers, kv heads, head_dim) {got}; the model "
                f"expects {(n_layers, n_kv, d)}")
    return None


def _check_sequences(first_tokens: Sequence[int], n_new: int, max_new: Optional[int],
                     forced: Optional[Sequence[Sequence[int]]]) -> List[int]:
    """The first tokens as ints, after checking n_new (1..max_new, or >= 1
    when max_new is None) and forced ([B][>= n_new]); ValueError naming the
    argument otherwise."""
    firsts = [int(x) for x in first_tokens]
    b = len(firsts)
    if b < 1:
        raise ValueError("first_tokens: no sequences, expected >= 1")
    if n_new < 1 or (max_new is not None and n_new > max_new):
        raise ValueError(f"n_new: {n_new}, expected "
                         + (f"1..{max_new}" if max_new is not None else ">= 1"))
    if forced is not None and (len(forced) != b or any(len(f) < n_new for f in forced)):
        raise ValueError(f"forced: expected {b} sequences of {n_new} tokens")
    return firsts


class EngineDecoding:
    """An HF model's greedy decoding of B sequences over one stored context
    through the GPU engine (:mod:`ctxcache.engine`), kept between calls: the
    decoder (the planner's index, the HBM pool, the own-token buffers) and
    the CUDA graphs of the model's step are made once, here; each
    :meth:`generate` starts B new sequences after the context (the pool keeps
    its pages, so a later call starts warm). :func:`generate_engine` makes
    one for a single call.

    Args:
        model: an HF LLaMA-family model (its step: :class:`ctxcache.engine.LlamaStepper`).
        tier: the context's :class:`ctxcache.engine.HostTier`, loaded.
        batch: B, the sequences of every call.
        max_new_tokens: the most steps a call may take.
        attention: ``"sparse"`` (:class:`ctxcache.engine.ContextDecoder` with
            ``options``, :class:`ctxcache.engine.EngineOptions`) or ``"dense"``
            (the whole context copied to the device,
            :class:`ctxcache.engine.DenseDecoder`).
        cuda_graphs: replay the step as CUDA graphs (CUDA only). Default: True.
        keep_logits: calls return every step's logits. Default: False.
        keep_queries: the own tokens keep their queries (for a write-back to
            contexts with query-centric indexes). Default: False.
        planner: the sparse decoder's planner (a
            :class:`ctxcache.engine.QuestPlanner`); required for a tier filled
            on demand (``QuestPlanner.from_index``). Default: None = from the
            tier's keys.
        streams: FetchKV streams of an on-demand tier's bulk load. Default: 8.

    A tier filled on demand (:meth:`ctxcache.engine.HostTier.on_demand`):
    steps run eagerly, each planning step fetching the pages it picks into
    the tier; after the first step the tier's bulk load starts in the
    background (``streams`` FetchKV streams), and once it is complete the
    step's CUDA graphs are captured (at a planning step) and replayed from
    then on.

    Raises ValueError for an unknown ``attention``, ``batch`` or
    ``max_new_tokens`` < 1, or a context whose shape is not the model's.
    Not thread-safe: one call at a time."""

    def __init__(self, model: Any, tier: Any, batch: int, max_new_tokens: int, *,
                 attention: str = "sparse", options: Any = None, cuda_graphs: bool = True,
                 keep_logits: bool = False, keep_queries: bool = False, planner: Any = None,
                 streams: int = 8) -> None:
        from ctxcache.engine import ContextDecoder, DenseDecoder, LlamaStepper

        t0 = time.perf_counter()
        if attention not in ("sparse", "dense"):
            raise ValueError(f"attention '{attention}', expected 'sparse' or 'dense'")
        if batch < 1 or max_new_tokens < 1:
            raise ValueError(f"batch {batch} and max_new_tokens {max_new_tokens}: expected >= 1 "
                             "of each")
        err = _engine_shape_error(tier, model)
        if err is not None:
            raise ValueError(f"generate_engine: {err}")
        self.model, self.tier, self.batch = model, tier, batch
        self.max_new_tokens, self.attention = max_new_tokens, attention
        self.device = next(model.parameters()).device
        hq = model.config.num_attention_heads
        if attention == "dense":
            if tier.present is not None:
                raise ValueError("attention 'dense' needs the whole context: a tier filled "
                                 "on demand is for 'sparse'")
            k, v = tier.token_view()
            self.decoder: Any = DenseDecoder(k.to(self.device), v.to(self.device), batch,
                                             max_new_tokens,
                                             n_q_heads_kept=hq if keep_queries else 0)
        else:
            self.decoder = ContextDecoder(tier, self.device, hq, batch, max_new_tokens, options,
                                          planner=planner, keep_queries=keep_queries)
        self.stepper = LlamaStepper(model, self.decoder, batch, keep_logits=keep_logits)
        self.graphs = cuda_graphs and self.device.type == "cuda"
        self.streams = streams
        self.captured = False
        if self.graphs and tier.present is None:
            self.stepper.capture()  # its warm-up steps' effects are undone by generate
            self.captured = True
        self.setup_s = time.perf_counter() - t0

    def _catch_up(self) -> None:
        """Between steps, with a tier filled on demand: once its bulk load is
        done, the decoder preloads if it may, and at a planning step the
        graphs are captured (their warm-up steps' effects on the sequences
        undone; the pool keeps what they resolved, the complete tier's bytes)."""
        st, dec = self.stepper, self.decoder
        if self.tier.present is not None and self.tier.complete():
            dec.on_tier_complete()
        if (self.graphs and not self.captured and self.tier.present is None
                and st.n_steps % st.period == 0):
            dec.planner.wait_index()  # no background copy while capturing
            saved = (st.tokens.clone(), st.position.clone(), dec.own.length.clone(), st.n_steps)
            st.capture()
            st.tokens.copy_(saved[0])
            st.position.copy_(saved[1])
            dec.own.length.copy_(saved[2])
            st.n_steps = saved[3]
            self.captured = True

    @torch.no_grad()
    def generate(self, first_tokens: Sequence[int], n_new: int,
                 forced: Optional[Sequence[Sequence[int]]] = None) -> EngineResult:
        """Sequence b feeds ``first_tokens[b]`` at position ``tier.n_tokens``;
        with ``forced`` (``[B][n_new]``) step i+1 feeds ``forced[b][i]``. The
        result's ``ttft_s`` counts from this call; ``pool`` holds this call's
        pool counts. ValueError for another number of sequences than B,
        ``n_new`` outside 1..max_new_tokens or a ``forced`` of another shape."""
        t0 = time.perf_counter()
        b, dev, st, dec = self.batch, self.device, self.stepper, self.decoder
        if len(first_tokens) != b:
            raise ValueError(f"first_tokens: {len(first_tokens)} sequences, expected the "
                             f"batch's {b}")
        firsts = _check_sequences(first_tokens, n_new, self.max_new_tokens, forced)
        pool_before = dec.pool.stats() if self.attention == "sparse" else {}
        dec.reset()
        st.reset()
        st.tokens.copy_(torch.tensor(firsts, dtype=torch.int64))
        st.position.fill_(int(self.tier.n_tokens))
        fed = (torch.tensor([list(f[:n_new]) for f in forced], dtype=torch.int64,
                            device=dev).t().contiguous() if forced is not None else None)
        out = torch.empty(n_new, b, dtype=torch.int64, device=dev)
        logits = (torch.empty(n_new, b, self.model.config.vocab_size, dtype=torch.float32,
                              device=dev) if st.logits is not None else None)
        res = EngineResult()
        t1 = t0
        tier = self.tier  # this call's fill counters, below
        fetched, fills = tier.units_fetched, (tier.fill_s, tier.fill_wait_s, tier.fill_fetch_s)
        planner = getattr(self.decoder, "planner", None)  # None: a dense decoder
        index_wait = getattr(planner, "index_wait_s", 0.0)
        for i in range(n_new):
            if not self.captured:
                self._catch_up()
            (st.replay if self.captured else st.step)()
            if i == 0 and tier.present is not None:
                res.first_step_units = tier.units_fetched - fetched
                res.start["first_step_fill_s"] = tier.fill_s - fills[0]
                res.start["first_step_fill_wait_s"] = tier.fill_wait_s - fills[1]
                res.start["first_step_fill_fetch_s"] = tier.fill_fetch_s - fills[2]
                load = getattr(planner, "index_load", None)
                if load is not None:  # how long the index took, if it is in
                    res.start["index_s"] = load.seconds
                if planner is not None:
                    res.start["first_step_index_wait_s"] = planner.index_wait_s - index_wait
                if n_new > 1:  # on demand: the rest, in the background
                    tier.start_load(self.streams)
            out[i].copy_(st.tokens)
            if logits is not None:
                logits[i].copy_(st.logits)
            if fed is not None:
                st.tokens.copy_(fed[i])
            if i == 0:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                res.ttft_s = t1 - t0
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res.decode_s = time.perf_counter() - t1
        res.tokens = out.t().tolist()
        if logits is not None:
            res.logits = logits.transpose(0, 1).cpu()
        res.memory = dec.memory()
        if pool_before:
            after = dec.pool.stats()
            res.pool = {k: (v - pool_before[k] if k != "n_slots" else v) for k, v in after.items()}
        return res


@torch.no_grad()
def generate_engine(client: Any, model: Any, info: Any, first_tokens: Sequence[int],
                    n_new: int, *, attention: str = "sparse", options: Any = None,
                    forced: Optional[Sequence[Sequence[int]]] = None, tier: Any = None,
                    native: Any = None, streams: int = 8, cuda_graphs: bool = True,
                    keep_logits: bool = False, write_back: Any = None,
                    on_demand: bool = False) -> EngineResult:
    """Greedy decoding of B = len(first_tokens) sequences after the stored
    context ``info``, all through the GPU engine (:mod:`ctxcache.engine`):
    no RPC and no host sync inside the decode. One call of a fresh
    :class:`EngineDecoding` (keep one to decode many batches over a context).

    1. The context's K/V go into a pinned host tier with one bulk load
       (``HostTier.from_server`` through ``native``, default a
       :class:`ctxcache.native.NativeClient` to ``client.address``, closed at
       the end), unless ``tier`` (an :class:`ctxcache.engine.HostTier` the
       caller keeps, e.g. a worker's warm copy) is given.
    2. ``attention="sparse"``: a :class:`ctxcache.engine.ContextDecoder`
       (``options``: :class:`ctxcache.engine.EngineOptions`; the Quest
       planner over the tier's keys, an HBM pool whose misses are copied from
       the tier on the device). ``"dense"``: the whole context copied to the
       device, :class:`ctxcache.engine.DenseDecoder` (the baseline through
       the same code).
    3. The model's step (:class:`ctxcache.engine.LlamaStepper`: every layer's
       own projections, RoPE and MLP; LLaMA-family models) runs as CUDA graph
       replays on CUDA when ``cuda_graphs``, eagerly otherwise. Sequence b
       feeds ``first_tokens[b]`` at position ``info.n_tokens``; with
       ``forced`` (``[B][n_new]``) step i+1 feeds ``forced[b][i]``.
    4. ``write_back`` (a :class:`ctxcache.engine.WriteBackOptions`): after
       the decode, each sequence's fed tokens and their K/V and Q (kept on
       the device while decoding, so the child gets the parent's
       query-centric indexes such as csa) are stored as a child context of
       ``info`` (:class:`ctxcache.engine.WriteBack`); ``children`` holds
       their ``ContextInfo``.

    ``on_demand`` (sparse, no ``tier`` given): instead of step 1, the
    planner's index is the context's stored Quest index (FetchIndex; the
    context must have one) and the tier fills on demand
    (:meth:`ctxcache.engine.HostTier.on_demand`): the first steps fetch the
    pages they pick, and the bulk load starts after the first step (see
    :class:`EngineDecoding`). The first token then needs the index and the
    first step's pages only.

    ``ttft_s`` counts from the call: load, set-up and the first step.
    Raises ValueError for an unknown ``attention``, no sequences, ``n_new`` < 1,
    a ``forced`` of another shape, or a stored context whose shape is not
    the model's."""
    from ctxcache import native as native_lib
    from ctxcache.engine import HostTier, WriteBack

    t0 = time.perf_counter()
    if attention not in ("sparse", "dense"):
        raise ValueError(f"attention '{attention}', expected 'sparse' or 'dense'")
    # Checked before the load (which may move gigabytes): the same checks as
    # EngineDecoding's.
    firsts = _check_sequences(first_tokens, n_new, None, forced)
    if on_demand and (attention != "sparse" or tier is not None):
        raise ValueError("on_demand: for attention 'sparse' without a tier given")
    b = len(firsts)
    owner = None
    if (tier is None or write_back is not None) and native is None:
        native = owner = native_lib.NativeClient(client.address)
    try:
        load_s, planner, start = 0.0, None, {}
        if on_demand:
            from ctxcache.engine import EngineOptions, QuestPlanner
            tier = HostTier.on_demand(native, info.context_id, streams=streams)
            o = options or EngineOptions()
            t_tier = time.perf_counter()
            # The index loads in the background, layer by layer: the first
            # step plans each layer as soon as its bounds are in.
            planner = QuestPlanner.from_server_index(
                native, info.context_id, tier, next(model.parameters()).device,
                model.config.num_attention_heads, b, streams=4, **o.planner_options())
            load_s = time.perf_counter() - t0
            start = {"tier_s": t_tier - t0}
        elif tier is None:
            tier = HostTier.from_server(native, info.context_id, streams=streams)
            with tier.load:  # closed (its native handle freed) once the tier is full
                tier.load.wait()
            load_s = time.perf_counter() - t0
        eng = EngineDecoding(model, tier, b, n_new, attention=attention, options=options,
                             cuda_graphs=cuda_graphs, keep_logits=keep_logits,
                             keep_queries=write_back is not None, planner=planner,
                             streams=streams)
        started = time.perf_counter() - t0
        res = eng.generate(firsts, n_new, forced)
        res.load_s, res.setup_s = load_s, eng.setup_s
        res.ttft_s += started
        if on_demand:
            res.units_fetched, res.start = tier.units_fetched, {**start, **res.start}
            if tier.load is not None and tier.present is not None:
                tier.load.wait()  # the bulk load outlives no call (and its errors surface)
                tier.load.close()
        if write_back is not None:
            writers = [WriteBack(native, info, write_back) for _ in range(b)]
            for s, w in enumerate(writers):
                ids = [firsts[s]] + (list(forced[s][:n_new - 1]) if forced is not None
                                     else res.tokens[s][:n_new - 1])
                w.append_own(eng.decoder.own, s, ids, 0)
                w.flush()
            res.children = [w.close(write_back.timeout_s) for w in writers]
        return res
    finally:
        if owner is not None:
            owner.close()
