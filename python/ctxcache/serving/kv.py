"""Host-side cache of stored contexts' dense KV, loaded once through the
native bulk path (``NativeClient.start_load_kv``: large frames, crc32c
checked natively, GIL released) and shared by every request on the context.

Sixty-four requests over one context make one load: the first caller loads,
the others wait for it (single flight). Every wait is bounded
(``load_timeout_s``); a load past it is cancelled and the callers get
:class:`ctxcache.DeadlineExceeded`. A failed load is not cached: the next
request tries again.

The buffers are torch CPU tensors (pinned when CUDA is available, for fast
copies to the GPU) of the context's kv dtype when torch is importable, else
numpy arrays (bf16 as uint16). Shape ``[n_layers, n_kv_heads, n_tokens,
head_dim]``. With ``transport="map"`` (or ``"auto"`` and ctxcached on a
loopback address) they are instead views of ctxcached's shared-memory
segment on this host (MapKV through :class:`ctxcache.engine.MappedKV`,
registered with CUDA): no copy and no buffer of this process; the segment
stays mapped while any tensor over it lives. A stored context is immutable
(content-addressed), so its KV stays correct after ctxcached evicts it: a
request that has its KV keeps it.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ctxcache import errors
from ctxcache.native import ContextShape, NativeClient
from ctxcache.serving.options import KV_TRANSPORT_CHOICES
from ctxcache.tensors import DTYPE_NAMES, wire_torch_dtype

__all__ = ["HostKV", "HostKVCache"]

_POLL_S = 0.005


@dataclass
class HostKV:
    """One context's K and V in host memory (read-only by contract)."""
    context_id: str
    shape: ContextShape
    k: Any  # [n_layers, n_kv_heads, n_tokens, head_dim]
    v: Any
    nbytes: int
    load_s: float


def _buffers(shape: ContextShape, use_torch: Optional[bool]) -> tuple:
    n = shape.kv_shape()
    torch = None
    if use_torch is not False:
        try:
            import torch  # type: ignore[no-redef]
        except ImportError:
            if use_torch:
                raise
            torch = None
    if torch is not None:
        dt = wire_torch_dtype(DTYPE_NAMES[shape.kv_dtype])
        pin = bool(torch.cuda.is_available())
        k = torch.empty(n, dtype=dt, pin_memory=pin)
        v = torch.empty(n, dtype=dt, pin_memory=pin)
        return k, v, 2 * k.numel() * k.element_size()
    import numpy as np
    dt = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32}[shape.kv_dtype]
    k = np.empty(n, dt)
    v = np.empty(n, dt)
    return k, v, 2 * k.nbytes


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.kv: Optional[HostKV] = None
        self.error: Optional[BaseException] = None


