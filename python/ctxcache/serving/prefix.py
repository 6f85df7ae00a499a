"""Which stored context a prompt starts with, found without an RPC per
candidate length.

A context id is content-addressed (storage/keys.cc ``ContextId::Compute``):
the first 16 bytes of SHA-256 over an optional id namespace, the model
fingerprint and the token ids as u32 little-endian. The namespace is secret
for tenant and ingested contexts (an HMAC with the server's id secret,
docs/security.md), so a client can recompute the id only of contexts the
server built for the default tenant. For every other context the publisher
stores the *token key* (the id the same tokens would have without a
namespace, :func:`token_key`) as the label ``ctxcache.token_key``
(:data:`TOKEN_KEY_LABEL`; :func:`ctxcache.serving.publish` sets it).

:class:`PrefixIndex` keeps, per accepted model fingerprint, the lengths of the
stored READY contexts and their token keys (from ListContexts, refreshed
when older than a bound). A match hashes the prompt once, incrementally,
taking a digest at each known length, and looks the digests up locally; the
caller confirms the longest hit with one GetContext.

The label is asserted by whoever stored the context. ListContexts returns
only the caller's tenant's contexts and the ones an admin shared, so a
tenant can mislabel only its own contexts (and the KV of an ingested
context is asserted by its ingester anyway, docs/security.md).
"""
from __future__ import annotations

import array
import hashlib
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ctxcache import errors

__all__ = ["TOKEN_KEY_LABEL", "token_array", "token_key", "u32le_bytes", "KnownContext",
           "PrefixIndex", "TokenStore"]

TOKEN_KEY_LABEL = "ctxcache.token_key"
_READY = 2       # ctxcache.v1.ContextState CONTEXT_STATE_READY
_BUILT = 0       # ctxcache.v1.Provenance PROVENANCE_BUILT
_NS_TAG = b"ctxcache-ns\x00"


def token_array(tokens: Sequence[int]) -> "array.array[int]":
    """``tokens`` as uint32s (one C pass: a 128K-token prompt in a few ms);
    ValueError naming the first id that is not a uint32."""
    try:
        return array.array("I", tokens)
    except (OverflowError, TypeError):
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or not 0 <= t < (1 << 32):
                raise ValueError(f"tokens: id {t!r} at index {i} is not a uint32") from None
        raise


def u32le_bytes(a: "array.array[int]") -> bytes:
    """A :func:`token_array`'s bytes, little-endian (the token key's layout)."""
    if sys.byteorder != "little":
        a = array.array("I", a)
        a.byteswap()
    return a.tobytes()


def _u32le(tokens: Sequence[int]) -> bytes:
    return u32le_bytes(token_array(tokens))


def _hasher(fingerprint: bytes, namespace: bytes = b"") -> "hashlib._Hash":
    h = hashlib.sha256()
    if namespace:
        h.update(_NS_TAG)
        h.update(struct.pack("<I", len(namespace)))
        h.update(namespace)
    h.update(fingerprint)
    return h


def token_key(fingerprint: bytes, tokens: Sequence[int], namespace: bytes = b"") -> str:
    """``ContextId::Compute(namespace, fingerprint, tokens)`` as 32 hex
    characters: the id of a context the server built from ``tokens`` for the
    default tenant, and the token key of any context of those tokens."""
    h = _hasher(bytes(fingerprint), bytes(namespace))
    h.update(_u32le(list(tokens)))
    return h.hexdigest()[:32]


def is_context_id(s: Any) -> bool:
    """Whether ``s`` has a context id's form: 32 hex characters (any case)."""
    return isinstance(s, str) and len(s) == 32 and all(c in "0123456789abcdefABCDEF" for c in s)


@dataclass(frozen=True)
class KnownContext:
    """A stored READY context a prompt may start with."""
    context_id: str
    n_tokens: int
    fingerprint: bytes
    token_key: str  # the id of its tokens without a namespace (32 hex)


