"""Settings of the serving backend: what to do when a stored prefix cannot be
used, and how long each step may wait.

Every wait the backend makes is bounded by one of these numbers; none of
them is "forever". :meth:`ServingOptions.validate` raises ``ValueError``
naming the field and the expected value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ServingOptions", "ON_MISSING_CHOICES", "ATTENTION_CHOICES", "KV_TRANSPORT_CHOICES"]

# "prefill": the request runs as if ctxcache were absent (the engine
# prefills the whole prompt). "error": the request fails with the
# ctxcache error that stopped it (NotFound, Unavailable, ...).
ON_MISSING_CHOICES = ("prefill", "error")
# How a request attends its stored prefix (ServingOptions.attention).
ATTENTION_CHOICES = ("dense", "sparse")
KV_TRANSPORT_CHOICES = ("auto", "fetch", "map")


@dataclass
class ServingOptions:
    """Settings of a serving backend. Safe to share between threads once built
    (read-only after :meth:`validate`)."""

    # What a request gets when its stored prefix cannot be used: the context
    # is missing, ctxcached is down or restarting, or the context is evicted
    # while its KV is being loaded. "prefill" (the engine prefills the whole
    # prompt: same tokens, no speed-up) or "error" (the request fails with the
    # ctxcache error). A request that names a context whose token ids this
    # process does not know always fails: without them it cannot be prefilled.
    # Default: "prefill".
    on_missing: str = "prefill"
    # Deadline of each metadata RPC (GetContext, ListContexts), seconds.
    # Default: 2.
    rpc_timeout_s: float = 2.0
    # Attempts of a metadata RPC that fails with UNAVAILABLE (1 = no retry).
    # Default: 2.
    rpc_attempts: int = 2
    # Longest a KV load from ctxcached may take, seconds; past it the load is
    # cancelled and the request takes the on_missing path. Default: 120.
    load_timeout_s: float = 120.0
    # Refresh the list of stored contexts (ListContexts) when it is older
    # than this, seconds; 0 = before every match. Default: 5.
    refresh_interval_s: float = 5.0
    # Shortest stored prefix worth using, tokens. Default: 16.
    min_prefix_tokens: int = 16
    # Bytes of context KV kept in host memory (least recently used out); a
    # context larger than this is loaded, used and not kept. Default: 8 GiB.
    host_cache_bytes: int = 8 << 30
    # Parallel streams of a bulk KV load (NativeClient.start_load_kv).
    # Default: 4.
    load_streams: int = 4
    # How a context's KV reaches host memory: "fetch" (FetchKV frames into
    # buffers of this process), "map" (MapKV: ctxcached's shared-memory
    # segment on this host, registered with CUDA; no copy and no buffer of
    # this process, and a segment ctxcached keeps (--shm-cache-mb) is shared
    # by every worker on the host), or "auto" ("map" when ctxcached's address
    # is a loopback one, falling back to "fetch" for good if MapKV fails
    # other than for the context itself). Default: "auto".
    kv_transport: str = "auto"
    # Attention over a stored prefix: "dense" (the engine's own paged
    # attention over every prefix token: greedy tokens equal plain
    # generation's) or "sparse" (ctxcache.serving.sparse: each request's
    # tokens attend the prefix pages that the compact index picks, its own
    # tokens in full; the engine runs without CUDA graphs then).
    # Default: "dense".
    attention: str = "dense"
    # Sparse: stored pages a request's tokens attend, as a fraction of the
    # prefix's pages (page 0 and the recent pages come on top). Default: 0.05.
    sparse_rho: float = 0.05
    # Sparse: the fraction for a forward's chunks of several tokens of a
    # request (its prompt after the prefix); 1 = they attend the whole prefix
    # (dense prefill, sparse decode). Default: 1.
    sparse_prefill_rho: float = 1.0
    # Sparse: the budget's floor, tokens (short prefixes are read whole up to
    # this). Default: 1024.
    sparse_min_tokens: int = 1024
    # Sparse: recent pages forced besides page 0 and the prefix's last.
    # Default: 1.
    sparse_recent_pages: int = 1

    def validate(self) -> "ServingOptions":
        """Returns self; ``ValueError`` naming the first bad field."""
        if self.on_missing not in ON_MISSING_CHOICES:
            raise ValueError(f"on_missing: {self.on_missing!r}, expected one of "
                             f"{', '.join(ON_MISSING_CHOICES)}")
        for name in ("rpc_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: {v!r}, expected a number of seconds > 0")
        if not isinstance(self.refresh_interval_s, (int, float)) or self.refresh_interval_s < 0:
            raise ValueError(f"refresh_interval_s: {self.refresh_interval_s!r}, expected a "
                             "number of seconds >= 0")
        if self.kv_transport not in KV_TRANSPORT_CHOICES:
            raise ValueError(f"kv_transport: {self.kv_transport!r}, expected one of "
                             f"{', '.join(KV_TRANSPORT_CHOICES)}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention: {self.attention!r}, expected one of "
                             f"{', '.join(ATTENTION_CHOICES)}")
        for name in ("sparse_rho", "sparse_prefill_rho"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"{name}: {v!r}, expected a fraction in (0, 1]")
        for name, low in (("rpc_attempts", 1), ("min_prefix_tokens", 1),
                          ("host_cache_bytes", 0), ("load_streams", 1),
                          ("sparse_min_tokens", 0), ("sparse_recent_pages", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: {v!r}, expected an integer >= {low}")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ServingOptions":
        """Options from a mapping (e.g. parsed flags); an unknown key is a
        ``ValueError`` naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown serving option(s) {unknown}; expected some of "
                             f"{sorted(known)}")
        return cls(**dict(values)).validate()
