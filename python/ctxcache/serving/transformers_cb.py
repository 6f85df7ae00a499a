"""ctxcache as the prefix store of transformers' continuous batching
(transformers 5.17: ``generate_batch``, ``ContinuousBatchingManager``,
``PagedAttentionCache``, ``attn_implementation="sdpa_paged"``).

How it works (dense-resident path). transformers' paged cache already
shares prefixes: a complete block of ``block_size`` tokens gets a hash
chained over its tokens and its parent's hash, and a new request's prompt
is matched block by block against those hashes
(``PagedAttentionCache.search_prefix_match``); matched blocks are not
prefilled. This backend fills that table from ctxcache: before the
scheduler looks at a waiting request whose prompt starts with a stored
context, the context's KV (loaded once into host memory,
:class:`~ctxcache.serving.kv.HostKVCache`) is copied into free blocks of the
paged cache and those blocks are registered under the hashes the engine
would have computed for the same tokens. The engine then skips the
context's prefill by its own rules; the rest of the prompt (and the last
``n mod block_size`` context tokens) is prefilled as usual. A request with
no stored prefix meets an unchanged engine. Because the copied KV is the
engine's own format (post-RoPE K, V per layer and kv head, the model's
dtype), ``full`` attention over it gives the tokens plain generation gives
when the stored KV is the one the engine computes (``capture_prefix_kv``).

Seeded blocks are held (ref-counted) only while the scheduler runs; after
that the requests using them hold them, and when none does they are the
engine's "initialized" blocks, reclaimed under memory pressure like any
other cached prefix; a later request re-seeds what was reclaimed.

Hooks: a scheduler subclass registered under its own name in
``SCHEDULER_MAPPING`` (``continuous_batching_config.scheduler_type``), and a
``ContinuousBatchingManager`` subclass whose ``add_request`` routes the
request first. The private parts of transformers this needs (the block
manager's hash table) are touched only in :func:`_seed_blocks` and
:func:`capture_prefix_kv`.
"""
from __future__ import annotations

import collections
import contextvars
import copy
import logging
import threading
import time
import uuid
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

from ctxcache import errors
from ctxcache.serving.options import ServingOptions
from ctxcache.serving.router import ModelShape, Resolution, Resolver
from ctxcache.engine.planner import page_cap, warm_decode_pages
from ctxcache.torch import hf
from ctxcache.serving.sparse import (PAGE_TOKENS, ForwardPlan, PrefixIndex, RequestSpan,
                                     block_table_rows, paged_sparse_attention,
                                     spans_from_lengths)

