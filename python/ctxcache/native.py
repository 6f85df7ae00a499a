"""The native client library (``libctxcache_c.so``, C ABI
``client/include/ctxcache/c.h``) through ctypes: the bulk data path.

The library is the C++ SDK; this module only converts arguments. It moves a
stored context's K and V straight into caller memory (numpy arrays, torch
CPU tensors, pinned or not) in large frames over several connections, with
every page's crc32c checked natively and the GIL released (ctypes releases it
around every foreign call).

>>> nc = NativeClient("127.0.0.1:7700")
>>> shape = nc.context(context_id)
>>> k = torch.empty(shape.kv_shape(), dtype=torch.bfloat16).pin_memory()
>>> v = torch.empty_like(k)
>>> load = nc.start_load_kv(context_id, k, v)   # background
>>> load.wait_layer(0)                           # layer 0 first, then the rest
>>> load.wait()

The library is found at ``$CTXCACHE_NATIVE_LIB``, else next to
``$CTXCACHE_BIN_DIR`` (``../lib/libctxcache_c.so``: the build tree's
layout), else in ``build/lib`` of the source tree (the package used in place)
or of the current directory (a repository checkout).
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ctxcache import errors

__all__ = ["NativeClient", "KVLoad", "KVMap", "IndexArtifacts", "ContextShape", "DecodeSession",
           "HeadStep", "SESSION_METHODS", "library_path", "load_library"]

ABI_VERSION = 5
# The methods a decode session runs (NativeClient.open_session; c.h).
SESSION_METHODS = ("csa", "tactic", "lfps", "quest", "streaming", "oracle", "full")
_DTYPES = {"f32": 1, "f16": 2, "bf16": 3}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {1: 4, 2: 2, 3: 2}


class _Layout(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_capacity", ctypes.c_size_t), ("v_capacity", ctypes.c_size_t),
                ("layer_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
                ("token_stride", ctypes.c_int64), ("dtype", ctypes.c_int32)]


class _PageTable(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_uint32), ("kv_head", ctypes.c_uint32),
                ("blocks", ctypes.POINTER(ctypes.c_uint32)), ("n_blocks", ctypes.c_size_t)]


class _Context(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_uint64), ("n_layers", ctypes.c_uint32),
                ("n_q_heads", ctypes.c_uint32), ("n_kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32), ("block_tokens", ctypes.c_uint32),
                ("kv_dtype", ctypes.c_int32), ("state", ctypes.c_int32)]


class _Progress(ctypes.Structure):
    _fields_ = [("bytes_done", ctypes.c_uint64), ("bytes_total", ctypes.c_uint64),
                ("layers_done", ctypes.c_uint32), ("layers_total", ctypes.c_uint32),
                ("frames", ctypes.c_uint64), ("seconds", ctypes.c_double)]


class _StepCounts(ctypes.Structure):
    _fields_ = [("bytes_received", ctypes.c_uint64), ("pages_fetched", ctypes.c_uint64),
                ("cache_hits", ctypes.c_uint64)]


class _PageCacheStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "hits", "misses", "bytes", "evictions", "prefetch_requests", "prefetched_pages",
        "prefetched_bytes", "prefetch_hits", "prefetch_failures")]


class _MapLayout(ctypes.Structure):
    _fields_ = [("layer_stride", ctypes.c_uint64), ("head_stride", ctypes.c_uint64),
                ("token_stride", ctypes.c_uint64), ("v_offset", ctypes.c_uint64),
                ("n_tokens", ctypes.c_uint64), ("n_kv_heads", ctypes.c_uint32),
                ("head_dim", ctypes.c_uint32), ("n_slots", ctypes.c_uint32),
                ("dtype", ctypes.c_int32)]


class _IngestLayer(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("q", ctypes.c_void_p),
                ("k_capacity", ctypes.c_size_t), ("v_capacity", ctypes.c_size_t),
                ("q_capacity", ctypes.c_size_t), ("head_stride", ctypes.c_int64),
                ("token_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64),
                ("q_token_stride", ctypes.c_int64), ("dtype", ctypes.c_int32)]


class _IngestOptions(ctypes.Structure):
    _fields_ = [("frame_bytes", ctypes.c_uint32), ("timeout_s", ctypes.c_double),
                ("parent_tokens", ctypes.c_int64)]


class ContextShape(NamedTuple):
    """What a bulk load needs to know about a stored context."""
    n_tokens: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    block_tokens: int
    kv_dtype: str  # "bf16", "f16" or "f32"
    state: int     # ctxcache.v1.ContextState (2 = READY)

    def kv_shape(self, n_layers: Optional[int] = None) -> Tuple[int, int, int, int]:
        """The dense K (or V) shape of ``n_layers`` layers (default all)."""
        return (self.n_layers if n_layers is None else n_layers, self.n_kv_heads, self.n_tokens,
                self.head_dim)


def library_path() -> str:
    """Where the library is looked for (see the module's docstring)."""
    env = os.environ.get("CTXCACHE_NATIVE_LIB")
    if env:
        return env
    candidates = []
    bin_dir = os.environ.get("CTXCACHE_BIN_DIR")
    if bin_dir:
        candidates.append(os.path.join(bin_dir, "..", "lib", "libctxcache_c.so"))
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(here, "..", "..", "build", "lib", "libctxcache_c.so"))
    candidates.append(os.path.join("build", "lib", "libctxcache_c.so"))  # a repo checkout's cwd
    for c in candidates:
        if os.path.exists(c):
            return os.path.abspath(c)
    raise FileNotFoundError(
        "libctxcache_c.so not found: set CTXCACHE_NATIVE_LIB, or CTXCACHE_BIN_DIR to a build's or "
        "server bundle's bin/ (tried " + ", ".join(os.path.abspath(c) for c in candidates) + ")")