class HostKVCache:
    """Contexts' dense KV in host memory, least recently used out past
    ``capacity_bytes``.

    Args:
        address: ctxcached's ``HOST:PORT`` (a NativeClient is made lazily,
            with ``rpc_timeout_s`` per call attempt and ``rpc_attempts``).
        capacity_bytes: bytes kept; a larger context is loaded, returned and
            not kept.
        load_timeout_s: bound of one load, and of a caller's wait for it.
        streams: parallel streams per load.
        use_torch: True / False / None (torch when importable).
        transport: "fetch" (FetchKV into this process's buffers), "map"
            (MapKV, same host; needs torch) or "auto" (map when ``address``
            is a loopback one and torch is importable; after a MapKV failure
            that a FetchKV of the same context then gets past, fetch for
            good: ``map_off`` says why).
        native_kwargs: extra NativeClient arguments (tls_ca, api_key, ...).

    Thread-safe. Counters: ``loads`` (loads started), ``hits`` (gets served
    without a load of their own), ``failures``.
    """

    def __init__(self, address: str, *, capacity_bytes: int = 8 << 30,
                 load_timeout_s: float = 120.0, streams: int = 4,
                 rpc_timeout_s: float = 2.0, rpc_attempts: int = 2,
                 use_torch: Optional[bool] = None, transport: str = "fetch",
                 native_kwargs: Optional[Dict[str, Any]] = None) -> None:
        if transport not in KV_TRANSPORT_CHOICES:
            raise ValueError(f"transport: {transport!r}, expected one of "
                             f"{', '.join(KV_TRANSPORT_CHOICES)}")
        self.address = address
        self.transport = transport
        # Why "auto" stopped mapping (None while it maps).
        self.map_off: Optional[str] = None
        self.mapped_loads = 0
        self.capacity_bytes = int(capacity_bytes)
        self.load_timeout_s = float(load_timeout_s)
        self.streams = int(streams)
        self._rpc_timeout_s = float(rpc_timeout_s)
        self._rpc_attempts = int(rpc_attempts)
        self._use_torch = use_torch
        self._native_kwargs = dict(native_kwargs or {})
        self._nc: Optional[NativeClient] = None
        self._map_clients: Dict[int, NativeClient] = {}  # by the layers a MapKV maps
        self._lock = threading.Lock()
        self._kept: "OrderedDict[str, HostKV]" = OrderedDict()
        self._bytes = 0
        self._flights: Dict[str, _Flight] = {}
        self.loads = 0
        self.hits = 0
        # Seconds of the loads so far: all of them, and the part spent
        # allocating their (pinned) host buffers.
        self.load_seconds = 0.0
        self.alloc_seconds = 0.0
        self.failures = 0

    def _client(self) -> NativeClient:
        with self._lock:
            if self._nc is None:
                # The layer deadline of a load is the client's timeout: a load
                # may take up to load_timeout_s, so its layers may too.
                self._nc = NativeClient(self.address, timeout=self.load_timeout_s,
                                        max_attempts=self._rpc_attempts, **self._native_kwargs)
            return self._nc

    def _map_client(self, n_layers: int) -> NativeClient:
        """A client for MapKV calls of ``n_layers`` layers. A MapKV call's
        deadline is its client's timeout per layer mapped (it covers the
        fill), so this client's timeout makes the whole call end within
        load_timeout_s."""
        with self._lock:
            nc = self._map_clients.get(n_layers)
            if nc is None:
                nc = NativeClient(self.address, timeout=self.load_timeout_s / n_layers,
                                  max_attempts=1, **self._native_kwargs)
                self._map_clients[n_layers] = nc
            return nc

    @property
    def bytes_kept(self) -> int:
        with self._lock:
            return self._bytes

    def cached(self, context_id: str) -> Optional[HostKV]:
        """The kept KV of a context, without loading (None if not kept)."""
        with self._lock:
            kv = self._kept.get(context_id)
            if kv is not None:
                self._kept.move_to_end(context_id)
            return kv

    def drop(self, context_id: str) -> None:
        with self._lock:
            kv = self._kept.pop(context_id, None)
            if kv is not None:
                self._bytes -= kv.nbytes

    def get(self, context_id: str, shape: Optional[ContextShape] = None,
            timeout_s: Optional[float] = None) -> HostKV:
        """The context's KV, loading it if needed (one load per context at a
        time). Raises the load's :class:`ctxcache.Error` (NotFound: gone;
        Unavailable: ctxcached unreachable; DataLoss; DeadlineExceeded past
        ``timeout_s``, default ``load_timeout_s``)."""
        timeout = self.load_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            kv = self._kept.get(context_id)
            if kv is not None:
                self._kept.move_to_end(context_id)
                self.hits += 1
                return kv
            flight = self._flights.get(context_id)
            leader = flight is None
            if leader:
                flight = _Flight()
                self._flights[context_id] = flight
                self.loads += 1
            else:
                self.hits += 1
        if leader:
            try:
                flight.kv = self._load(context_id, shape, timeout)
                self._keep(flight.kv)
            except BaseException as e:  # handed to every waiter, then re-raised
                flight.error = e
                with self._lock:
                    self.failures += 1
            finally:
                with self._lock:
                    self._flights.pop(context_id, None)
                flight.done.set()
        elif not flight.done.wait(timeout):
            raise errors.DeadlineExceeded(f"context {context_id}: KV load still running after "
                                          f"{timeout:g} s", rpc="LoadKV")
        if flight.error is not None:
            raise flight.error
        assert flight.kv is not None
        return flight.kv

    def _keep(self, kv: HostKV) -> None:
        with self._lock:
            if kv.nbytes > self.capacity_bytes:
                return
            self._kept[kv.context_id] = kv
            self._bytes += kv.nbytes
            while self._bytes > self.capacity_bytes and self._kept:
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.nbytes

    def _load(self, context_id: str, shape: Optional[ContextShape], timeout: float) -> HostKV:
        nc = self._client()
        t0 = time.monotonic()
        if shape is None:
            shape = nc.context(context_id)
        if shape.state != 2:
            raise errors.FailedPrecondition(f"context {context_id} is not READY "
                                            f"(state {shape.state})", rpc="LoadKV")
        if self._maps():
            try:
                return self._load_mapped(context_id, shape, t0)
            except Exception as e:  # noqa: BLE001 (auto: fetch instead, below)
                if self.transport == "map":
                    raise
                map_error = f"{type(e).__name__}: {e}"
        else:
            map_error = None
        kv = self._load_fetched(nc, context_id, shape, t0, timeout)
        if map_error is not None:
            with self._lock:
                self.map_off = map_error  # the context itself was fine
        return kv

    def _maps(self) -> bool:
        if self.transport == "fetch" or self._use_torch is False:
            return False
        if self.transport == "map":
            return True
        if self.map_off is not None:
            return False
        host = self.address.rsplit(":", 1)[0].strip("[]")
        if not (host.startswith("127.") or host in ("localhost", "::1")):
            return False
        try:
            import torch  # noqa: F401
        except ImportError:
            return False
        return True

    def _load_mapped(self, context_id: str, shape: ContextShape, t0: float) -> HostKV:
        from ctxcache.engine.mapped import MappedKV
        m = MappedKV(self._map_client(shape.n_layers), context_id,
                     layers=list(range(shape.n_layers)))
        try:
            k, v = m.tensors()  # the segment lives as long as these do
        except BaseException:
            m.close()
            raise
        took = time.monotonic() - t0
        with self._lock:
            self.load_seconds += took
            self.mapped_loads += 1
        return HostKV(context_id, shape, k, v, m.nbytes, took)

    def _load_fetched(self, nc: NativeClient, context_id: str, shape: ContextShape, t0: float,
                      timeout: float) -> HostKV:
        t_alloc = time.monotonic()
        k, v, nbytes = _buffers(shape, self._use_torch)
        with self._lock:
            self.alloc_seconds += time.monotonic() - t_alloc
        load = nc.start_load_kv(context_id, k, v, streams=self.streams, shape=shape)
        try:
            deadline = t0 + timeout
            while not load.done:
                if time.monotonic() >= deadline:
                    load.cancel()
                    raise errors.DeadlineExceeded(
                        f"context {context_id}: KV load not done after {timeout:g} s "
                        f"({load.progress()['bytes_done']} of {nbytes} bytes)", rpc="LoadKV")
                time.sleep(_POLL_S)
            load.wait()  # raises the load's error, if any
        finally:
            load.close()
        took = time.monotonic() - t0
        with self._lock:
            self.load_seconds += took
        return HostKV(context_id, shape, k, v, nbytes, took)

    def close(self) -> None:
        with self._lock:
            clients = [self._nc] + list(self._map_clients.values())
            self._nc, self._map_clients = None, {}
            self._kept.clear()
            self._bytes = 0
        for nc in clients:
            if nc is not None:
                nc.close()

    def __enter__(self) -> "HostKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

