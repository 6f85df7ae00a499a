"""The page codec of the wire: a ``pb.Page`` (K and V bytes of one page with
its crc32c) checked and decoded into a :class:`ctxcache.Page`.

A leaf module: it imports only errors, tensors, crc32c, types and the
generated messages, so the client, the session and the torch layer share it
without importing each other.
"""
from __future__ import annotations

from typing import Sequence

from ctxcache import errors
from ctxcache import tensors as _t
from ctxcache.crc32c import crc32c, crc32c_many
from ctxcache.types import Page
from ctxcache.v1 import ctxcache_service_pb2 as pb
from ctxcache.v1 import storage_pb2 as st

__all__ = ["decode_page", "check_page_crcs", "page_crc_error"]

_DTYPE_SHORT = {st.DTYPE_F32: "f32", st.DTYPE_F16: "f16", st.DTYPE_BF16: "bf16"}


def page_crc_error(p: "pb.Page", rpc: str = "") -> "errors.DataLoss":
    """The :class:`ctxcache.DataLoss` for a wire page whose crc32c does not match."""
    return errors.DataLoss(f"page crc32c mismatch (layer {p.layer}, kv head {p.kv_head}, "
                           f"block {p.block}): the page was corrupted in transit", rpc=rpc)


def check_page_crcs(pages: Sequence["pb.Page"], rpc: str = "") -> None:
    """Checks the crc32c of many wire pages in one pass (crc32c_many);
    :class:`ctxcache.DataLoss` naming the first bad one."""
    if not pages:
        return
    got = crc32c_many([p.k + p.v for p in pages])
    for p, c in zip(pages, got):
        if int(c) != p.crc32c:
            raise page_crc_error(p, rpc)


def decode_page(p: "pb.Page", dtype: str = "float32", as_torch: bool = False,
                rpc: str = "", crc_checked: bool = False) -> Page:
    """A :class:`ctxcache.Page` of a wire ``Page``, after checking its crc32c
    (unless the caller did, with :func:`check_page_crcs`) and size
    (:class:`ctxcache.DataLoss`)."""
    if not crc_checked and crc32c(p.v, crc32c(p.k)) != p.crc32c:
        raise page_crc_error(p, rpc)
    size = _t._ITEMSIZE.get(p.dtype)
    if size is None:
        raise errors.DataLoss(f"page of block {p.block} has unknown dtype {p.dtype}", rpc=rpc)
    if p.n_tokens == 0 or len(p.k) != len(p.v) or len(p.k) % (p.n_tokens * size):
        raise errors.DataLoss(f"page of block {p.block} has the wrong size", rpc=rpc)
    d = len(p.k) // (p.n_tokens * size)
    k = _t.decode_array(p.k, p.dtype, (p.n_tokens, d), dtype)
    v = _t.decode_array(p.v, p.dtype, (p.n_tokens, d), dtype)
    if as_torch:
        k, v = _t.to_torch(k, p.dtype), _t.to_torch(v, p.dtype)
    return Page(layer=p.layer, kv_head=p.kv_head, block=p.block, n_tokens=p.n_tokens,
                dtype=_DTYPE_SHORT[p.dtype], k=k, v=v, crc32c=p.crc32c)
