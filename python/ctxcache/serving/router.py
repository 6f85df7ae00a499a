"""Request routing: which stored context (if any) serves a request's prefix,
and what happens when it cannot.

A request either names a context by id (its prompt is then the context's
tokens followed by the request's own), or its prompt token ids start with a
stored context's tokens (found by :class:`~ctxcache.serving.prefix.PrefixIndex`
and confirmed with one GetContext). :meth:`Resolver.resolve` returns a
:class:`Resolution`; failures follow ``ServingOptions.on_missing``:

=============================  ==========================  ======================
situation                      on_missing="prefill"        on_missing="error"
=============================  ==========================  ======================
no stored prefix               plain request               plain request
named context not stored       plain request over its      NotFound
                               known tokens, else NotFound
ctxcached down / restarting    plain request               Unavailable
                               (after ``rpc_timeout_s`` ×
                               ``rpc_attempts``)
evicted while its KV loads     plain request               NotFound
KV load too slow               plain request               DeadlineExceeded
context of another model       InvalidArgument             InvalidArgument
named context, tokens unknown  FailedPrecondition          FailedPrecondition
malformed id                   InvalidArgument             InvalidArgument
=============================  ==========================  ======================

"Plain request" means the engine prefills the whole prompt: the same tokens
as without ctxcache, never different ones. A request whose KV reached this
process before its context was evicted completes from that copy (contexts
are immutable); later requests find the context gone.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from ctxcache import errors
from ctxcache.client import Client
from ctxcache.serving.kv import HostKV, HostKVCache
from ctxcache.serving.options import ServingOptions
from ctxcache.serving.prefix import (TOKEN_KEY_LABEL, PrefixIndex, TokenStore,
                                     check_error_is_missing, is_context_id, token_array,
                                     token_key, u32le_bytes)

__all__ = ["Resolution", "Resolver", "ModelShape", "publish"]


@dataclass(frozen=True)
class ModelShape:
    """What an engine's paged cache needs of a context's KV."""
    n_layers: int
    n_kv_heads: int
    head_dim: int


@dataclass
class Resolution:
    """How one request is served.

    Attributes:
        prompt: the token ids the engine gets (for a named context: its
            tokens, then the request's).
        context_id: the stored context serving the prefix, or None.
        prefix_tokens: how many leading prompt tokens come from it (0 = none).
        kv: its KV in host memory once loaded (:meth:`Resolver.load`).
        outcome: "hit", "no_match", or "fallback:<Error class>" (the prefix
            could not be used; the engine prefills it).
        error: the ctxcache error behind a fallback.
    """
    prompt: List[int]
    context_id: Optional[str] = None
    prefix_tokens: int = 0
    kv: Optional[HostKV] = None
    outcome: str = "no_match"
    error: Optional[BaseException] = field(default=None, repr=False)


class Resolver:
    """Routes requests to stored contexts (see the module's table).

    Args:
        address: ctxcached's ``HOST:PORT``.
        fingerprints: model fingerprints whose KV the engine can use.
        shape: the engine's model shape; a context of another shape is an
            InvalidArgument.
        options: :class:`ServingOptions` (validated here).
        client_kwargs: extra :class:`ctxcache.Client` / NativeClient arguments
            (tls_ca, api_key, ...).
        label_filter: only contexts with these labels are prefix-matched.

    Thread-safe. Counters in :attr:`outcomes`.
    """

    def __init__(self, address: str, fingerprints: Iterable[bytes], shape: ModelShape,
                 options: Optional[ServingOptions] = None, *,
                 client_kwargs: Optional[Mapping[str, Any]] = None,
                 label_filter: Optional[Dict[str, str]] = None,
                 kv_cache: Optional[HostKVCache] = None) -> None:
        self.options = (options or ServingOptions()).validate()
        o = self.options
        self.shape = shape
        kw = dict(client_kwargs or {})
        self.client = Client(address, timeout=o.rpc_timeout_s, max_attempts=o.rpc_attempts, **kw)
        self.index = PrefixIndex(self.client, fingerprints, refresh_interval_s=o.refresh_interval_s,
                                 label_filter=label_filter)
        self.tokens = TokenStore()
        self.kv_cache = kv_cache or HostKVCache(
            address, capacity_bytes=o.host_cache_bytes, load_timeout_s=o.load_timeout_s,
            streams=o.load_streams, rpc_timeout_s=o.rpc_timeout_s, rpc_attempts=o.rpc_attempts,
            transport=o.kv_transport,
            native_kwargs={k: v for k, v in kw.items()
                           if k in ("tls_ca", "tls_cert", "tls_key", "tls_server_name",
                                    "api_key")})
        self._lock = threading.Lock()
        self._quiet = threading.local()  # set by prefetch(): its routing is not counted
        self.outcomes: Dict[str, int] = {}

    # ------------------------------------------------------------ policy --

    def _count(self, outcome: str) -> None:
        if getattr(self._quiet, "on", False):
            return
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _fallback(self, prompt: List[int], e: BaseException) -> Resolution:
        """The on_missing policy for an error that makes the prefix unusable."""
        if self.options.on_missing == "error" or not check_error_is_missing(e):
            self._count(f"error:{type(e).__name__}")
            raise e
        outcome = f"fallback:{type(e).__name__}"
        self._count(outcome)
        return Resolution(list(prompt), None, 0, None, outcome, e)

    def _check_model(self, info: Any) -> None:
        m = info.model
        if bytes(m.fingerprint) not in self.index.fingerprints:
            raise errors.InvalidArgument(
                f"context_id: context {info.context_id} is of model {m.name!r} (fingerprint "
                f"{bytes(m.fingerprint).hex()[:16]}...), not one this engine serves")
        got = ModelShape(int(m.n_layers), int(m.n_kv_heads), int(m.head_dim))
        if got != self.shape:
            raise errors.InvalidArgument(
                f"context_id: context {info.context_id} has KV of shape {got}, the engine "
                f"expects {self.shape}")

    # ------------------------------------------------------------ resolve --

    def resolve_prefix(self, prompt: Sequence[int], context_id: Optional[str] = None
                       ) -> Resolution:
        """Which context serves the request, without loading its KV (at most
        one ListContexts and a few GetContext calls, each bounded by
        ``rpc_timeout_s``). Raises per the policy table."""
        arr = token_array(prompt)      # validates; Python ints, in one C pass
        ids = arr.tolist()
        if context_id is not None:
            return self._resolve_named(ids, context_id)
        try:
            matches = self.index.match(ids, min_tokens=self.options.min_prefix_tokens,
                                       packed=u32le_bytes(arr))
        except errors.Error as e:
            return self._fallback(ids, e)
        for cid, n in matches:
            try:
                info = self.client.get(cid)
            except errors.NotFound:
                self.index.remove(cid)  # evicted since the last refresh
                self.kv_cache.drop(cid)
                continue
            except errors.Error as e:
                return self._fallback(ids, e)
            if int(info.state) != 2:
                continue
            self._check_model(info)
            self.tokens.put_verified(cid, ids[:n])
            return Resolution(ids, cid, n, None, "hit")
        self._count("no_match")
        return Resolution(ids, None, 0, None, "no_match")

    def _resolve_named(self, ids: List[int], context_id: str) -> Resolution:
        if not is_context_id(context_id):
            raise errors.InvalidArgument(f"context_id: {context_id!r}, expected 32 hex characters")
        cid = context_id.lower()
        known = self.tokens.get(cid)
        full = list(known or ()) + ids
        try:
            info = self.client.get(cid)
        except errors.Error as e:
            if known is None:
                self._count(f"error:{type(e).__name__}")
                raise
            return self._fallback(full, e)
        self._check_model(info)
        if int(info.state) != 2:
            return self._fallback(full, errors.FailedPrecondition(
                f"context {cid} is not READY", rpc="GetContext"))
        if known is None:
            self._count("error:FailedPrecondition")
            raise errors.FailedPrecondition(
                f"context_id: the token ids of context {cid} are unknown to this server "
                "(ctxcached does not return a context's tokens): publish it from here, send a "
                "prompt that starts with it once, or register them (Resolver.register_tokens)")
        self.index.add(info)
        return Resolution(full, cid, len(known), None, "hit")

    def register_tokens(self, context_id: str, tokens: Sequence[int]) -> None:
        """Tells the server a context's token ids (checked against its token
        key: ValueError if they do not hash to it)."""
        self.tokens.put(self.client.get(context_id), [int(t) for t in tokens])

    def load(self, r: Resolution) -> Resolution:
        """Loads the KV of a hit (bounded by ``load_timeout_s``); returns the
        same resolution with ``kv`` set, or a fallback per the policy."""
        if r.context_id is None or r.kv is not None:
            return r
        try:
            r.kv = self.kv_cache.get(r.context_id)
        except errors.Error as e:
            if isinstance(e, errors.NotFound):
                self.index.remove(r.context_id)
            return self._fallback(r.prompt, e)
        got = ModelShape(r.kv.shape.n_layers, r.kv.shape.n_kv_heads, r.kv.shape.head_dim)
        if got != self.shape or r.kv.shape.n_tokens < r.prefix_tokens:
            raise errors.Internal(f"context {r.context_id}: loaded KV {r.kv.shape} does not "
                                  f"cover {r.prefix_tokens} tokens of shape {self.shape}")
        self._count("hit")
        return r

    def resolve(self, prompt: Sequence[int], context_id: Optional[str] = None) -> Resolution:
        """:meth:`resolve_prefix`, then :meth:`load`."""
        return self.load(self.resolve_prefix(prompt, context_id))

    def prefetch(self, prompt: Sequence[int], context_id: Optional[str] = None) -> None:
        """:meth:`resolve` for its side effects only (the context's KV in host
        memory, the index refreshed), not counted in :attr:`outcomes`. Never
        raises: the request's own routing applies the policy."""
        self._quiet.on = True
        try:
            self.resolve(prompt, context_id)
        except Exception:  # reported by the request's own routing
            pass
        finally:
            self._quiet.on = False

    def close(self) -> None:
        """Closes the clients and drops the host KV."""
        self.kv_cache.close()
        self.client.close()

    def __enter__(self) -> "Resolver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def publish(client: Any, model: Mapping[str, Any], tokens: Sequence[int],
            layers: Iterable[Sequence[Any]], *, resolver: Optional[Resolver] = None,
            labels: Optional[Mapping[str, Any]] = None, **ingest_kwargs: Any) -> Any:
    """Ingests a context's KV (``Client.ingest``) with its token key as the
    ``ctxcache.token_key`` label, so any engine with the same model
    fingerprint can prefix-match it. With ``resolver``, that engine also
    learns its token ids (requests may then name it by id). Returns the
    ContextInfo; :class:`ctxcache.AlreadyExists` when the same model and
    tokens were ingested before without the label (ingest is idempotent and
    keeps the first labels)."""
    fp = model["fingerprint"]
    fp = bytes.fromhex(fp) if isinstance(fp, str) else bytes(fp)
    ids = [int(t) for t in tokens]
    all_labels = dict(labels or {})
    all_labels[TOKEN_KEY_LABEL] = token_key(fp, ids)
    info = client.ingest(model, ids, layers, labels=all_labels, **ingest_kwargs)
    if info.labels.get(TOKEN_KEY_LABEL) != all_labels[TOKEN_KEY_LABEL]:
        # Ingest is idempotent: the same model and tokens return the stored
        # context, with the labels of its first ingest.
        raise errors.AlreadyExists(
            f"context {info.context_id} was stored before without the {TOKEN_KEY_LABEL} label; "
            "evict it and publish again to make it prefix-matchable", rpc="IngestContext")
    if resolver is not None:
        resolver.tokens.put(info, ids)
        resolver.index.add(info)
    return info
