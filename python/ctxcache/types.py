"""Result types of the client: decoded pages and decode-session step results.

Everything else the client returns is the API's protobuf message itself
(``ContextInfo``, ``BuildProgress``, ``ServerStats``, ... from
:mod:`ctxcache.v1.ctxcache_service_pb2`), with the fields of docs/api.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["Page", "HeadResult", "StepResult"]


@dataclass
class Page:
    """One KV page of one (layer, kv head): tokens ``[block * B, block * B + n_tokens)``
    of the sequence, B = the context's ``block_tokens`` (16).

    ``k`` and ``v`` are ``[n_tokens, head_dim]``: float32 numpy arrays by default,
    the stored form with ``dtype="raw"`` (uint16 bf16 bits, float16 or float32),
    torch tensors when asked for (raw bf16 becomes ``torch.bfloat16``).
    ``crc32c`` is the checksum of the stored k||v bytes (verified on receipt).
    """

    layer: int
    kv_head: int
    block: int
    n_tokens: int
    dtype: str  # the stored dtype: "f32", "f16" or "bf16"
    k: Any
    v: Any
    crc32c: int


@dataclass
class HeadResult:
    """One kv head's part of a decode step (server-side selection).

    Attributes:
        kv_head: the kv head.
        per_q_head: the selected token ids of each q head of this kv head's group
            (q heads ``kv_head * g ... kv_head * g + g - 1``, g = n_q / n_kv), sorted
            int64 arrays.
        ids: the union of ``per_q_head`` (sorted, unique).
        k, v: K and V rows of ``ids``, ``[len(ids), head_dim]`` (from the pages).
        blocks: the pages fetched for this kv head (union of its page tables), sorted.
        pages: those pages (``Page``), in the order of ``blocks``.
    """

    kv_head: int
    per_q_head: List[np.ndarray] = field(default_factory=list)
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    k: Any = None
    v: Any = None
    blocks: List[int] = field(default_factory=list)
    pages: List[Page] = field(default_factory=list)

    def page(self, block: int) -> Page:
        """The page of ``block`` (KeyError if it was not sent)."""
        for p in self.pages:
            if p.block == block:
                return p
        raise KeyError(f"block {block} was not fetched for kv head {self.kv_head}")


@dataclass
class StepResult:
    """The result of :meth:`Session.step` for one layer.

    Attributes:
        layer: the layer.
        heads: one :class:`HeadResult` per kv head.
        selections: the selected token ids per q head (``selections[q]``).
        page_tables: ``(kv_head, subgroup, blocks)`` as the server sent them.
        stats: the server's ``SelectStats`` (entries/bytes touched, keys scored,
            select_us).
        bytes_received: K+V payload bytes of the pages received.
        estimated_mass: per q head, the estimated share of its attention the
            selection captured (session param ``estimate_mass=1``; None where
            the server sent none: docs/api.md).
    """

    layer: int
    heads: List[HeadResult]
    selections: List[np.ndarray]
    page_tables: List[tuple]
    stats: Any
    bytes_received: int = 0
    estimated_mass: List[Optional[float]] = field(default_factory=list)

    @property
    def n_pages(self) -> int:
        """Pages received in this step (all kv heads)."""
        return sum(len(h.pages) for h in self.heads)

    def pages_by_key(self) -> Dict[tuple, Page]:
        """{(kv_head, block): Page} over all heads."""
        return {(h.kv_head, p.block): p for h in self.heads for p in h.pages}