_lib: Optional[ctypes.CDLL] = None
_lib_lock = threading.Lock()


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads (once) and returns the library, checking its ABI version."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(path or library_path())
        P, S, U32, I, E = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int,
                           ctypes.POINTER(ctypes.c_void_p))
        sig = {
            "ctxcache_abi_version": (I, []),
            "ctxcache_free": (None, [P]),
            "ctxcache_options_create": (P, []),
            "ctxcache_options_destroy": (None, [P]),
            "ctxcache_options_set_server": (None, [P, S]),
            "ctxcache_options_set_api_key": (None, [P, S]),
            "ctxcache_options_set_tls": (None, [P, S, S, S, S]),
            "ctxcache_options_set_timeout": (None, [P, ctypes.c_double]),
            "ctxcache_options_set_max_attempts": (None, [P, I]),
            "ctxcache_connect": (I, [P, ctypes.POINTER(P), E]),
            "ctxcache_client_destroy": (None, [P]),
            "ctxcache_get_context": (I, [P, S, ctypes.POINTER(_Context), E,
                                         ctypes.POINTER(ctypes.c_size_t), E]),
            "ctxcache_build_tokens": (I, [P, S, ctypes.POINTER(U32), ctypes.c_size_t, E, E]),
            "ctxcache_load_kv_start": (I, [P, S, ctypes.POINTER(U32), ctypes.c_size_t, I, U32,
                                           ctypes.POINTER(_Layout), ctypes.POINTER(P), E]),
            "ctxcache_load_wait_layer": (I, [P, U32, E]),
            "ctxcache_load_prioritize": (I, [P, U32, E]),
            "ctxcache_load_wait": (I, [P, E]),
            "ctxcache_load_cancel": (None, [P]),
            "ctxcache_load_done": (I, [P]),
            "ctxcache_load_progress": (None, [P, ctypes.POINTER(_Progress)]),
            "ctxcache_load_destroy": (None, [P]),
            "ctxcache_map_kv_start": (I, [P, S, ctypes.POINTER(U32), ctypes.c_size_t,
                                          ctypes.POINTER(P), E]),
            "ctxcache_map_wait_layer": (I, [P, U32, E]),
            "ctxcache_map_wait": (I, [P, E]),
            "ctxcache_map_get": (None, [P, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_uint64),
                                        ctypes.POINTER(_MapLayout)]),
            "ctxcache_map_destroy": (None, [P]),
            "ctxcache_fetch_pages": (I, [P, S, U32, U32, ctypes.POINTER(U32), ctypes.c_size_t, P,
                                         ctypes.c_size_t, E]),
            "ctxcache_fetch_pages_into": (I, [P, S, ctypes.POINTER(_PageTable), ctypes.c_size_t,
                                              ctypes.POINTER(_Layout), E]),
            "ctxcache_fetch_index": (I, [P, S, S, ctypes.POINTER(P), E]),
            "ctxcache_fetch_index_layers": (I, [P, S, S, ctypes.POINTER(U32), ctypes.c_size_t,
                                                ctypes.POINTER(P), E]),
            "ctxcache_index_get": (I, [P, U32, U32, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(ctypes.c_size_t)]),
            "ctxcache_index_destroy": (None, [P]),
            "ctxcache_session_open": (I, [P, S, S, S, I, ctypes.POINTER(P), E]),
            "ctxcache_session_step": (I, [P, U32, P, ctypes.POINTER(P), E]),
            "ctxcache_session_append": (I, [P, P, P, P, E]),
            "ctxcache_session_n_tokens": (ctypes.c_int64, [P]),
            "ctxcache_session_destroy": (None, [P]),
            "ctxcache_step_n_heads": (U32, [P]),
            "ctxcache_step_group": (U32, [P, U32]),
            "ctxcache_step_head": (I, [P, U32, ctypes.POINTER(P), ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(P), ctypes.POINTER(P), ctypes.POINTER(P),
                                       ctypes.POINTER(ctypes.c_size_t)]),
            "ctxcache_step_q_head": (I, [P, U32, U32, ctypes.POINTER(P),
                                         ctypes.POINTER(ctypes.c_size_t)]),
            "ctxcache_step_destroy": (None, [P]),
            "ctxcache_step_counts": (None, [P, ctypes.POINTER(_StepCounts)]),
            "ctxcache_session_page_cache_stats": (None, [P, ctypes.POINTER(_PageCacheStats)]),
            "ctxcache_ingest_start": (I, [P, P, ctypes.c_size_t, ctypes.POINTER(_IngestOptions),
                                          ctypes.POINTER(P), E]),
            "ctxcache_ingest_write_layer": (I, [P, U32, ctypes.POINTER(_IngestLayer), E]),
            "ctxcache_ingest_commit": (I, [P, ctypes.POINTER(_Context), E, E,
                                           ctypes.POINTER(ctypes.c_size_t), E]),
            "ctxcache_ingest_destroy": (None, [P]),
        }
        for name, (res, args) in sig.items():
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = args
        if lib.ctxcache_abi_version() != ABI_VERSION:
            raise ImportError(f"libctxcache_c ABI {lib.ctxcache_abi_version()}, this module "
                              f"needs {ABI_VERSION}")
        _lib = lib
        return lib


