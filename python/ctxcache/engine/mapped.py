"""A stored context's K and V read from ctxcached's shared memory on the same
host (MapKV), registered with CUDA layer by layer.

The server fills a sealed memory segment (or hands out the one it kept:
``ctxcached --shm-cache-mb``); this process maps it read-only and registers
each layer with ``cudaHostRegister`` (read-only flag) on a few threads, in
layer order, as the layers land. Copies to the GPU then read the mapping at
pinned-memory speed, without a copy into this process's memory and without
allocating pinned buffers. Registration is the host's cost (page tables of
every 4 KiB page); threads overlap it with the copies of earlier layers.

CUDA only (``cudaHostRegister``); :meth:`MappedKV.layer` also works without
CUDA (plain views of the mapping).
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ctxcache.tensors import DTYPE_NAMES, wire_torch_dtype

__all__ = ["MappedKV"]

_CUDA_HOST_REGISTER_READ_ONLY = 8


class _Mapping:
    """Owns a KVMap and its CUDA registrations. Released by
    :meth:`MappedKV.close`, or when the last tensor over it is gone (the
    buffer under every tensor holds it)."""

    def __init__(self, kvmap: Any) -> None:
        self.map = kvmap
        self.registered: List[int] = []
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self.map is None:
                return
            if self.registered:
                torch.cuda.synchronize()  # no copy may still read the mapping
                for addr in self.registered:
                    torch.cuda.cudart().cudaHostUnregister(addr)
                self.registered = []
            self.map.close()
            self.map = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class MappedKV:
    """``MappedKV(client, context_id, layers=None, register_threads=4,
    register=True)``: maps the context's layers (``layers`` in segment
    order; None = all) from ``client`` (:class:`ctxcache.native.NativeClient`,
    on the server's host). With ``register=False`` nothing is registered:
    the caller copies the layers into buffers of its own (e.g. a pinned
    arena allocated once, which costs no registration per load).

    ``layer(slot)`` returns that slot's K and V as [n_kv_heads, n_tokens,
    head_dim] tensors over the mapping, once the layer is filled and (with
    CUDA) registered; ``tensors()`` all of them as [n_slots, n_kv_heads,
    n_tokens, head_dim] views; ``address`` and ``nbytes`` locate the
    segment in this process. The mapping lives as long as this object or
    any tensor taken from it; :meth:`close` (or the context manager's exit)
    releases it at once, after which tensors taken from it must not be used
    (copies made from them are fine: it synchronizes the device first)."""

    def __init__(self, client: Any, context_id: str, layers: Optional[Sequence[int]] = None,
                 register_threads: int = 4, register: bool = True) -> None:
        if register_threads < 1:
            raise ValueError(f"MappedKV: register_threads must be >= 1, got {register_threads}")
        kvmap = client.map_kv(context_id, layers)
        self._owner = _Mapping(kvmap)
        lay = kvmap.layout
        self.n_slots, self.n_kv_heads = int(lay["n_slots"]), int(lay["n_kv_heads"])
        self.n_tokens, self.head_dim = int(lay["n_tokens"]), int(lay["head_dim"])
        self.layers: List[int] = (list(layers) if layers is not None
                                  else list(range(self.n_slots)))
        self.dtype = wire_torch_dtype(DTYPE_NAMES[kvmap.dtype])
        self.nbytes = int(kvmap.size)
        self._stride = int(lay["layer_stride"])  # bytes of one slot (K then V)
        self.address = int(kvmap.address)  # where the segment is mapped here
        buf = (ctypes.c_uint8 * kvmap.size).from_address(kvmap.address)
        buf._ctxcache_owner = self._owner  # type: ignore[attr-defined]
        # K and V of every slot as [n_slots, n_kv_heads, n_tokens, head_dim]
        # views of the segment (the layout MapKV sent, in elements).
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        item = flat.element_size()
        size = (self.n_slots, self.n_kv_heads, self.n_tokens, self.head_dim)
        stride = (self._stride // item, int(lay["head_stride"]) // item,
                  int(lay["token_stride"]) // item, 1)
        self._k = flat.as_strided(size, stride, 0)
        self._v = flat.as_strided(size, stride, int(lay["v_offset"]) // item)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ready: List[Future] = []
        if register and torch.cuda.is_available():
            self._pool = ThreadPoolExecutor(register_threads, thread_name_prefix="ctxcache-reg")
            self._ready = [self._pool.submit(self._register, s) for s in range(self.n_slots)]

    def _register(self, slot: int) -> None:
        self._owner.map.wait_layer(self.layers[slot])
        addr = self.address + slot * self._stride
        rc = torch.cuda.cudart().cudaHostRegister(addr, self._stride,
                                                  _CUDA_HOST_REGISTER_READ_ONLY)
        if int(rc) != 0:
            raise RuntimeError(f"MappedKV: cudaHostRegister of layer {self.layers[slot]} "
                               f"({self._stride} bytes) failed: CUDA error {int(rc)}")
        self._owner.registered.append(addr)

    def _wait(self, slot: int) -> None:
        if self._ready:
            self._ready[slot].result()
        else:
            self._owner.map.wait_layer(self.layers[slot])

    def layer(self, slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of segment slot ``slot`` (pinned with CUDA), waiting for it."""
        self._wait(slot)
        return self._k[slot], self._v[slot]

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot, [n_slots, n_kv_heads, n_tokens, head_dim]
        views, waiting for all of them."""
        for slot in range(self.n_slots):
            self._wait(slot)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return self._k, self._v

    def close(self) -> None:
        """Waits for pending registrations, then unregisters and unmaps."""
        if self._pool is not None:
            for f in self._ready:
                f.exception()  # wait; a failed registration registered nothing
            self._pool.shutdown()
            self._pool = None
        self._owner.release()

    def __enter__(self) -> "MappedKV":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