__all__ = ["CtxcacheBackend", "CtxcacheBatchingManager", "capture_prefix_kv",
           "REQUEST_CONTEXT_ID", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = "5.17"
# attention="sparse": requests up to this many tokens decode through
# transformers' block-table fast path; longer ones through its read index.
DECODE_TABLE_TOKENS = 1 << 20
# The largest decode batch whose selection kernels the manager's warmup
# compiles (larger batches compile at their first step).
WARM_MAX_BATCH = 256
# The stored context a request names when its caller cannot pass
# ``context_id=`` to add_request (transformers serve's handlers call
# add_request themselves): set around the call, read by add_request.
REQUEST_CONTEXT_ID: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar(
    "ctxcache_request_context_id", default=None)
log = logging.getLogger("ctxcache.serving")


def model_shape(model: Any) -> ModelShape:
    """The paged-cache shape of an HF causal LM (its text config)."""
    n_layers, _, n_kv, d = hf.model_heads(model)
    return ModelShape(n_layers, n_kv, d)


# ----------------------------------------------- transformers internals --
# Everything below up to the next rule reads or writes private state of
# transformers 5.17 (PagedAttentionCache._block_manager: BlockManager with
# _hash_to_id / _id_to_block, Block.hash / parent_id / ref_count). Another
# version may need changes here only.

def _block_manager(cache: Any) -> Any:
    return cache._block_manager


def _chain_hashes(cache: Any, tokens: Sequence[int]) -> List[int]:
    """The engine's hash of each complete block of ``tokens`` (group 0)."""
    bm = _block_manager(cache)
    bs = cache.block_size
    out: List[int] = []
    parent: Optional[int] = None
    for b in range(len(tokens) // bs):
        parent = bm.compute_hash(parent, list(tokens[b * bs:(b + 1) * bs]), 0)
        out.append(parent)
    return out


def _seed_blocks(cache: Any, hashes: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> List[int]:
    """Makes the blocks of ``hashes`` resident: present ones are held, missing
    ones are allocated, filled from ``k``/``v`` (host ``[n_layers, n_kv_heads,
    >= len(hashes) * block_size, head_dim]``) and registered. Returns the
    held block ids (one reference each, released by :func:`_release_blocks`);
    [] when the cache has no prefix sharing or too few free blocks."""
    if not hashes or not cache.use_prefix_sharing:
        return []
    bm = _block_manager(cache)
    bs = cache.block_size
    held: List[int] = []
    chain: List[Optional[int]] = []
    missing: List[int] = []
    for i, h in enumerate(hashes):
        bid = bm._hash_to_id.get(h)
        if bid is not None:
            bm.increase_ref_count(bid)
            held.append(bid)
        else:
            missing.append(i)
        chain.append(bid)
    if missing:
        new_ids = bm.get_free_blocks(len(missing), None, True, 0)
        if new_ids is None:
            _release_blocks(cache, held)
            return []
        for i, bid in zip(missing, new_ids):
            chain[i] = bid
        idx = torch.tensor(missing, dtype=torch.long, device=cache.device)
        dst = torch.tensor(new_ids, dtype=torch.long, device=cache.device)
        n_pad = len(hashes) * bs
        for layer, (group, j) in sorted(cache.layer_index_to_group_indices.items()):
            if group != 0:
                continue
            for host, paged in ((k, cache.key_cache[j]), (v, cache.value_cache[j])):
                src = host[layer, :, :n_pad].to(cache.device, non_blocking=True)  # [H, n, d]
                h_, _, d_ = src.shape
                src = src.reshape(h_, len(hashes), bs, d_).index_select(1, idx)
                src = src.permute(1, 2, 0, 3).to(cache.dtype)    # [blocks, bs, H, d]
                paged.view(-1, bs, h_, d_).index_copy_(0, dst, src)
        if str(cache.device).startswith("cuda"):
            torch.cuda.synchronize(cache.device)
        for i, bid in zip(missing, new_ids):
            blk = bm._id_to_block[bid]
            blk.parent_id = chain[i - 1] if i else None
            blk.hash = hashes[i]
            bm._hash_to_id[hashes[i]] = bid
        held.extend(new_ids)
    return held


def _release_blocks(cache: Any, held: Iterable[int]) -> None:
    bm = _block_manager(cache)
    for bid in held:
        bm.decrease_ref_count(bid)


def capture_prefix_kv(manager: ContinuousBatchingManager, tokens: Sequence[int]
                      ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The engine's own KV of the complete blocks of ``tokens`` from a
    manager's paged cache (after a run that prefilled them, e.g.
    ``generate_batch(..., persistent_manager=True)``): CPU ``(k, v)`` of
    ``[n_layers, n_kv_heads, n_blocks * block_size, head_dim]``, or None when
    any block is no longer cached. What :func:`ctxcache.serving.publish`
    stores so that ``full`` matches plain generation token for token.
    The run must generate at least 2 tokens: transformers 5.17 registers a
    prefill's complete blocks when the first token comes back, and skips that
    for a request that finishes with it (max_new_tokens=1)."""
    bp = manager.batch_processor
    if bp is None or not bp.cache.use_prefix_sharing:
        return None
    cache = bp.cache
    bm = _block_manager(cache)
    ids = []
    for h in _chain_hashes(cache, tokens):
        bid = bm._hash_to_id.get(h)
        if bid is None:
            return None
        ids.append(bid)
    if not ids:
        return None
    bs = cache.block_size
    sel = torch.tensor(ids, dtype=torch.long, device=cache.device)
    layers = sorted(cache.layer_index_to_group_indices.items())
    ks, vs = [], []
    for _layer, (_group, j) in layers:
        for paged, out in ((cache.key_cache[j], ks), (cache.value_cache[j], vs)):
            blocks = paged.view(-1, bs, paged.shape[-2], paged.shape[-1]).index_select(0, sel)
            out.append(blocks.reshape(-1, paged.shape[-2], paged.shape[-1])
                       .permute(1, 0, 2).to("cpu"))
    return torch.stack(ks), torch.stack(vs)

def _cu_lengths(kwargs: Dict[str, Any]) -> Tuple[List[int], List[int]]:
    """The forward's cumulative query and key lengths (one device read)."""
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        cu_k = cu_k["full_attention"]
    n = cu_q.numel()
    lens = torch.cat([cu_q.long(), cu_k.long()]).tolist()
    return lens[:n], lens[n:]


def _request_prefixes(cache: Any, cq: List[int], ck: List[int], ri: torch.Tensor,
                      indexes: Sequence["_PrefixRecord"]) -> List[RequestSpan]:
    """The packed forward's requests (``cq``/``ck`` its cumulative query and
    key lengths; ``ri`` the cache rows they read) with the stored prefix each
    one reads: a request whose first and last prefix rows sit in the blocks
    registered under the prefix's first and last block hashes. Two small
    device-to-host reads."""
    n = len(cq) - 1
    prefixes: List[Optional[PrefixIndex]] = [None] * n
    bm = _block_manager(cache)
    bs = cache.block_size
    first: Dict[int, Tuple["_PrefixRecord", int]] = {}
    for rec in indexes:
        b0, b1 = bm._hash_to_id.get(rec.first_hash), bm._hash_to_id.get(rec.last_hash)
        if b0 is not None and b1 is not None:
            first[b0] = (rec, b1)
    past = [(ck[i + 1] - ck[i]) - (cq[i + 1] - cq[i]) for i in range(n)]
    cand = [i for i in range(n) if past[i] > 0]
    if first and cand and ri.numel():
        at = torch.tensor([ck[i] for i in cand], dtype=torch.long, device=ri.device)
        checks = []
        for i, slot in zip(cand, ri[at].tolist()):
            hit = first.get(slot // bs)
            if hit is not None and past[i] >= hit[0].index.n_tokens:
                checks.append((i, hit))
        if checks:
            at = torch.tensor([ck[i] + rec.index.n_tokens - 1 for i, (rec, _) in checks],
                              dtype=torch.long, device=ri.device)
            for (i, (rec, last)), slot in zip(checks, ri[at].tolist()):
                if slot // bs == last:
                    prefixes[i] = rec.index
    return spans_from_lengths(cq, ck, prefixes)

# -------------------------------------------------- end of the internals --


class _PrefixRecord:
    """A seeded prefix's compact index and the hashes of its first and last
    blocks (how a request's blocks are recognized as the prefix's)."""

    def __init__(self, index: PrefixIndex, hashes: Sequence[int]) -> None:
        self.index = index
        self.first_hash, self.last_hash = hashes[0], hashes[-1]


class _SparseAttention:
    """The attention function registered for ``attention="sparse"``: one per
    backend, under its own name (``paged|ctxcache_<id>``). A forward's request
    plan is made at its first layer and used by the others."""

    def __init__(self, backend: "CtxcacheBackend") -> None:
        self.backend = backend
        self.name = f"paged|ctxcache_{uuid.uuid4().hex[:8]}"
        self._plan: Optional[ForwardPlan] = None
        self._rows: Tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))
        self.forwards = 0
        self.prefix_requests = 0
        # Requests of one new token, attended by the batched decode call.
        self.batched_requests = 0
        # Forwards that came with a block table (no host read index).
        self.table_forwards = 0
        # The last forwards, each (perf_counter at its first layer, query
        # tokens, requests): the gaps between them are whole forwards with
        # the engine's host work around them (a bounded ring).
        self.forward_log: Deque[Tuple[float, int, int]] = collections.deque(maxlen=512)

    def register(self) -> None:
        from transformers import AttentionInterface
        AttentionInterface.register(self.name, self)
        AttentionInterface.register(self.name.split("|", 1)[1], self)

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                 **kwargs: Any) -> Tuple[torch.Tensor, None]:
        cache = kwargs.get("cache")
        if cache is None:
            raise ValueError(f"{self.name} was called without a paged attention cache: it "
                             "serves continuous batching only")
        layer = module.layer_idx
        group, j = cache.layer_index_to_group_indices[layer]
        if cache.sliding_windows[layer] != 1:
            raise NotImplementedError(f"{self.name}: layer {layer} uses a sliding window; "
                                      "sparse attention serves full-attention layers")
        if layer == min(cache.layer_index_to_group_indices):
            if cache.num_groups != 1:
                raise NotImplementedError(f"{self.name}: {cache.num_groups} layer groups; "
                                          "sparse attention serves one group of full attention")
            cq, ck = _cu_lengths(kwargs)
            if kwargs.get("block_table") is not None:
                # transformers' decode fast path passes a block table [groups,
                # B, blocks] instead of read and write indices: the same rows
                # (every batch of this backend's manager takes it).
                self._rows = block_table_rows(kwargs["block_table"][0], cq, ck,
                                              cache.block_size)
                self.table_forwards += 1
            else:
                self._rows = (kwargs["read_index"][0], kwargs["write_index"][0])
            spans = _request_prefixes(cache, cq, ck, self._rows[0],
                                      self.backend._prefix_records(cache))
            self._plan = ForwardPlan(spans, query.shape[2], self._rows[0].numel(), query.device)
            self.forwards += 1
            self.forward_log.append((time.perf_counter(), int(query.shape[2]), len(spans)))
            self.prefix_requests += sum(1 for s in spans if s.prefix is not None)
            self.batched_requests += self._plan.decode_requests
        read_index, write_index = self._rows
        out = paged_sparse_attention(query, key, value, cache.key_cache[j],
                                     cache.value_cache[j], read_index, write_index,
                                     self._plan, layer, scaling)
        return out, None


class CtxcacheBackend:
    """ctxcache as the prefix store of one model's continuous batching.

    Args:
        address: ctxcached's ``HOST:PORT``.
        model: the HF causal LM (a full-attention LLaMA-family model on its
            device, loaded with ``attn_implementation="paged|sdpa"``, the
            paged SDPA of ``integrations/sdpa_paged.py``, or another paged
            implementation).
        fingerprints: model fingerprints whose stored KV this model can use.
            Default: ``ctxcache.torch.hf.model_spec(model)``'s (SHA-256 over
            the weights), the one to :func:`ctxcache.serving.publish` with.
        options: :class:`ServingOptions`.
        client_kwargs: TLS / API key arguments of the clients.

    Thread-safe: requests may be added from several threads.
    """

    def __init__(self, address: str, model: Any, fingerprints: Optional[Iterable[bytes]] = None,
                 options: Optional[ServingOptions] = None, *,
                 client_kwargs: Optional[Dict[str, Any]] = None,
                 label_filter: Optional[Dict[str, str]] = None) -> None:
        if fingerprints is None:
            fingerprints = [hf.model_spec(model, "")["fingerprint"]]
        self.model = model
        self.shape = model_shape(model)
        self.resolver = Resolver(address, fingerprints, self.shape, options,
                                 client_kwargs=client_kwargs, label_filter=label_filter)
        self.options = self.resolver.options
        self._lock = threading.Lock()
        # request id -> (context id, its resolution with the host KV)
        self._pending: Dict[str, Tuple[str, Resolution]] = {}
        self._hashes: Dict[Tuple[str, int, int, int], List[int]] = {}
        self._scheduler_names: Dict[str, str] = {}
        self.seeded_blocks = 0
        self.seed_failures = 0
        # Seconds the generation thread spent hashing prefixes' blocks,
        # seeding them into the paged cache and building their indexes.
        self.seed_seconds = {"hash": 0.0, "seed": 0.0, "index": 0.0}
        # attention="sparse": the attention function and each seeded prefix's
        # compact index, by (context id, prefix tokens, id(cache)).
        self._sparse: Optional[_SparseAttention] = None
        self._indexes: Dict[Tuple[str, int, int], _PrefixRecord] = {}
        if self.options.attention == "sparse":
            self._sparse = _SparseAttention(self)
            self._sparse.register()
        # A request that names a context and whose own ids start with this
        # token (its tokenizer's BOS, added to every prompt) drops it: the
        # context already starts the sequence. None = keep the ids as given.
        self.named_drop_leading: Optional[int] = None

    # ------------------------------------------------------------ routing --

    def route(self, prompt: Sequence[int], context_id: Optional[str] = None) -> Resolution:
        """Resolves and loads a request's stored prefix (bounded; raises per
        the ``on_missing`` policy, see :mod:`ctxcache.serving.router`)."""
        return self.resolver.resolve(prompt, context_id)

    def prefetch(self, prompt: Sequence[int], context_id: Optional[str] = None) -> None:
        """Routes a request ahead of time so that its context's KV is in host
        memory when the request is added (for callers that must not block,
        e.g. an event loop: run this in a thread first). Never raises: the
        request's own routing applies the policy."""
        ids = list(prompt)
        if context_id is not None and self.named_drop_leading is not None \
                and ids[:1] == [self.named_drop_leading]:
            ids = ids[1:]
        self.resolver.prefetch(ids, context_id)

    def _track(self, request_id: str, r: Resolution) -> None:
        if r.context_id is None or r.kv is None:
            return
        with self._lock:
            self._pending[request_id] = (r.context_id, r)

    # ---------------------------------------------------------- scheduling --

    def scheduler_name(self, base: str = "fifo") -> str:
        """The ``scheduler_type`` of a scheduler that seeds stored prefixes
        before ``base``'s scheduling (registered once per backend)."""
        if base.startswith("ctxcache:"):
            return base
        with self._lock:
            name = self._scheduler_names.get(base)
            if name is not None:
                return name
            parent = SCHEDULER_MAPPING.get(base)
            if parent is None:
                raise ValueError(f"continuous_batching_config.scheduler_type: {base!r}, expected "
                                 f"one of {sorted(k for k in SCHEDULER_MAPPING if ':' not in k)}")
            backend = self

            class CtxcacheScheduler(parent):  # type: ignore[misc, valid-type]
                """``parent`` plus ctxcache's prefixes seeded into the paged
                cache before each scheduling pass (generation thread)."""

                def schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
                    held, seen = backend._before_schedule(self.cache, self.waiting_requests)
                    try:
                        out = super().schedule_batch(token_budget, cache_budget)
                    finally:
                        backend._after_schedule(self.cache, held, seen, self.waiting_requests)
                    return backend._table_for_every_batch(self.cache, out)

            name = f"ctxcache:{base}:{uuid.uuid4().hex[:8]}"
            SCHEDULER_MAPPING[name] = CtxcacheScheduler
            self._scheduler_names[base] = name
            return name

    def _table_for_every_batch(self, cache: Any, scheduled: Any) -> Any:
        """Sparse mode: a batch with prompt chunks also goes through the block
        table path, so that no forward builds a host list of every past
        token of every request (transformers' read index: 4M entries for 32
        requests over 128K prefixes); the sparse attention reads the table,
        and writes the new tokens itself. Batches with a request past the
        table's length keep the read index."""
        reqs, fast, n_q, max_kv = scheduled
        if self._sparse is None or fast or not reqs or cache.max_blocks_per_request <= 0:
            return scheduled
        limit = cache.max_blocks_per_request * cache.block_size
        if all(f.state.position_offset + f.query_length <= limit for f in reqs):
            return reqs, True, n_q, max_kv
        return scheduled

    def _hashes_for(self, cache: Any, r: Resolution) -> List[int]:
        key = (str(r.context_id), r.prefix_tokens, id(cache), int(cache.block_size))
        with self._lock:
            got = self._hashes.get(key)
        if got is None:
            got = _chain_hashes(cache, r.prompt[:r.prefix_tokens])
            with self._lock:
                self._hashes[key] = got
        return got

    def _before_schedule(self, cache: Any, waiting: Dict[str, Any]) -> Tuple[List[int], List[str]]:
        """Seeds the stored prefixes of the waiting (PENDING) requests. Returns
        the block references held for this pass and the request ids looked
        at. Never raises: a failure leaves the request to ordinary prefill."""
        with self._lock:
            todo = [(rid, p) for rid, p in self._pending.items() if rid in waiting]
        held: List[int] = []
        seen = set()
        for rid, (cid, r) in todo:
            state = waiting[rid]
            if state.status != RequestStatus.PENDING or (cid, r.prefix_tokens) in seen:
                continue
            seen.add((cid, r.prefix_tokens))
            try:
                t0 = time.perf_counter()
                hashes = self._hashes_for(cache, r)
                t1 = time.perf_counter()
                got = _seed_blocks(cache, hashes, r.kv.k, r.kv.v)  # type: ignore[union-attr]
                t2 = time.perf_counter()
                with self._lock:
                    self.seed_seconds["hash"] += t1 - t0
                    self.seed_seconds["seed"] += t2 - t1
            except Exception as e:  # a GPU-side failure: the engine prefills instead
                log.warning("ctxcache: seeding context %s failed (%s); prefilling", cid, e)
                with self._lock:
                    self.seed_failures += 1
                continue
            with self._lock:
                self.seeded_blocks += len(got)
            held.extend(got)
            if got and self._sparse is not None:
                try:
                    t0 = time.perf_counter()
                    self._index_prefix(cache, cid, r, hashes)
                    with self._lock:
                        self.seed_seconds["index"] += time.perf_counter() - t0
                except Exception as e:  # no index: the requests attend the prefix densely
                    log.warning("ctxcache: indexing context %s failed (%s); dense", cid, e)
        return held, [rid for rid, _ in todo]

    def _index_prefix(self, cache: Any, cid: str, r: Resolution, hashes: List[int]) -> None:
        """The compact index of a seeded prefix's blocks (once per cache)."""
        key = (cid, r.prefix_tokens, id(cache))
        with self._lock:
            if key in self._indexes:
                return
        o = self.options
        index = PrefixIndex(r.kv.k, len(hashes) * cache.block_size,  # type: ignore[union-attr]
                            torch.device(cache.device), cache.dtype, o.sparse_rho,
                            o.sparse_min_tokens, o.sparse_recent_pages,
                            o.sparse_prefill_rho)
        with self._lock:
            self._indexes[key] = _PrefixRecord(index, hashes)

    def warm_sparse_kernels(self, block_size: int, max_batch: int,
                            max_contexts: int = 8) -> int:
        """Sparse mode on CUDA: compiles the decode selection's kernels for
        the page counts of the stored contexts this server can match (at
        most ``max_contexts`` of them, the longest) and every padded batch
        shape up to ``max_batch`` requests, so that no request waits for a
        compilation. Returns the shapes run (0 when there is nothing to do).
        Never raises past a log line: a failure leaves the compilation to
        the first request."""
        if self._sparse is None:
            return 0
        try:
            dev = next(self.model.parameters()).device
            if dev.type != "cuda":
                return 0
            cfg = self.model.config
            o = self.options
            pages = sorted({(n // block_size) * block_size // PAGE_TOKENS
                            for n in self.resolver.index.lengths() if n >= block_size})
            runs = 0
            for p in pages[-max_contexts:]:
                n_recent, kp = page_cap(o.sparse_rho, p, o.sparse_recent_pages, PAGE_TOKENS,
                                        o.sparse_min_tokens)
                runs += warm_decode_pages(dev, self.model.dtype, int(cfg.num_attention_heads),
                                          self.resolver.shape.n_kv_heads,
                                          self.resolver.shape.head_dim, p, kp, n_recent,
                                          max_batch)
            return runs
        except Exception as e:  # the first request compiles instead
            log.warning("ctxcache: warming the sparse kernels failed (%s)", e)
            return 0

    def _prefix_records(self, cache: Any) -> List[_PrefixRecord]:
        with self._lock:
            return [rec for (_, _, c), rec in self._indexes.items() if c == id(cache)]

    def _after_schedule(self, cache: Any, held: List[int], looked_at: List[str],
                        waiting: Dict[str, Any]) -> None:
        """Releases this pass's references; forgets the requests that left
        PENDING (their blocks are now theirs). A request submitted but not yet
        waiting was not looked at and stays tracked."""
        _release_blocks(cache, held)
        with self._lock:
            for rid in looked_at:
                st = waiting.get(rid)
                if st is None or st.status != RequestStatus.PENDING:
                    self._pending.pop(rid, None)

    # ------------------------------------------------------------ engines --

    def manager(self, generation_config: Optional[GenerationConfig] = None,
                continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
                workload_hints: Any = None) -> "CtxcacheBatchingManager":
        """A continuous batching manager of the model that routes every
        request through this backend (start it with ``.start()``, or use
        :meth:`generate_batch`)."""
        return CtxcacheBatchingManager(self, generation_config, continuous_batching_config,
                                       workload_hints)

    @torch.no_grad()
    def generate_batch(self, inputs: List[List[int]], *,
                       context_ids: Optional[Sequence[Optional[str]]] = None,
                       generation_config: Optional[GenerationConfig] = None,
                       continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
                       max_new_tokens: Optional[int] = None, warmup: bool = True,
                       timeout_s: float = 600.0, record_timestamps: bool = True
                       ) -> Dict[str, Any]:
        """``model.generate_batch`` through this backend: ``{request_id:
        GenerationOutput}`` in input order. ``context_ids[i]`` names a stored
        context for request i (its prompt is then the context's tokens plus
        ``inputs[i]``). A request refused by the policy gets a
        GenerationOutput with ``error`` set and no tokens. Waits at most
        ``timeout_s`` for all results (then the missing ones are absent)."""
        if context_ids is not None and len(context_ids) != len(inputs):
            raise ValueError(f"context_ids: {len(context_ids)} entries, expected one per input "
                             f"({len(inputs)})")
        mgr = self.manager(generation_config, continuous_batching_config)
        if warmup:
            mgr.warmup()
        mgr.start()
        results: Dict[str, Any] = {}
        ids = [f"req_{i}" for i in range(len(inputs))]
        try:
            added = mgr.add_requests(inputs, request_ids=ids, context_ids=context_ids,
                                     max_new_tokens=max_new_tokens,
                                     record_timestamps=record_timestamps)
            for rid, prompt, x in zip(ids, inputs, added):
                if isinstance(x, errors.Error):
                    results[rid] = _failed_output(rid, prompt, x)
            deadline = time.monotonic() + timeout_s
            while len(results) < len(ids) and time.monotonic() < deadline:
                out = mgr.get_result(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                elif out is None and not mgr.is_running():
                    break
        finally:
            mgr.stop(block=True, timeout=30)
            mgr.destroy()
        return {rid: results[rid] for rid in ids if rid in results}

    def stats(self) -> Dict[str, Any]:
        """Counters: routing outcomes, host loads, seeded blocks; in sparse mode
        also the last forwards' log (seconds since the first logged, query
        tokens, requests)."""
        kv = self.resolver.kv_cache
        log = list(self._sparse.forward_log) if self._sparse is not None else []
        return {"outcomes": dict(self.resolver.outcomes), "kv_loads": kv.loads,
                "kv_hits": kv.hits, "kv_failures": kv.failures, "kv_bytes": kv.bytes_kept,
                "kv_load_seconds": round(kv.load_seconds, 4),
                "kv_alloc_seconds": round(kv.alloc_seconds, 4),
                "kv_transport": kv.transport, "kv_mapped_loads": kv.mapped_loads,
                "kv_map_off": kv.map_off,
                "seeded_blocks": self.seeded_blocks, "seed_failures": self.seed_failures,
                "seed_seconds": {k: round(v, 4) for k, v in self.seed_seconds.items()},
                "attention": self.options.attention,
                **({"sparse_forwards": self._sparse.forwards,
                    "sparse_prefix_requests": self._sparse.prefix_requests,
                    "sparse_batched_requests": self._sparse.batched_requests,
                    "sparse_table_forwards": self._sparse.table_forwards,
                    "sparse_forward_log": [(round(t - log[0][0], 4), q, n) for t, q, n in log],
                    "prefix_index_bytes": sum(x.index.nbytes for x in self._indexes.values())}
                   if self._sparse is not None else {})}

    def close(self) -> None:
        self.resolver.close()


def _failed_output(rid: str, prompt: Sequence[int], e: BaseException) -> Any:
    from transformers.generation.continuous_batching.requests import GenerationOutput
    return GenerationOutput(request_id=rid, prompt_ids=list(prompt), error=str(e),
                            status=RequestStatus.FAILED)


class CtxcacheBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` whose requests go through a
    :class:`CtxcacheBackend` first: ``add_request`` resolves and loads the
    stored prefix (``context_id=`` names one), then submits the (possibly
    extended) prompt. Everything else is the engine's own.

    ``continuous_batching_config.allow_block_sharing`` must stay True (the
    prefixes are served through block sharing); its ``scheduler_type``
    (default "fifo") is wrapped by the backend's seeding scheduler.
    """

    def __init__(self, backend: CtxcacheBackend,
                 generation_config: Optional[GenerationConfig] = None,
                 continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
                 workload_hints: Any = None) -> None:
        model = backend.model
        # A copy: the caller's config keeps its own scheduler_type.
        cfg = copy.copy(continuous_batching_config or ContinuousBatchingConfig())
        if not getattr(cfg, "allow_block_sharing", True):
            raise ValueError("continuous_batching_config.allow_block_sharing: False, expected True "
                             "(ctxcache serves prefixes through the paged cache's block sharing)")
        cfg.scheduler_type = backend.scheduler_name(getattr(cfg, "scheduler_type", None) or "fifo")
        self._ctxcache_attention = backend._sparse.name if backend._sparse is not None else None
        if self._ctxcache_attention is not None:
            # The request plan is read from the device once per forward: no
            # CUDA graphs, and no forward prepared while another runs.
            cfg.use_cuda_graph = False
            cfg.use_async_batching = False
            # ... and no compiled forwards (their padded shapes assume a
            # decode batch of one token per request).
            cfg.default_compile_level = 0
            cfg.varlen_compile_config = None
            cfg.decode_compile_config = None
        gen = generation_config if generation_config is not None else model.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = -1
        super().__init__(model=model, generation_config=gen, continuous_batching_config=cfg,
                         workload_hints=workload_hints)
        self.ctxcache = backend
        if self._ctxcache_attention is not None:
            # transformers turns its decode fast path (a block table per
            # request instead of a read index of every past token, built on
            # the host each step) on for flash attention only; the sparse
            # attention reads the block table too.
            c = self.continuous_batching_config
            blocks = DECODE_TABLE_TOKENS // int(c.block_size)
            if getattr(c, "num_blocks", None):
                blocks = min(blocks, int(c.num_blocks))
            c.max_blocks_per_request = max(1, blocks)
            # A compile config the model's own config carries would pad the
            # forwards to shapes of a one-token-per-request batch.
            c.varlen_compile_config = None
            c.decode_compile_config = None

    def warmup(self) -> None:
        """transformers' warmup, then (sparse mode) the selection kernels for
        the stored contexts' page counts (``warm_sparse_kernels``)."""
        super().warmup()
        c = self.continuous_batching_config
        batch = int(getattr(c, "max_requests_per_batch", 0) or 64)
        self.ctxcache.warm_sparse_kernels(int(c.block_size), min(batch, WARM_MAX_BATCH))

    def switch_to_cb_friendly_attn(self, model: Any) -> None:
        """Dense: the engine's own choice. Sparse: the backend's attention
        function (the model's own is restored by ``stop``)."""
        name = getattr(self, "_ctxcache_attention", None)
        if name is None:
            super().switch_to_cb_friendly_attn(model)
            return
        if model.config._attn_implementation != name:
            self._original_attn_impl = model.config._attn_implementation
            model.set_attn_implementation(name)

    def add_request(self, input_ids: List[int], request_id: Optional[str] = None,
                    max_new_tokens: Optional[int] = None, streaming: bool = False,
                    record_timestamps: bool = False, eos_token_id: Any = None,
                    context_id: Optional[str] = None, **logit_processor_kwargs: Any
                    ) -> Optional[str]:
        """As ``ContinuousBatchingManager.add_request``, after routing
        (``context_id``, else :data:`REQUEST_CONTEXT_ID`, names a stored
        context): raises the ctxcache error when the policy says "error"
        (nothing is submitted then)."""
        rid, r = self._route(input_ids, request_id, context_id)
        return self._submit(rid, r, max_new_tokens, streaming, record_timestamps, eos_token_id,
                            logit_processor_kwargs)

    def add_requests(self, inputs: Sequence[List[int]],
                     request_ids: Optional[Sequence[Optional[str]]] = None,
                     context_ids: Optional[Sequence[Optional[str]]] = None,
                     max_new_tokens: Optional[int] = None, streaming: bool = False,
                     record_timestamps: bool = False, eos_token_id: Any = None,
                     **logit_processor_kwargs: Any) -> List[Any]:
        """Many requests at once: every prompt is routed first (its stored
        prefix resolved and loaded), then all are submitted together, so the
        engine's first forward can schedule them all instead of the first
        alone while the others are still being routed. Per request, in input
        order: its request id, or the ctxcache error that refused it (nothing
        of it submitted). ``request_ids``/``context_ids``: one per input (None
        entries: a generated id, :data:`REQUEST_CONTEXT_ID`)."""
        for name, xs in (("request_ids", request_ids), ("context_ids", context_ids)):
            if xs is not None and len(xs) != len(inputs):
                raise ValueError(f"{name}: {len(xs)} entries, expected one per input "
                                 f"({len(inputs)})")
        routed: List[Any] = []
        for i, prompt in enumerate(inputs):
            try:
                routed.append(self._route(prompt, request_ids[i] if request_ids else None,
                                          context_ids[i] if context_ids else None))
            except errors.Error as e:
                routed.append(e)
        return [x if isinstance(x, errors.Error) else
                self._submit(x[0], x[1], max_new_tokens, streaming, record_timestamps,
                             eos_token_id, logit_processor_kwargs) for x in routed]

    def _route(self, input_ids: List[int], request_id: Optional[str],
               context_id: Optional[str]) -> Tuple[str, Any]:
        if context_id is None:
            context_id = REQUEST_CONTEXT_ID.get()
        ids = list(input_ids)
        drop = self.ctxcache.named_drop_leading
        if context_id is not None and drop is not None and ids[:1] == [drop]:
            ids = ids[1:]
        r = self.ctxcache.route(ids, context_id)
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        return request_id, r

    def _submit(self, request_id: str, r: Any, max_new_tokens: Optional[int], streaming: bool,
                record_timestamps: bool, eos_token_id: Any,
                logit_processor_kwargs: Dict[str, Any]) -> Optional[str]:
        self.ctxcache._track(request_id, r)
        return super().add_request(r.prompt, request_id=request_id,
                                   max_new_tokens=max_new_tokens, streaming=streaming,
                                   record_timestamps=record_timestamps,
                                   eos_token_id=eos_token_id, **logit_processor_kwargs)


def transformers_version_ok() -> bool:
    """Whether the installed transformers is the version this adapter was
    written against (others may work; the internals section may need care)."""
    return transformers.__version__.startswith(TESTED_TRANSFORMERS)