def _call(rpc: str, fn: Any, *args: Any) -> None:
    """Calls a C function whose last argument is errptr; raises on failure."""
    err = ctypes.c_void_p()
    code = fn(*args, ctypes.byref(err))
    if code != 0:
        msg = ""
        if err.value:
            msg = ctypes.string_at(err.value).decode("utf-8", "replace")
            _lib.ctxcache_free(err)  # type: ignore[union-attr]
        # The library's message may already start with the RPC's name, which
        # the error's str() puts in front again.
        if rpc and msg.startswith(rpc + ": "):
            msg = msg[len(rpc) + 2:]
        raise errors.error_for_code(code, msg, rpc)


def _b(s: Optional[str]) -> Optional[bytes]:
    return None if s is None else s.encode()


def _u32_array(values: Sequence[int]) -> Any:
    return (ctypes.c_uint32 * len(values))(*[int(x) for x in values])


_TORCH_DTYPES = {"float32": 1, "float16": 2, "bfloat16": 3}  # torch dtype name -> C dtype


def _extent(shape: Tuple[int, ...], strides: Sequence[int], item: int) -> int:
    """Bytes a strided array reaches: the end of its last element (0 if empty)."""
    return sum((n - 1) * st for n, st in zip(shape, strides)) + item if all(shape) else 0


def _view(a: Any, name: str, expected: Tuple[int, ...], dtype: int) -> Tuple[int, int, List[int]]:
    """(address, capacity bytes, byte strides) of a 4-D CPU array/tensor with
    the expected shape and dtype; InvalidArgument naming ``name`` otherwise."""
    if hasattr(a, "data_ptr"):  # torch
        if a.device.type != "cpu":
            raise errors.InvalidArgument(f"{name}: a {a.device} tensor; expected CPU memory "
                                         "(pinned for fast copies to the GPU)")
        tname = str(a.dtype).replace("torch.", "")
        got = _TORCH_DTYPES.get(tname)
        if got != dtype:
            raise errors.InvalidArgument(f"{name}: dtype {tname}, expected the context's "
                                         f"{_DTYPE_NAMES[dtype]}")
        shape, item = tuple(a.shape), a.element_size()
        strides = [int(s) * item for s in a.stride()]
        addr = int(a.data_ptr())
    else:  # numpy (bf16 as uint16 / int16)
        import numpy as np
        arr = a
        if not isinstance(arr, np.ndarray):
            raise errors.InvalidArgument(f"{name}: a {type(a).__name__}; expected a numpy array "
                                         "or a torch CPU tensor")
        ok = {1: (np.float32,), 2: (np.float16,), 3: (np.uint16, np.int16)}[dtype]
        if arr.dtype.type not in ok:
            names = '/'.join(t.__name__ for t in ok)
            raise errors.InvalidArgument(f"{name}: dtype {arr.dtype}, expected "
                                         f"{_DTYPE_NAMES[dtype]} ({names})")
        if not arr.flags.writeable:
            raise errors.InvalidArgument(f"{name}: read-only array")
        shape, item = tuple(arr.shape), arr.itemsize
        strides = [int(s) for s in arr.strides]
        addr = int(arr.ctypes.data)
    if shape != tuple(expected):
        raise errors.InvalidArgument(f"{name}: shape {list(shape)}, expected {list(expected)} "
                                     "(layers, kv heads, tokens, head_dim)")
    if strides[3] != item or any(s < 0 for s in strides):
        raise errors.InvalidArgument(f"{name}: strides {strides} bytes; the last dimension must "
                                     "be contiguous and no stride negative")
    return addr, _extent(shape, strides, item), strides


def _host_source(a: Any, name: str, expected: Tuple[int, int, int]) -> Any:
    """A layer's K, V or Q ([heads, tokens, head_dim]) as host memory the
    library can read: torch tensors on another device are copied to the CPU,
    dtypes other than f32/f16/bf16 (numpy uint16/int16: bf16 bits) become
    f32, and a layout whose last dimension is not contiguous is made so.
    InvalidArgument naming ``name`` for another shape."""
    if tuple(a.shape) != tuple(expected):
        raise errors.InvalidArgument(f"{name}: shape {list(a.shape)}, expected "
                                     f"{list(expected)} (heads, tokens, head_dim)")
    if hasattr(a, "data_ptr"):  # torch
        if a.device.type != "cpu":
            a = a.to("cpu")
        if str(a.dtype).replace("torch.", "") not in _TORCH_DTYPES:
            a = a.float()
        if a.stride(2) != 1 or any(st < 0 for st in a.stride()):
            a = a.contiguous()
        return a
    import numpy as np
    arr = np.asarray(a)
    if arr.dtype.type not in (np.float32, np.float16, np.uint16, np.int16):
        arr = arr.astype(np.float32)
    if arr.strides[2] != arr.itemsize or any(st < 0 for st in arr.strides):
        arr = np.ascontiguousarray(arr)
    return arr


def _to_wire(a: Any, dtype: int) -> Any:
    """A :func:`_host_source` result converted to the wire dtype (1 f32,
    2 f16, 3 bf16; numpy bf16 as uint16 bits)."""
    if hasattr(a, "data_ptr"):
        import torch
        return a.to({1: torch.float32, 2: torch.float16, 3: torch.bfloat16}[dtype])
    import numpy as np
    f32 = _as_f32(a)
    if dtype == 1:
        return f32
    if dtype == 2:
        return f32.astype(np.float16)
    from ctxcache import tensors
    return tensors.float32_to_bf16(np.ascontiguousarray(f32))