def _known(info: Any) -> Optional[KnownContext]:
    """The prefix-matchable view of a ContextInfo, or None (not READY, or
    neither a namespace-less id nor a valid token-key label)."""
    if int(info.state) != _READY or int(info.n_tokens) <= 0:
        return None
    label = str(info.labels.get(TOKEN_KEY_LABEL, "")).lower()
    if is_context_id(label):
        key = label
    elif not info.tenant and int(info.provenance) == _BUILT:
        key = info.context_id
    else:
        return None
    return KnownContext(info.context_id, int(info.n_tokens), bytes(info.model.fingerprint), key)


class PrefixIndex:
    """The stored contexts a prompt may start with, per model fingerprint.

    Args:
        client: a :class:`ctxcache.Client` (or ClusterClient).
        fingerprints: the model fingerprints whose KV this engine can use
            (bytes); contexts of other models never match.
        refresh_interval_s: :meth:`match` refreshes the list first when it is
            older than this (0 = always).
        label_filter: only contexts with these labels (None = all).

    Thread-safe. :meth:`refresh` makes one paginated ListContexts; when it
    fails the previous list stays and the error propagates (the caller
    decides the fallback).
    """

    def __init__(self, client: Any, fingerprints: Iterable[bytes], *,
                 refresh_interval_s: float = 5.0,
                 label_filter: Optional[Dict[str, str]] = None) -> None:
        self._client = client
        self._fingerprints: Set[bytes] = {bytes(f) for f in fingerprints}
        if not self._fingerprints or any(not f for f in self._fingerprints):
            raise ValueError("fingerprints: expected at least one non-empty model fingerprint")
        self.refresh_interval_s = float(refresh_interval_s)
        self._label_filter = dict(label_filter or {})
        self._lock = threading.Lock()
        # fingerprint -> n_tokens -> token key -> context id
        self._by_len: Dict[bytes, Dict[int, Dict[str, str]]] = {}
        self._refreshed_at: Optional[float] = None
        self.refreshes = 0

    @property
    def fingerprints(self) -> Set[bytes]:
        return set(self._fingerprints)

    def refresh(self) -> int:
        """Re-reads the READY contexts (ListContexts). Returns how many are matchable."""
        table: Dict[bytes, Dict[int, Dict[str, str]]] = {}
        n = 0
        for info in self._client.list(label_filter=self._label_filter or None, state="READY",
                                      page_size=1000):
            k = _known(info)
            if k is None or k.fingerprint not in self._fingerprints:
                continue
            table.setdefault(k.fingerprint, {}).setdefault(k.n_tokens, {})[k.token_key] = \
                k.context_id
            n += 1
        with self._lock:
            self._by_len = table
            self._refreshed_at = time.monotonic()
            self.refreshes += 1
        return n

    def add(self, info: Any) -> bool:
        """Adds one context (e.g. just published or confirmed). Returns
        whether it is matchable."""
        k = _known(info)
        if k is None or k.fingerprint not in self._fingerprints:
            return False
        with self._lock:
            self._by_len.setdefault(k.fingerprint, {}).setdefault(k.n_tokens, {})[k.token_key] = \
                k.context_id
        return True

    def remove(self, context_id: str) -> None:
        """Forgets a context (evicted, or its GetContext said NOT_FOUND)."""
        with self._lock:
            for by_len in self._by_len.values():
                for n in list(by_len):
                    keys = by_len[n]
                    for key in [k for k, c in keys.items() if c == context_id]:
                        del keys[key]
                    if not keys:
                        del by_len[n]

    def lengths(self) -> List[int]:
        """The token counts of the matchable contexts, ascending (refreshes
        first when never refreshed)."""
        with self._lock:
            never = self._refreshed_at is None
        if never:
            self.refresh()
        with self._lock:
            return sorted({n for by_len in self._by_len.values() for n in by_len})

    def stale(self) -> bool:
        with self._lock:
            at = self._refreshed_at
        return at is None or time.monotonic() - at >= self.refresh_interval_s

    def match(self, prompt: Sequence[int], max_tokens: Optional[int] = None,
              min_tokens: int = 1, packed: Optional[bytes] = None) -> List[Tuple[str, int]]:
        """Stored contexts that ``prompt`` starts with, longest first:
        ``[(context_id, n_tokens)]``, with ``min_tokens <= n_tokens <=
        max_tokens`` (default ``len(prompt)``). Refreshes first when stale.
        Hashes each prompt token once per fingerprint; no RPC besides the
        refresh. ``packed``: the prompt as little-endian uint32s, when the
        caller has them."""
        if self.stale():
            self.refresh()
        limit = len(prompt) if max_tokens is None else min(int(max_tokens), len(prompt))
        with self._lock:
            snapshot = {fp: {n: dict(keys) for n, keys in by_len.items()
                             if min_tokens <= n <= limit}
                        for fp, by_len in self._by_len.items()}
        out: List[Tuple[str, int]] = []
        for fp, by_len in snapshot.items():
            if not by_len:
                continue
            if packed is None:
                packed = _u32le(prompt[:limit])
            buf = memoryview(packed)
            h = _hasher(fp)
            done = 0
            for n in sorted(by_len):
                h.update(buf[4 * done:4 * n])
                done = n
                key = h.copy().hexdigest()[:32]
                cid = by_len[n].get(key)
                if cid is not None:
                    out.append((cid, n))
        out.sort(key=lambda x: -x[1])
        return out


