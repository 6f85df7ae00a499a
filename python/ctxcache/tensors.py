"""Tensor conversion between numpy / torch arrays and the wire ``Tensor``.

Wire tensors are little-endian and row-major with dtype DTYPE_F32, DTYPE_F16
or DTYPE_BF16. numpy has no bfloat16, so bf16 data is held as its raw bits
in ``uint16`` arrays: a numpy ``uint16`` array given to the client is read as
raw bf16 (the form :meth:`Client.fetch_pages` returns with ``dtype="raw"``).
torch tensors keep their dtype (``torch.bfloat16`` is sent as bf16) and may
live on any device (they are copied to the CPU).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ctxcache.v1 import storage_pb2 as _st
from ctxcache.v1 import ctxcache_service_pb2 as _pb

__all__ = [
    "DTYPE_NAMES",
    "bf16_to_float32",
    "float32_to_bf16",
    "decode_array",
    "encode_tensor",
    "to_torch",
    "torch_available",
    "wire_itemsize",
    "wire_torch_dtype",
]

# Accepted spellings of a wire dtype.
DTYPE_NAMES = {
    "f32": _st.DTYPE_F32, "float32": _st.DTYPE_F32, "fp32": _st.DTYPE_F32,
    "f16": _st.DTYPE_F16, "float16": _st.DTYPE_F16, "fp16": _st.DTYPE_F16,
    "bf16": _st.DTYPE_BF16, "bfloat16": _st.DTYPE_BF16,
}
_ITEMSIZE = {_st.DTYPE_F32: 4, _st.DTYPE_F16: 2, _st.DTYPE_BF16: 2}

_torch: Any = None
_torch_checked = False


def _get_torch() -> Any:
    global _torch, _torch_checked
    if not _torch_checked:
        _torch_checked = True
        try:
            import torch  # noqa: F401  (optional dependency)

            _torch = torch
        except Exception:  # ImportError, or a broken CUDA install
            _torch = None
    return _torch


def wire_itemsize(wire_dtype: int) -> Optional[int]:
    """Bytes per element of a wire dtype (DTYPE_F32/F16/BF16); None for others."""
    return _ITEMSIZE.get(int(wire_dtype))


def wire_torch_dtype(wire_dtype: int) -> Any:
    """The torch dtype of a wire dtype; ValueError for an unknown one."""
    torch = _get_torch()
    if torch is None:
        raise ImportError("wire_torch_dtype needs torch")
    m = {_st.DTYPE_F32: torch.float32, _st.DTYPE_F16: torch.float16,
         _st.DTYPE_BF16: torch.bfloat16}
    if int(wire_dtype) not in m:
        raise ValueError(f"wire dtype {wire_dtype}: expected one of {sorted(m)}")
    return m[int(wire_dtype)]


def torch_available() -> bool:
    """True when ``import torch`` works."""
    return _get_torch() is not None


def _is_torch(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def parse_dtype(dtype: Any) -> int:
    """A wire DType from a name ("bf16", "float32", ...) or a DType value."""
    if isinstance(dtype, str):
        try:
            return DTYPE_NAMES[dtype.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of f32, f16, bf16") from None
    if int(dtype) in _ITEMSIZE:
        return int(dtype)
    raise ValueError(f"unknown dtype {dtype!r}")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Raw bf16 bits (uint16) to float32 (exact)."""
    return (np.asarray(bits, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to raw bf16 bits (uint16), round to nearest even (like the server)."""
    u = np.ascontiguousarray(x, dtype="<f4").view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def to_numpy(x: Any, name: str = "array") -> Tuple[np.ndarray, int]:
    """(contiguous little-endian array, wire dtype) for a numpy array, torch
    tensor or nested sequence; bf16 comes back as raw uint16 bits."""
    if _is_torch(x):
        torch = _get_torch()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), _st.DTYPE_BF16
        if t.dtype == torch.float16:
            return t.numpy(), _st.DTYPE_F16
        return t.to(torch.float32).numpy(), _st.DTYPE_F32
    a = np.asarray(x)
    if a.dtype == np.uint16 or a.dtype.name == "bfloat16":  # raw bf16 / ml_dtypes.bfloat16
        return np.ascontiguousarray(a).view("<u2"), _st.DTYPE_BF16
    if a.dtype == np.float16:
        return np.ascontiguousarray(a, dtype="<f2"), _st.DTYPE_F16
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{name}: cannot send an array of dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype="<f4"), _st.DTYPE_F32


def _convert(a: np.ndarray, src: int, dst: int) -> np.ndarray:
    if src == dst:
        return a
    if src == _st.DTYPE_BF16:
        f = bf16_to_float32(a)
    else:
        f = a.astype("<f4")
    if dst == _st.DTYPE_F32:
        return np.ascontiguousarray(f, dtype="<f4")
    if dst == _st.DTYPE_F16:
        return np.ascontiguousarray(f, dtype="<f2")
    return float32_to_bf16(f)


def encode_tensor(x: Any, shape: Optional[Sequence[int]] = None, name: str = "tensor",
                  dtype: Any = None) -> "_pb.Tensor":
    """A wire Tensor of x. ``shape``: the required shape (ValueError otherwise);
    ``dtype``: the wire dtype to convert to (default: keep x's f32/f16/bf16,
    others go as f32)."""
    a, src = to_numpy(x, name)
    if shape is not None and tuple(a.shape) != tuple(int(s) for s in shape):
        raise ValueError(f"{name}: shape {list(a.shape)}, expected {[int(s) for s in shape]}")
    dst = src if dtype is None else parse_dtype(dtype)
    a = _convert(a, src, dst)
    return _pb.Tensor(dtype=dst, shape=[int(s) for s in a.shape], data=a.tobytes())


def decode_array(data: bytes, wire_dtype: int, shape: Sequence[int],
                 dtype: str = "float32") -> np.ndarray:
    """An array of wire bytes. dtype "float32": decoded to float32 (bf16 and f16
    exactly); "raw": as stored (uint16 bits for bf16, float16, float32)."""
    if wire_dtype not in _ITEMSIZE:
        raise ValueError(f"unknown wire dtype {wire_dtype}")
    if wire_dtype == _st.DTYPE_BF16:
        a = np.frombuffer(data, dtype="<u2")
    elif wire_dtype == _st.DTYPE_F16:
        a = np.frombuffer(data, dtype="<f2")
    else:
        a = np.frombuffer(data, dtype="<f4")
    a = a.reshape(tuple(shape))
    if dtype == "raw":
        return a
    if dtype != "float32":
        raise ValueError(f"dtype must be 'float32' or 'raw', not {dtype!r}")
    if wire_dtype == _st.DTYPE_BF16:
        return bf16_to_float32(a)
    return a.astype(np.float32)


def to_torch(a: np.ndarray, wire_dtype: Optional[int] = None) -> Any:
    """A torch tensor of a decoded or raw array (raw bf16 uint16 bits become
    ``torch.bfloat16`` when wire_dtype is DTYPE_BF16). Raises ImportError
    without torch."""
    torch = _get_torch()
    if torch is None:
        raise ImportError("torch is not importable; use the numpy output")
    if wire_dtype == _st.DTYPE_BF16 and a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))