def _as_f32(a: Any) -> Any:
    """A :func:`_host_source` result as f32 (numpy uint16/int16 hold bf16 bits)."""
    if hasattr(a, "data_ptr"):
        return a.float()
    import numpy as np
    if a.dtype.type in (np.uint16, np.int16):
        from ctxcache import tensors
        return tensors.bf16_to_float32(a)
    return a.astype(np.float32)


def _contiguous(a: Any) -> Any:
    if hasattr(a, "data_ptr"):
        return a.contiguous()
    import numpy as np
    return np.ascontiguousarray(a)


def _source_layout(a: Any) -> Tuple[int, int, int, int, int]:
    """(address, capacity bytes, head stride, token stride, C dtype) of a
    :func:`_host_source` result."""
    if hasattr(a, "data_ptr"):
        item = a.element_size()
        strides = [int(st) * item for st in a.stride()]
        addr, dtype = int(a.data_ptr()), _TORCH_DTYPES[str(a.dtype).replace("torch.", "")]
    else:
        import numpy as np
        item, strides, addr = a.itemsize, [int(st) for st in a.strides], int(a.ctypes.data)
        dtype = {np.float32: 1, np.float16: 2}.get(a.dtype.type, 3)
    return addr, _extent(tuple(a.shape), strides, item), strides[0], strides[1], dtype


class _Owned:
    """A library object (``self._h``) freed by the C function named
    ``_destroy`` on :meth:`close`, garbage collection or leaving a ``with``."""

    _destroy = ""
    _h = ctypes.c_void_p()

    def _live(self) -> ctypes.c_void_p:
        """The handle; ValueError once closed (the library must never be
        handed a freed object)."""
        if not self._h:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._h

    def close(self) -> None:
        if self._h:
            getattr(_lib, self._destroy)(self._h)
            self._h = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KVLoad(_Owned):
    """A bulk load running in the background (:meth:`NativeClient.start_load_kv`).

    Layers arrive in the order asked, except that one that :meth:`wait_layer`
    or :meth:`prioritize` names is taken next. Keeps the destination arrays
    alive until it is closed; closing (or garbage collection) cancels what is
    left and waits for the library to stop writing. After close, :meth:`wait`
    and :meth:`wait_layer` return at once if the load had finished, and raise
    ValueError if it had not (the buffers are incomplete).
    """

    _destroy = "ctxcache_load_destroy"

    def __init__(self, handle: int, keep: Tuple[Any, ...]) -> None:
        self._h = ctypes.c_void_p(handle)
        self._keep = keep
        self._final: Optional[Dict[str, Any]] = None  # progress at close, if it had finished

    def _finished_before_close(self) -> bool:
        if self._h:
            return False
        if self._final is None:
            raise ValueError("KVLoad was closed before the load finished: the buffers are "
                             "incomplete")
        return True

    def wait_layer(self, layer: int) -> None:
        """Blocks until ``layer`` (a context layer number) is in the buffers."""
        if self._finished_before_close():
            return
        _call("LoadKV", _lib.ctxcache_load_wait_layer, self._live(), int(layer))  # type: ignore

    def prioritize(self, layer: int) -> None:
        _call("LoadKV", _lib.ctxcache_load_prioritize, self._live(), int(layer))  # type: ignore

    def wait(self) -> Dict[str, Any]:
        """Blocks until every layer is in; returns :meth:`progress`."""
        if self._finished_before_close():
            return dict(self._final)  # type: ignore[arg-type]
        _call("LoadKV", _lib.ctxcache_load_wait, self._live())  # type: ignore[union-attr]
        return self.progress()

    def cancel(self) -> None:
        _lib.ctxcache_load_cancel(self._live())  # type: ignore[union-attr]

    @property
    def done(self) -> bool:
        return bool(_lib.ctxcache_load_done(self._live()))  # type: ignore[union-attr]

    def progress(self) -> Dict[str, Any]:
        """bytes_done, bytes_total, layers_done, layers_total, frames, seconds, gb_per_s."""
        p = _Progress()
        _lib.ctxcache_load_progress(self._live(), ctypes.byref(p))  # type: ignore[union-attr]
        out = {f: getattr(p, f) for f, _ in _Progress._fields_}
        out["gb_per_s"] = p.bytes_done / p.seconds / 1e9 if p.seconds > 0 else 0.0
        return out

    def close(self) -> None:
        if self._h and self.done:
            self._final = self.progress()
        super().close()
        self._keep = ()


class KVMap(_Owned):
    """A context's K and V in a shared-memory segment the server fills
    (:meth:`NativeClient.map_kv`), mapped read-only into this process.

    :meth:`array` is a numpy view ``[slots, 2 (K, V), kv heads, tokens,
    head_dim]`` of the segment (bf16 as uint16), without a copy; ``address``
    and ``size`` let the caller register it with CUDA (``cudaHostRegister``
    with the read-only flag) for fast copies to the GPU. Closing (or garbage
    collection) unmaps it; views taken from it must not be used after that.
    """

    _destroy = "ctxcache_map_destroy"

    def __init__(self, handle: int) -> None:
        self._h = ctypes.c_void_p(handle)
        data, size, layout = ctypes.c_void_p(), ctypes.c_uint64(), _MapLayout()
        _lib.ctxcache_map_get(self._live(), ctypes.byref(data), ctypes.byref(size),  # type: ignore
                              ctypes.byref(layout))
        self.address = int(data.value or 0)
        self.size = int(size.value)
        self.layout = {f: getattr(layout, f) for f, _ in _MapLayout._fields_}
        self.dtype = _DTYPE_NAMES.get(layout.dtype, str(layout.dtype))

    def wait_layer(self, layer: int) -> None:
        """Blocks until ``layer`` (a context layer number) is in the segment."""
        _call("MapKV", _lib.ctxcache_map_wait_layer, self._live(), int(layer))  # type: ignore

    def wait(self) -> None:
        _call("MapKV", _lib.ctxcache_map_wait, self._live())  # type: ignore[union-attr]

    def array(self) -> Any:
        import numpy as np
        lay = self.layout
        item = _ITEMSIZE[_DTYPES[self.dtype]]
        buf = (ctypes.c_uint8 * self.size).from_address(self.address)
        np_dtype = {1: np.float32, 2: np.float16, 3: np.uint16}[_DTYPES[self.dtype]]
        a = np.lib.stride_tricks.as_strided(
            np.frombuffer(buf, dtype=np_dtype),
            shape=(lay["n_slots"], 2, lay["n_kv_heads"], lay["n_tokens"], lay["head_dim"]),
            strides=(lay["layer_stride"], lay["v_offset"], lay["head_stride"],
                     lay["token_stride"], item))
        a.flags.writeable = False
        return a