class TokenStore:
    """Token ids of contexts, by id, checked against their token key before
    they are kept (so a wrong list is refused, never served).

    ctxcached has no RPC that returns a context's tokens; a request that
    names a context by id needs them to build the engine's prompt. They come
    from :func:`ctxcache.serving.publish`, from prompts that matched the
    context, or from :meth:`put`. Thread-safe; bounded by ``max_tokens``
    (least recently used out)."""

    def __init__(self, max_tokens: int = 64 << 20) -> None:
        self._max = int(max_tokens)
        self._lock = threading.Lock()
        self._tokens: Dict[str, Tuple[int, ...]] = {}
        self._total = 0

    def put(self, info: Any, tokens: Sequence[int]) -> None:
        """Keeps ``tokens`` as the token ids of context ``info`` (a
        ContextInfo). ``ValueError`` when they do not hash to its token key or
        the context has none (naming the context)."""
        k = _known(info)
        if k is None:
            raise ValueError(f"context {info.context_id}: no token key to check tokens against "
                             f"(not READY, or an ingested/tenant context without the "
                             f"{TOKEN_KEY_LABEL} label)")
        if len(tokens) != k.n_tokens or token_key(k.fingerprint, tokens) != k.token_key:
            raise ValueError(f"tokens: {len(tokens)} ids do not hash to context "
                             f"{info.context_id}'s token key ({k.n_tokens} tokens)")
        self._keep(info.context_id, tuple(int(t) for t in tokens))

    def put_verified(self, context_id: str, tokens: Sequence[int]) -> None:
        """Keeps tokens already checked by a prefix match (Python ints). A
        context already held is only marked used: its token key matched, so
        its tokens are these."""
        with self._lock:
            t = self._tokens.get(context_id)
            if t is not None and len(t) == len(tokens):
                self._tokens[context_id] = self._tokens.pop(context_id)  # most recently used
                return
        self._keep(context_id, tuple(tokens))

    def _keep(self, context_id: str, tokens: Tuple[int, ...]) -> None:
        with self._lock:
            old = self._tokens.pop(context_id, None)
            if old is not None:
                self._total -= len(old)
            self._tokens[context_id] = tokens
            self._total += len(tokens)
            while self._total > self._max and len(self._tokens) > 1:
                first = next(iter(self._tokens))
                self._total -= len(self._tokens.pop(first))

    def get(self, context_id: str) -> Optional[Tuple[int, ...]]:
        with self._lock:
            t = self._tokens.pop(context_id, None)
            if t is not None:
                self._tokens[context_id] = t  # most recently used last
            return t


def check_error_is_missing(e: BaseException) -> bool:
    """Whether a ctxcache error means "this context cannot be used now"
    (gone, not READY, unreachable, too slow, corrupt) rather than a bug."""
    return isinstance(e, (errors.NotFound, errors.FailedPrecondition, errors.Unavailable,
                          errors.DeadlineExceeded, errors.DataLoss, errors.Cancelled,
                          errors.ResourceExhausted, errors.Aborted, errors.PermissionDenied))