class IndexArtifacts(_Owned):
    """A method's serialized artifacts (:meth:`NativeClient.open_index`), held
    by the library (one handle per fetch): :meth:`view` returns one without
    a copy. Closing (or garbage collection) frees them; views taken from it
    must not be used after that."""

    _destroy = "ctxcache_index_destroy"

    def __init__(self, handles: Sequence[int]) -> None:
        self._handles = [ctypes.c_void_p(h) for h in handles]
        self._h = self._handles[0] if self._handles else ctypes.c_void_p()

    def close(self) -> None:
        for h in self._handles:
            if h:
                _lib.ctxcache_index_destroy(h)  # type: ignore[union-attr]
        self._handles = []
        self._h = ctypes.c_void_p()

    def view(self, layer: int, kv_head: int) -> Optional[memoryview]:
        """The artifact of (layer, kv_head) as a read-only memoryview (no
        copy), or None when the index has none."""
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        self._live()
        if not any(_lib.ctxcache_index_get(h, int(layer), int(kv_head),  # type: ignore
                                           ctypes.byref(data), ctypes.byref(size)) == 0
                   for h in self._handles):
            return None
        if not size.value:
            return memoryview(b"")
        return memoryview((ctypes.c_uint8 * size.value).from_address(data.value)).toreadonly()


class HeadStep(NamedTuple):
    """One kv head of a layer-step (ctxcache/client.h SelectedKV::Head)."""
    ids: Any          # int32 [n]: the union of the group's selections, sorted
    per_q_head: List[Any]  # per q head of the group: int32 token ids, sorted
    pages: Any        # uint32: the pages fetched, sorted
    k: Any            # float32 [n, head_dim]: K of ids
    v: Any            # float32 [n, head_dim]


class DecodeSession(_Owned):
    """A decode session through the native library
    (:meth:`NativeClient.open_session`): the C++ session core, run by the
    server (``client_mode=False``) or in this process over the fetched
    index (``client_mode=True``). Closing ends it."""

    _destroy = "ctxcache_session_destroy"

    def __init__(self, handle: int, shape: ContextShape) -> None:
        self._h = ctypes.c_void_p(handle)
        self.shape = shape
        # The last step's counts, and the session's totals: page payload
        # bytes received from the server, pages fetched, pages found in the
        # session's page cache (client mode).
        self.last_step = {"bytes_received": 0, "pages_fetched": 0, "cache_hits": 0}
        self.totals = dict(self.last_step)

    @property
    def n_tokens(self) -> int:
        """The context plus the tokens appended."""
        return int(_lib.ctxcache_session_n_tokens(self._live()))  # type: ignore[union-attr]

    def step(self, layer: int, queries: Any) -> List[HeadStep]:
        """One layer-step; queries float32 [n_q_heads, head_dim] (post-RoPE).
        Returns one HeadStep per kv head (copies: they outlive the call)."""
        import numpy as np
        s = self.shape
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.shape != (s.n_q_heads, s.head_dim):
            raise errors.InvalidArgument(f"queries: shape {q.shape}, expected "
                                         f"({s.n_q_heads}, {s.head_dim})")
        st = ctypes.c_void_p()
        _call("Decode", _lib.ctxcache_session_step, self._live(),  # type: ignore[union-attr]
              int(layer), q.ctypes.data, ctypes.byref(st))
        try:
            counts = _StepCounts()
            _lib.ctxcache_step_counts(st, ctypes.byref(counts))  # type: ignore[union-attr]
            self.last_step = {name: int(getattr(counts, name)) for name, _ in counts._fields_}
            for name, value in self.last_step.items():
                self.totals[name] += value
            return [self._head(st, h) for h in range(_lib.ctxcache_step_n_heads(st))]
        finally:
            _lib.ctxcache_step_destroy(st)  # type: ignore[union-attr]

    def page_cache_stats(self) -> Dict[str, int]:
        """The session's page cache so far (client mode; all 0 in server
        mode): hits, misses, bytes held, evictions, prefetch counters."""
        out = _PageCacheStats()
        _lib.ctxcache_session_page_cache_stats(self._live(),  # type: ignore[union-attr]
                                               ctypes.byref(out))
        return {name: int(getattr(out, name)) for name, _ in out._fields_}

    def _head(self, st: ctypes.c_void_p, h: int) -> HeadStep:
        import numpy as np
        ids, k, v, pages = (ctypes.c_void_p() for _ in range(4))
        n, n_pages = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.ctxcache_step_head(st, h, ctypes.byref(ids), ctypes.byref(n), ctypes.byref(k),
                                ctypes.byref(v), ctypes.byref(pages), ctypes.byref(n_pages))
        d = self.shape.head_dim

        def arr(ptr, count, ctype, dtype):
            if not count:
                return np.zeros(0, dtype)
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)),
                                         (count,)).astype(dtype, copy=True)

        per_q = []
        for g in range(_lib.ctxcache_step_group(st, h)):
            qi, qn = ctypes.c_void_p(), ctypes.c_size_t()
            _lib.ctxcache_step_q_head(st, h, g, ctypes.byref(qi), ctypes.byref(qn))
            per_q.append(arr(qi, qn.value, ctypes.c_int32, np.int32))
        return HeadStep(arr(ids, n.value, ctypes.c_int32, np.int32), per_q,
                        arr(pages, n_pages.value, ctypes.c_uint32, np.uint32),
                        arr(k, n.value * d, ctypes.c_float, np.float32).reshape(-1, d),
                        arr(v, n.value * d, ctypes.c_float, np.float32).reshape(-1, d))

    def append(self, k: Any, v: Any, q: Any = None) -> None:
        """The new token's post-RoPE K, V float32 [n_layers, n_kv_heads,
        head_dim] and Q [n_layers, n_q_heads, head_dim] (optional)."""
        import numpy as np
        s = self.shape
        kv_shape = (s.n_layers, s.n_kv_heads, s.head_dim)
        arrays = []
        for name, x, shape in (("k", k, kv_shape), ("v", v, kv_shape),
                               ("q", q, (s.n_layers, s.n_q_heads, s.head_dim))):
            if x is None:
                arrays.append(None)
                continue
            a = np.ascontiguousarray(x, dtype=np.float32)
            if a.shape != shape:
                raise errors.InvalidArgument(f"{name}: shape {a.shape}, expected {shape}")
            arrays.append(a)
        ka, va, qa = arrays
        _call("Decode", _lib.ctxcache_session_append, self._live(),  # type: ignore[union-attr]
              ka.ctypes.data, va.ctypes.data, None if qa is None else qa.ctypes.data)


class NativeClient(_Owned):
    """A connection to ctxcached through the native library.

    Args: as :class:`ctxcache.Client` (``address`` may be ``etcd://...``):
    ``api_key`` defaults to ``$CTXCACHE_API_KEY``.
    """

    _destroy = "ctxcache_client_destroy"

    def __init__(self, address: str = "127.0.0.1:7700", *, timeout: float = 30.0,
                 max_attempts: int = 5, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, api_key: Optional[str] = None,
                 library: Optional[str] = None) -> None:
        lib = load_library(library)
        o = lib.ctxcache_options_create()
        try:
            lib.ctxcache_options_set_server(o, address.encode())
            key = api_key if api_key is not None else os.environ.get("CTXCACHE_API_KEY", "")
            lib.ctxcache_options_set_api_key(o, key.encode())
            lib.ctxcache_options_set_tls(o, _b(tls_ca), _b(tls_cert), _b(tls_key),
                                         _b(tls_server_name))
            lib.ctxcache_options_set_timeout(o, float(timeout))
            lib.ctxcache_options_set_max_attempts(o, int(max_attempts))
            h = ctypes.c_void_p()
            _call("Connect", lib.ctxcache_connect, o, ctypes.byref(h))
        finally:
            lib.ctxcache_options_destroy(o)
        self._h = h
        self.address = address

    def context(self, context_id: str) -> ContextShape:
        c = _Context()
        _call("GetContext", _lib.ctxcache_get_context, self._live(),  # type: ignore[union-attr]
              context_id.encode(), ctypes.byref(c), None, None)
        return ContextShape(c.n_tokens, c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim,
                            c.block_tokens, _DTYPE_NAMES.get(c.kv_dtype, str(c.kv_dtype)), c.state)

    def build_tokens(self, tokens: Sequence[int], model: str = "") -> str:
        """Builds (or finds) the context of ``tokens`` with the server's default
        indexes; returns its id."""
        arr = _u32_array(tokens)
        out = ctypes.c_void_p()
        _call("BuildContext", _lib.ctxcache_build_tokens, self._live(),  # type: ignore[union-attr]
              model.encode(), arr, len(tokens), ctypes.byref(out))
        try:
            return ctypes.string_at(out.value).decode()
        finally:
            _lib.ctxcache_free(out)  # type: ignore[union-attr]

    def start_load_kv(self, context_id: str, k: Any, v: Any,
                      layers: Optional[Sequence[int]] = None, streams: int = 4,
                      frame_bytes: int = 0, shape: Optional[ContextShape] = None) -> KVLoad:
        """Starts loading the K and V of ``layers`` (default all, in order) into
        ``k`` and ``v``: CPU arrays or tensors indexed (layer slot, kv head,
        token, dim), any strides with a contiguous last dimension (so a
        ``permute``d view of another layout works), of the context's kv dtype
        (bf16: torch.bfloat16, or numpy uint16). Bad buffers raise
        :class:`ctxcache.InvalidArgument` and nothing is written."""
        shape = shape or self.context(context_id)
        dtype = _DTYPES[shape.kv_dtype]
        n = shape.n_layers if not layers else len(layers)
        expected = shape.kv_shape(n)
        k_addr, k_cap, k_str = _view(k, "k", expected, dtype)
        v_addr, v_cap, v_str = _view(v, "v", expected, dtype)
        if k_str != v_str:
            raise errors.InvalidArgument(f"v: strides {v_str} differ from k's {k_str}")
        layout = _Layout(k_addr, v_addr, k_cap, v_cap, k_str[0], k_str[1], k_str[2], dtype)
        arr = _u32_array(list(layers or []))
        h = ctypes.c_void_p()
        _call("LoadKV", _lib.ctxcache_load_kv_start, self._live(),  # type: ignore[union-attr]
              context_id.encode(), arr, len(layers or []), int(streams), int(frame_bytes),
              ctypes.byref(layout), ctypes.byref(h))
        return KVLoad(h.value or 0, (k, v))

    def load_kv(self, context_id: str, k: Any, v: Any, layers: Optional[Sequence[int]] = None,
                streams: int = 4, frame_bytes: int = 0) -> Dict[str, Any]:
        """:meth:`start_load_kv`, then wait; returns the load's progress."""
        with self.start_load_kv(context_id, k, v, layers, streams, frame_bytes) as load:
            return load.wait()

    def fetch_pages_into(self, context_id: str, tables: Sequence[Tuple[int, int, Any]], k: Any,
                         v: Any, shape: Optional[ContextShape] = None) -> None:
        """Writes the pages of ``tables`` ((layer, kv head, blocks), blocks
        strictly increasing; a list or a numpy array) into ``k`` and ``v``,
        buffers of the whole context indexed (layer, kv head, token, dim) as
        :meth:`start_load_kv` takes them: each page's rows where a bulk load
        of every layer puts them, other rows untouched. One FetchKV call with
        page tables (frames of many pages, each page crc32c-checked), the GIL
        released. A bad table or buffer raises
        :class:`ctxcache.InvalidArgument` naming it, with nothing written."""
        import numpy as np
        shape = shape or self.context(context_id)
        dtype = _DTYPES[shape.kv_dtype]
        expected = shape.kv_shape()
        k_addr, k_cap, k_str = _view(k, "k", expected, dtype)
        v_addr, v_cap, v_str = _view(v, "v", expected, dtype)
        if k_str != v_str:
            raise errors.InvalidArgument(f"v: strides {v_str} differ from k's {k_str}")
        layout = _Layout(k_addr, v_addr, k_cap, v_cap, k_str[0], k_str[1], k_str[2], dtype)
        keep = []
        arr = (_PageTable * len(tables))()
        for i, (layer, head, blocks) in enumerate(tables):
            b = np.ascontiguousarray(blocks, dtype=np.uint32)
            keep.append(b)
            arr[i] = _PageTable(int(layer), int(head),
                                b.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), b.size)
        _call("FetchKV", _lib.ctxcache_fetch_pages_into,  # type: ignore[union-attr]
              self._live(), context_id.encode(), arr, len(tables), ctypes.byref(layout))

    def map_kv(self, context_id: str, layers: Optional[Sequence[int]] = None) -> KVMap:
        """Same-host bulk load: the server copies the K and V of ``layers``
        (default all) into a shared-memory segment and hands it to this
        process (no byte crosses gRPC). Returns once mapped, while the server
        fills it; :meth:`KVMap.wait_layer` waits for a layer.
        :class:`ctxcache.Unavailable` when the server's socket is not
        reachable (another host: use :meth:`load_kv`)."""
        arr = _u32_array(list(layers or []))
        h = ctypes.c_void_p()
        _call("MapKV", _lib.ctxcache_map_kv_start, self._live(),  # type: ignore[union-attr]
              context_id.encode(), arr, len(layers or []), ctypes.byref(h))
        return KVMap(h.value or 0)

    def open_session(self, context_id: str, method: str = "csa",
                     params: Optional[Dict[str, Any]] = None,
                     client_mode: bool = True) -> DecodeSession:
        """A decode session on a context with ``method`` and session ``params``
        (docs/api.md): the C++ session core here over the fetched index
        (``client_mode``), or on the server."""
        for k, v in (params or {}).items():
            if not str(k) or any(c in str(k) for c in ";=") or ";" in str(v):
                raise errors.InvalidArgument(f"params: {k!r}={v!r}: keys must be non-empty "
                                             "without ';' or '=', values without ';'")
        text = ";".join(f"{k}={v}" for k, v in (params or {}).items())
        shape = self.context(context_id)
        h = ctypes.c_void_p()
        _call("Decode", _lib.ctxcache_session_open, self._live(),  # type: ignore[union-attr]
              context_id.encode(), method.encode(), text.encode(), int(bool(client_mode)),
              ctypes.byref(h))
        return DecodeSession(h.value or 0, shape)

    def ingest(self, model: Any, tokens: Any, layers: Any, *, indexes: Any = None,
               name: str = "", labels: Optional[Dict[str, Any]] = None, ttl_seconds: int = 0,
               pin: bool = False, tenant: str = "", dtype: Any = None, parent_id: str = "",
               parent_tokens: Optional[int] = None, timeout: Optional[float] = None,
               frame_bytes: int = 0) -> Any:
        """Stores a context from KV computed elsewhere, through the library:
        arguments as :meth:`ctxcache.Client.ingest` (``model`` None with
        ``parent_id``: the parent's). Each layer's ``(k, v)`` or ``(k, v, q)``
        (numpy arrays or torch tensors on any device, [heads, tokens,
        head_dim], any strides) is read in place when it is host memory of
        f32, f16 or bf16 with a contiguous last dimension, and copied once
        per frame of ``frame_bytes`` (0: 4 MiB) into its message, with the
        GIL released. ``dtype`` ("bf16", "f16", "f32"; None: the arrays'
        own) converts first. ``parent_tokens``: the parent's n_tokens if
        known (saves a GetContext); ``timeout``: the stream's deadline in
        seconds (None: max(timeout, 3600)). A generator of layers is
        consumed lazily. Returns the stored ``ContextInfo``. Validation
        failures raise :class:`ctxcache.InvalidArgument` (or TypeError for
        non-integer tokens) and store nothing."""
        from ctxcache.client import ingest_header
        from ctxcache.v1 import ctxcache_service_pb2 as pb
        if model is None and not parent_id:
            raise ValueError("model: required unless parent_id is given")
        header = ingest_header(model, tokens, indexes=indexes, name=name, labels=labels,
                               ttl_seconds=ttl_seconds, pin=pin, tenant=tenant,
                               parent_id=parent_id)
        if header.HasField("model"):
            m = header.model
            nl, nq, nkv, d = m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim
        else:
            p = self.context(parent_id)
            nl, nq, nkv, d = p.n_layers, p.n_q_heads, p.n_kv_heads, p.head_dim
        n = len(header.tokens.ids)
        wire = None
        if dtype is not None:  # the C ABI's dtype codes are the proto's DType values
            from ctxcache import tensors
            wire = tensors.parse_dtype(dtype)
        data = header.SerializeToString()
        opts = _IngestOptions(int(frame_bytes), float(timeout or 0),
                              int(parent_tokens) if parent_tokens is not None else -1)
        h = ctypes.c_void_p()
        _call("IngestContext", _lib.ctxcache_ingest_start,  # type: ignore[union-attr]
              self._live(), data, len(data), ctypes.byref(opts), ctypes.byref(h))
        try:
            n_layers = 0
            for layer, item in enumerate(layers):
                if len(item) not in (2, 3):
                    raise ValueError(f"layer {layer}: expected (k, v) or (k, v, q)")
                srcs = [_host_source(item[0], "k", (nkv, n, d)),
                        _host_source(item[1], "v", (nkv, n, d))]
                if len(item) == 3 and item[2] is not None:
                    srcs.append(_host_source(item[2], "q", (nq, n, d)))
                if wire is not None:
                    srcs = [_to_wire(x, wire) for x in srcs]
                parts = [_source_layout(x) for x in srcs]
                if len({x[4] for x in parts}) > 1:  # one dtype per layer: f32 for all
                    srcs = [_as_f32(x) for x in srcs]
                    parts = [_source_layout(x) for x in srcs]
                if parts[0][2:4] != parts[1][2:4]:  # one stride pair for K and V
                    srcs[:2] = [_contiguous(x) for x in srcs[:2]]
                    parts = [_source_layout(x) for x in srcs]
                qp = parts[2] if len(parts) == 3 else (0, 0, 0, 0, 0)
                st = _IngestLayer(parts[0][0], parts[1][0], qp[0] or None, parts[0][1],
                                  parts[1][1], qp[1], parts[0][2], parts[0][3], qp[2], qp[3],
                                  parts[0][4])
                _call("IngestContext", _lib.ctxcache_ingest_write_layer,  # type: ignore
                      h, layer, ctypes.byref(st))
                n_layers += 1
            if n_layers != nl:
                raise ValueError(f"got {n_layers} layers of KV, the model has {nl}")
            proto, size = ctypes.c_void_p(), ctypes.c_size_t()
            _call("IngestContext", _lib.ctxcache_ingest_commit,  # type: ignore[union-attr]
                  h, None, None, ctypes.byref(proto), ctypes.byref(size))
            try:
                return pb.ContextInfo.FromString(ctypes.string_at(proto.value, size.value))
            finally:
                _lib.ctxcache_free(proto)  # type: ignore[union-attr]
        finally:
            _lib.ctxcache_ingest_destroy(h)  # type: ignore[union-attr]

    def open_index(self, context_id: str, method: str, layers: Optional[Sequence[int]] = None,
                   streams: int = 1) -> IndexArtifacts:
        """A method's serialized artifacts of every kv head of ``layers``
        (default all; FetchIndex, crc32c-checked), kept by the library until
        closed (views without a copy). ``streams`` > 1 splits the layers into
        that many runs fetched by concurrent calls (the GIL released)."""
        if layers is None:
            layers = range(self.context(context_id).n_layers)
        layers = list(layers)
        n = max(1, min(int(streams), len(layers)))
        runs = [layers[i * len(layers) // n:(i + 1) * len(layers) // n] for i in range(n)]

        def fetch(run: List[int]) -> int:
            h = ctypes.c_void_p()
            arr = _u32_array(run)
            _call("FetchIndex", _lib.ctxcache_fetch_index_layers,  # type: ignore[union-attr]
                  self._live(), context_id.encode(), method.encode(), arr, len(run),
                  ctypes.byref(h))
            return h.value or 0

        if n == 1:
            return IndexArtifacts([fetch(runs[0])])
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(fetch, r) for r in runs]
        handles, errs = [], []
        for f in futures:
            try:
                handles.append(f.result())
            except Exception as e:  # noqa: BLE001 (the first is raised, after freeing all)
                errs.append(e)
        if errs:
            IndexArtifacts(handles).close()
            raise errs[0]
        return IndexArtifacts(handles)

    def fetch_index(self, context_id: str, method: str) -> Dict[Tuple[int, int], bytes]:
        """A method's serialized artifacts by (layer, kv head), crc32c-checked
        (copies of :meth:`open_index`'s)."""
        shape = self.context(context_id)
        out: Dict[Tuple[int, int], bytes] = {}
        with self.open_index(context_id, method, range(shape.n_layers)) as idx:
            for layer in range(shape.n_layers):
                for head in range(shape.n_kv_heads):
                    view = idx.view(layer, head)
                    if view is not None:
                        out[(layer, head)] = bytes(view)
        return out
