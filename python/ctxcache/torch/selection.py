"""Client-side page selection: a Python copy of the C++ sparse-session core
for csa, quest, streaming and oracle.

A GPU worker can select its pages itself from the index artifacts
(:meth:`ctxcache.Client.fetch_index`), with the same result as a server-side
session (:meth:`ctxcache.Client.open_session`) of the same method, token for
token and page for page. One layer-step of one kv head
(``session::SparseSession::PlanHeadWith``, docs/architecture.md, "Decode
path: one session core"):

1. select, by the method's index (:func:`make_index`):

   * :class:`StreamingIndex` = ``StreamingSelector::Select``: the first
     ``min(sink, k)`` tokens and the last ``k - that`` (k = the token budget,
     at most n). No logits.
   * :class:`QuestIndex` = ``QuestSelector::Select``: per q head, each Quest
     page's bound ``sum_j max(q_j min_j, q_j max_j)`` (float32, in order);
     pages by descending bound (ties: the lower page) taken while they fit
     the budget (the first always), every token of them. No logits.
   * :class:`OracleIndex` = ``OracleSelector::Select``: the top k of q.k
     over the context's keys (which the caller supplies: the ``ORCL``
     artifact holds no keys), ties to the lower id, computed like a server
     session (Eigen's GEMV order over chunks of 4096 keys); logits
     ``q.k / sqrt(d)`` in float32.
   * :class:`CsaIndex` = ``index::CsaSelector::Select``: per q
   head and subspace the nearest centroid (cosine), or the top ``tau`` ones
   when the best cosine is below ``backoff_cos``; the lists of those centroids
   add ``w * score`` to each listed token (``w = ||q^b||`` with
   ``weights=norm``, the default; a token missing from a list adds 0 with
   ``missing=zero``, the default); the sinks and the recent window are always
   selected, the rest of the token budget is the top of the accumulated scores
   (ties to the lower id); the accumulated score over sqrt(d) is each selected
   token's logit estimate.
2. page cap: keep ``PageBudget(page_fraction)`` pages ranked by estimated
   softmax mass (summed over the q heads), plus page 0 and the last
   ``recent_blocks + 1`` pages (``index::CapSelectedPages``).
3. block-union page tables: one sorted page list per subgroup of
   ``subgroup`` q heads (``index::BuildPageTables``).
4. whole-page widening: each q head attends every token of its subgroup's
   pages (``index::ExpandToTablePages``).

:func:`session_step` runs the four stages (``SessionParams::PageStep`` after
the selection) for one kv head; :class:`ClientSession` holds every (layer, kv
head) of a context for one method and plans a whole layer like
``Session.step`` does (:class:`CsaSession` is its csa form). The page cap
ranks pages by estimated mass where the selector gives logits (csa, oracle),
else by selected-token count (quest, streaming, and csa steps that reuse a
search).

Limitation: the session must have appended no tokens. The C++ selectors
add every appended key (``CsaSelector::Append`` inserts it into its lists,
Quest widens its last page's bounds, streaming's window moves) and the
session pages then reach into the appended K/V; this module covers the stored
context only (``n_tokens`` = the artifact's), i.e. the steps a session runs
before its first ``append``.

Exactness. The selections depend on float32 rounding (the accumulated scores
rank the tokens, and ties are common because list scores are fp16), so the
arithmetic here follows the compiled C++ (GCC 12, ``-O3
-march=x86-64-v3``, Eigen 3.4, the project's Release build) operation for
operation:

* ``||q^b||`` and the centroid similarities ``C q^b`` are Eigen reductions;
  their summation order (8-lane packets, the packet reduction tree, and which
  products GCC fused into FMAs) is reproduced by :func:`eigen_squared_norm`
  and :func:`eigen_gemv`.
* list entries add ``fma(score, w, bias)`` in float32 (``AccumulateList``),
  one list after the other, subspace by subspace, exactly like the dense
  float32 accumulator of ``CsaSelector::SearchOne``.
* the page masses are float64 like ``CapSelectedPages``: the exponentials
  use the C library's ``exp`` (:func:`math.exp`; numpy's vectorized ``exp``
  differs in the last bit on AVX-512 machines), the normaliser is summed in
  order, and each page's mass is summed head by head in selection order.
* csa's compact artifacts hold the loader's scores exactly: version 2's
  codebook entries, version 1's values dequantized with the loader's fused
  multiply-add (:mod:`ctxcache.torch.artifacts`).

Quest's bounds and oracle's dot products are float32 too: Quest's sum runs
in the compiled loop's order (each product, max and sum rounded; GCC neither
reassociates nor fuses it), oracle's in Eigen's GEMV order
(:func:`eigen_gemv`, per chunk of :data:`ORACLE_KEY_CHUNK` keys as
``ScoreAllKeys`` gathers them).

Checked by python/tests/test_selection.py (csa) and test_gpu_selection.py
(quest, streaming, oracle): identical selections and page tables against a
real ctxcached, and (csa) bit-identical logit estimates, selections and page
tables against the build's compiled core (a small harness linked to its
``libctxcache_index.a``). Not covered by that check: a context with C = 1
centroid and ``weights=proj`` (Eigen inlines that 1-row product as a dot
product; emulated like the norm's reduction), and a build with other flags
(``CTXCACHE_NATIVE`` selects other packet sizes; another compiler or Eigen
may fuse or order differently). The page masses assume the same C library
``exp`` as the server's (glibc on x86-64 here).

Inputs may be numpy arrays or torch tensors (any device; they are copied to
the CPU, the work is numpy). :func:`session_step` returns torch tensors on
the queries' device when given torch queries.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ctxcache.torch.tables import (SKETCH_QUERY_MAX_CODE, SessionParams, _check_rerank_method,
                                   budget_for as _budget_for, page_budget, token_budget)
from ctxcache.torch.artifacts import (CsaArtifact, CsaOptions, OracleArtifact, QuestArtifact,
                                      StreamingArtifact, fma_f32, parse_csa_artifact,
                                      parse_oracle_artifact, parse_quest_artifact,
                                      parse_streaming_artifact)

__all__ = [
    "ClientSession", "CsaIndex", "CsaSelection", "CsaSession", "HeadStep", "METHODS",
    "OracleIndex", "PageTable", "QuestIndex", "SessionParams", "StreamingIndex", "make_index",
    "oracle_scores", "quest_page_scores", "quest_take_pages_exact",
    "build_page_tables", "cap_selected_pages", "eigen_gemv", "eigen_squared_norm",
    "expand_to_table_pages", "page_budget", "session_step", "token_budget",
]

_F32 = np.float32


# --------------------------------------------------------------------------
# Float32 reductions in the order of the compiled Eigen code.


def _predux8(c: np.ndarray) -> np.ndarray:
    """Eigen's ``predux<Packet8f>`` over the last axis (8 lanes): the two
    128-bit halves added, then ``movehl`` and one shuffle:
    ((c0+c4) + (c2+c6)) + ((c1+c5) + (c3+c7))."""
    b = c[..., 0:4] + c[..., 4:8]
    return (b[..., 0] + b[..., 2]) + (b[..., 1] + b[..., 3])


def _predux4(c: np.ndarray) -> np.ndarray:
    """``predux<Packet4f>``: (c0+c2) + (c1+c3)."""
    return (c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3])


def _scalar_tail(acc: np.ndarray, a: np.ndarray, b: np.ndarray, start: int) -> np.ndarray:
    """``for (j = start; j < n; ++j) acc += a[j] * b[j];`` as GCC compiled it:
    it vectorizes the first 4 products when at least 4 are left (rounded
    products, added in order), and contracts the remaining ones into FMAs."""
    n = a.shape[-1]
    j = start
    if n - j >= 4:
        p = a[..., j:j + 4] * b[..., j:j + 4]
        for t in range(4):
            acc = acc + p[..., t]
        j += 4
    for t in range(j, n):
        acc = fma_f32(a[..., t], b[..., t], acc)
    return acc


def _eigen_redux_dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sum(x * y) over the last axis in the order of Eigen's linear vectorized
    redux as GCC compiled it: with n >= 8, two 8-lane accumulators over
    16-element steps (the first products rounded, later ones fused),
    combined, one more packet if left, the packet reduction, then the tail;
    with n < 8: x0*y0, then the scalar tail."""
    n = x.shape[-1]
    if n < 8:
        return _scalar_tail(x[..., 0] * y[..., 0], x, y, 1)
    a8, a16 = n & ~7, n & ~15
    p0 = x[..., 0:8] * y[..., 0:8]
    if a8 > 8:
        p1 = x[..., 8:16] * y[..., 8:16]
        for j in range(16, a16, 16):
            p0 = fma_f32(x[..., j:j + 8], y[..., j:j + 8], p0)
            p1 = fma_f32(x[..., j + 8:j + 16], y[..., j + 8:j + 16], p1)
        p0 = p0 + p1
        if a8 > a16:
            p0 = fma_f32(x[..., a16:a8], y[..., a16:a8], p0)
    return _scalar_tail(_predux8(p0), x, y, a8)


def eigen_squared_norm(x: np.ndarray) -> np.ndarray:
    """``Map<const VectorXf>(x, n).squaredNorm()`` over the last axis, as
    compiled into ``CsaSelector::SearchOne`` (the norm is its square root):
    ``cwiseAbs2().sum()``, see :func:`_eigen_redux_dot`."""
    x = np.asarray(x, dtype=_F32)
    return _eigen_redux_dot(x, x)


def eigen_gemv(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``a * x`` for a row-major ``a`` [..., R, n] and ``x`` [..., n] (leading
    axes broadcast) -> [..., R], as Eigen 3.4's ``general_matrix_vector_product``
    (row-major kernel) computes it with AVX2+FMA.

    Rows are processed in blocks of 8, 4 and 2, each row with an 8-lane FMA
    accumulator over whole packets, the packet reduction and the scalar tail;
    a last odd row also uses a 4-lane half packet.
    """
    a = np.asarray(a, dtype=_F32)
    x = np.asarray(x, dtype=_F32)[..., None, :]
    rows, n = a.shape[-2], a.shape[-1]
    a, x = np.broadcast_arrays(a, x)
    a8 = n & ~7
    c = np.zeros(a.shape[:-1] + (8,), dtype=_F32)
    for j in range(0, a8, 8):
        c = fma_f32(a[..., j:j + 8], x[..., j:j + 8], c)
    cc = _predux8(c)
    out = np.empty(a.shape[:-1], dtype=_F32)
    blocked = rows - (rows & 1)  # rows of the 8/4/2-row blocks
    out[..., :blocked] = _scalar_tail(cc[..., :blocked], a[..., :blocked, :],
                                      x[..., :blocked, :], a8)
    if rows & 1:
        last = cc[..., -1]
        h = np.zeros(last.shape + (4,), dtype=_F32)
        j = a8
        if n - j >= 4:
            h = fma_f32(a[..., -1, j:j + 4], x[..., -1, j:j + 4], h)
            j += 4
        last = last + _predux4(h)
        for t in range(j, n):
            last = fma_f32(a[..., -1, t], x[..., -1, t], last)
        out[..., -1] = last
    if rows == 1:  # Eigen turns a 1-row product into a dot product (a redux)
        out = _eigen_redux_dot(a[..., 0, :], x[..., 0, :])[..., None]
    return out


# --------------------------------------------------------------------------
# Stage 1: the csa selector.


def _to_numpy(x: Any, dtype=_F32) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        x = x.detach().to("cpu")
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.numpy()
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


def _check_select_input(method: str, queries: Any, head_dim: int, budget: int) -> np.ndarray:
    """``ValidateSelectInput``: queries [G, d] float32 with 1 <= G <= 1024, all
    finite, and budget >= 0; returns the queries as a float32 numpy array."""
    q = _to_numpy(queries)
    if q.ndim != 2 or q.shape[1] != head_dim:
        raise ValueError(f"{method}: queries have shape {list(q.shape)}, expected "
                         f"[G, {head_dim}]")
    if not (1 <= q.shape[0] <= 1024):
        raise ValueError(f"{method}: {q.shape[0]} query rows, expected 1..1024")
    if not np.isfinite(q).all():
        raise ValueError(f"{method}: queries have NaN/Inf")
    if budget < 0:
        raise ValueError(f"{method}: budget={budget}, expected >= 0 (0 = rho * n)")
    return q


def _top_k_by_id(scores: np.ndarray, k: int) -> np.ndarray:
    """``SelectTopK(.., TopKOrder::kById)``: the ids of the k largest scores,
    ties to the lower id, in ascending id order."""
    n = scores.size
    k = max(0, min(k, n))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(scores, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(scores > kth)
    ties = np.flatnonzero(scores == kth)[:k - above.size]
    return np.sort(np.concatenate([above, ties]))


def sketch_query(q: np.ndarray) -> Tuple[np.float32, np.ndarray]:
    """The query side of a csa sketch score (``SketchQuery``): (qs, qi) with
    qs = max|q| / 2047 in float32 and qi = round(q / qs) (ties to even) as
    int64, all zero when q is."""
    q = np.asarray(q, dtype=_F32)
    qs = _F32(np.max(np.abs(q)) / _F32(SKETCH_QUERY_MAX_CODE)) if q.size else _F32(0.0)
    if not qs > 0:
        return qs, np.zeros(q.shape, dtype=np.int64)
    return qs, np.rint(q / qs).astype(np.int64)


def sketch_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``CsaSelector::SketchScores`` for one query over rows of int8 codes
    [k, d] and their fp16 scales [k]: float32(double(exact integer dot) *
    (double(qs) * double(scale)))."""
    qs, qi = sketch_query(q)
    dots = codes.astype(np.int64) @ qi
    return (dots.astype(np.float64) *
            (np.float64(qs) * scales.astype(np.float64))).astype(_F32)


@dataclass
class CsaSelection:
    """``index::Selection`` of one kv head's group.

    per_head: int32 token ids per q head, ascending.
    per_head_logits: float32 logit estimates parallel to ``per_head`` (empty
        when a search period > 1 reused the last selection).
    merged: the union of ``per_head``.
    """

    per_head: List[np.ndarray]
    per_head_logits: List[np.ndarray]
    merged: np.ndarray


class CsaIndex:
    """The csa selector of one (layer, kv head), read from its artifact.

    ``CsaIndex(bytes_or_parsed_artifact)``; :meth:`select` is
    ``CsaSelector::Select`` for a session that has appended no tokens (the
    module docstring says why). Like the C++ selector it keeps the search
    schedule of one session (``period`` > 1 reuses a selection); use one
    instance per session, or :meth:`reset`.
    """

    def __init__(self, artifact: Union[CsaArtifact, bytes, bytearray, memoryview]) -> None:
        if not isinstance(artifact, CsaArtifact):
            artifact = parse_csa_artifact(artifact)
        self.artifact = artifact
        self.options: CsaOptions = artifact.options
        self.n_tokens = int(artifact.n_tokens)
        self.head_dim = int(artifact.head_dim)
        o = self.options
        self.m, self.C, self.ds = o.m, o.C, self.head_dim // o.m
        self.L = int(artifact.L)
        self._centroids = artifact.centroids  # [m, C, ds]
        self._ids = artifact.ids.astype(np.int64)  # [m, C, L]
        self._scores = artifact.scores.astype(_F32)  # fp16 widened exactly
        # missing=min imputes the heap root: a CSAP list's entry 0 as stored, a
        # CSAC list's lowest score (the loader rebuilds the heap).
        self._list_min = (self._scores.min(axis=2) if artifact.compact
                          else self._scores[:, :, 0].copy())
        self._tail_mean = artifact.tail_mean
        self._sketch = artifact.sketch  # int8 [n, d] or None (rerank 0)
        self._sketch_scale = artifact.sketch_scale
        self.reset()

    def reset(self) -> None:
        """Forgets the search schedule (``period`` > 1)."""
        self._steps_since_search = 0
        self._last_per_head: List[np.ndarray] = []

    def set_rerank(self, rerank: float, where: str = "") -> None:
        """A session's ``rerank`` (``CsaSelector::ApplySessionOverrides``):
        0 (the lists alone) or in [1, 64]; > 0 needs the key sketch. The
        artifact's options stay as parsed; ValueError names the param."""
        if not (rerank == 0 or 1 <= rerank <= 64):
            raise ValueError(f"session param rerank must be 0 or in [1, 64], got {rerank}")
        if rerank > 0 and self._sketch is None:
            raise ValueError(f"csa: rerank={rerank:g} needs the key sketch, which the index of "
                             f"{where or 'this context'} was built without (rerank=0 at build); "
                             "expected rerank=0")
        self.options = replace(self.options, rerank=float(rerank))
        self.reset()

    def _missing(self, b: int, j: int) -> np.float32:
        o = self.options
        if o.impute_tail_mean:
            return self._tail_mean[b, j]
        if o.impute_min:
            return self._list_min[b, j]  # the heap root: the list's lowest score
        return _F32(0.0)

    def _search_one(self, q: np.ndarray, norms: np.ndarray, sims: np.ndarray,
                    k: int) -> Tuple[np.ndarray, np.ndarray]:
        """``CsaSelector::SearchOne`` for one q head: (ids, logits)."""
        o = self.options
        n, m, C = self.n_tokens, self.m, self.C
        acc = np.zeros(n, dtype=_F32)
        norm_sum = _F32(0.0)
        for b in range(m):
            norm = norms[b]
            norm_sum = _F32(norm_sum + norm)
            if not norm > 0:
                continue  # a zero sub-query carries no signal
            s = sims[b]
            best = int(np.argmax(s))  # first of equal maxima, as the C++ loop
            w = norm if o.norm_weights else _F32(1.0)

            def weight(j: int) -> np.float32:
                return s[j] if o.proj_weights else w

            if o.tau > 1 and float(_F32(s[best] / norm)) < o.backoff_cos:
                tau = min(o.tau, C)
                order = np.lexsort((np.arange(C), -s))[:tau]  # sims desc, index asc
                chosen = [(int(j), _F32(weight(int(j)) / _F32(tau))) for j in order]
            else:
                chosen = [(best, weight(best))]
            for j, wj in chosen:
                # AccumulateList: acc[id] += fma(score, w, bias), in float32;
                # ids are unique within a list, so one vectorized add per list.
                bias = _F32(-wj * self._missing(b, j))
                if bias == 0:  # fma(s, w, +-0) is the rounded product
                    vals = self._scores[b, j] * wj
                else:
                    vals = fma_f32(self._scores[b, j], wj, bias)
                acc[self._ids[b, j]] += vals
        n_sinks = min(o.sinks, n)
        recent_start = max(n_sinks, n - o.recent)
        forced = np.concatenate([np.arange(n_sinks), np.arange(recent_start, n)]).astype(np.int64)
        if o.norm_weights or o.proj_weights:
            to_logit = _F32(_F32(1.0) / np.sqrt(_F32(self.head_dim)))
        else:
            to_logit = _F32(_F32(norm_sum / _F32(m)) / np.sqrt(_F32(self.head_dim)))
        if o.rerank > 0 and self._sketch is not None:
            return self._rerank(q, acc, forced, k)
        selected = forced
        if k > forced.size:
            ranked = acc.copy()
            ranked[forced] = -np.inf
            top = _top_k_by_id(ranked, k - forced.size)
            selected = np.sort(np.concatenate([forced, top]))
        logits = (acc[selected] * to_logit).astype(_F32)
        return selected.astype(np.int32), logits

    def _rerank(self, q: np.ndarray, acc: np.ndarray, forced: np.ndarray,
                k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Stage 2 of ``SearchOne`` (rerank > 0): the forced tokens and the top
        ``ceil(rerank * k) - |forced|`` others by the list estimate are
        scored with the key sketch; the best of the others fill the budget."""
        n = self.n_tokens
        cand = np.zeros(0, dtype=np.int64)
        if k > forced.size:
            want = min(n - forced.size, int(math.ceil(self.options.rerank * float(k))) - forced.size)
            ranked = acc.copy()
            ranked[forced] = -np.inf
            cand = _top_k_by_id(ranked, want)
        forced_r = sketch_scores(q, self._sketch[forced], self._sketch_scale[forced])
        cand_r = sketch_scores(q, self._sketch[cand], self._sketch_scale[cand])
        pick = _top_k_by_id(cand_r, k - forced.size) if k > forced.size else cand[:0]
        ids = np.concatenate([forced, cand[pick]])
        r = np.concatenate([forced_r, cand_r[pick]])
        order = np.argsort(ids, kind="stable")
        inv_sqrt_d = _F32(_F32(1.0) / np.sqrt(_F32(self.head_dim)))
        return ids[order].astype(np.int32), (r[order] * inv_sqrt_d).astype(_F32)

    def select(self, queries: Any, budget: int = 0) -> CsaSelection:
        """``CsaSelector::Select``: queries [G, d] (the q heads of this kv
        head's group, post-RoPE, float32); ``budget`` tokens per q head (0 =
        ``ceil(rho * n)`` with the artifact's rho; a session passes
        :meth:`SessionParams.token_budget`)."""
        q = _check_select_input("csa", queries, self.head_dim, budget)
        g = q.shape[0]
        o = self.options
        if (o.period > 1 and 0 < self._steps_since_search < o.period
                and len(self._last_per_head) == g):
            # Reuse (no appends: nothing to add to the last search's selection).
            per_head = [h.copy() for h in self._last_per_head]
            logits: List[np.ndarray] = []
            self._steps_since_search += 1
        else:
            k = _budget_for(budget, o.rho, self.n_tokens)
            qs = q.reshape(g, self.m, self.ds)
            norms = np.sqrt(eigen_squared_norm(qs))  # [G, m]
            sims = eigen_gemv(self._centroids, qs)   # [G, m, C]
            per_head, logits = [], []
            for h in range(g):
                ids, lg = self._search_one(q[h], norms[h], sims[h], k)
                per_head.append(ids)
                logits.append(lg)
            if o.period > 1:
                self._last_per_head = [h.copy() for h in per_head]
                self._steps_since_search = 1
        merged = np.unique(np.concatenate(per_head)) if per_head else np.zeros(0, np.int32)
        return CsaSelection(per_head=per_head, per_head_logits=logits,
                            merged=merged.astype(np.int32))


# --------------------------------------------------------------------------
# Stage 1 for the other methods: streaming, quest and oracle.


def _selection(per_head: List[np.ndarray], logits: List[np.ndarray]) -> CsaSelection:
    merged = np.unique(np.concatenate(per_head)) if per_head else np.zeros(0, np.int32)
    return CsaSelection(per_head=per_head, per_head_logits=logits,
                        merged=merged.astype(np.int32))


def _length_budget(budget: int, rho: float, n: int) -> int:
    """The streaming and quest budget: ``budget`` (or ``ceil(rho * n)`` when
    0), at most n (no lower clamp, unlike ``BudgetFor``)."""
    k = budget if budget > 0 else int(math.ceil(rho * float(n)))
    return min(k, n)


class StreamingIndex:
    """``index::StreamingSelector`` of one (layer, kv head), from its ``STR1``
    artifact: every q head selects the first ``min(n_sink, k)`` tokens and
    the last ``k - that`` (k = the budget, at most n). No logits (the page cap
    ranks pages by selected-token count)."""

    method = "streaming"

    def __init__(self, artifact: Union[StreamingArtifact, bytes, bytearray, memoryview]) -> None:
        if not isinstance(artifact, StreamingArtifact):
            artifact = parse_streaming_artifact(artifact)
        self.artifact = artifact
        self.n_tokens, self.head_dim = artifact.n_tokens, artifact.head_dim
        self.n_sink, self.rho = artifact.n_sink, artifact.rho

    def reset(self) -> None:
        """No state (for the session interface)."""

    def ids(self, budget: int) -> np.ndarray:
        """The selected ids (int32, ascending) for ``budget`` tokens."""
        n = self.n_tokens
        k = _length_budget(budget, self.rho, n)
        n_sink = min(self.n_sink, k)
        recent_start = max(n_sink, n - (k - n_sink))
        return np.concatenate([np.arange(n_sink), np.arange(recent_start, n)]).astype(np.int32)

    def select(self, queries: Any, budget: int = 0) -> CsaSelection:
        """``StreamingSelector::Select`` (queries checked, otherwise unused)."""
        q = _check_select_input("streaming", queries, self.head_dim, budget)
        ids = self.ids(budget)
        return _selection([ids.copy() for _ in range(q.shape[0])], [])


def quest_page_scores(q: np.ndarray, page_min: np.ndarray, page_max: np.ndarray) -> np.ndarray:
    """``QuestSelector::PageScore`` for queries [G, d] and pages [P, d] ->
    [G, P] float32: ``s += max(q[j] * min[j], q[j] * max[j])`` for j = 0..d-1
    in order, each product and sum rounded to float32 (the compiled loop does
    not reassociate and cannot fuse across the max)."""
    q = np.asarray(q, dtype=_F32)
    s = np.zeros((q.shape[0], page_min.shape[0]), dtype=_F32)
    for j in range(q.shape[1]):
        qj = q[:, j:j + 1]
        s = s + np.maximum(qj * page_min[None, :, j], qj * page_max[None, :, j])
    return s


def quest_take_pages_exact(scores: np.ndarray, n: int, page: int, budget: int) -> List[int]:
    """The pages ``QuestSelector::Select`` takes for one q head (ascending),
    from the page bounds [P]: in descending bound order (ties: the lower
    page, ``std::stable_sort``), each page that fits the budget (at most n)
    is taken (the first always) until the taken tokens reach it."""
    k = min(budget, n)
    order = np.argsort(-scores, kind="stable")
    pages: List[int] = []
    taken = 0
    for p in order.tolist():
        length = min(page, n - p * page)
        if pages and taken + length > k:
            continue
        pages.append(p)
        taken += length
        if taken >= k:
            break
    return sorted(pages)


class QuestIndex:
    """``index::QuestSelector`` of one (layer, kv head), from its ``QST1``
    artifact. Per q head: every Quest page's upper bound of q.k
    (:func:`quest_page_scores`); pages in descending bound order (ties: the
    lower page, ``std::stable_sort``) are taken while the budget lasts: a page
    that would overflow it is skipped unless it is the first; the walk stops
    once the taken tokens reach the budget. The selection is every token of
    the taken pages. No logits (the page cap ranks pages by count)."""

    method = "quest"

    def __init__(self, artifact: Union[QuestArtifact, bytes, bytearray, memoryview]) -> None:
        if not isinstance(artifact, QuestArtifact):
            artifact = parse_quest_artifact(artifact)
        self.artifact = artifact
        self.n_tokens, self.head_dim = artifact.n_tokens, artifact.head_dim
        self.page_size, self.rho = artifact.page_size, artifact.rho
        self.page_min, self.page_max = artifact.page_min, artifact.page_max

    def reset(self) -> None:
        """No state (for the session interface)."""

    def select(self, queries: Any, budget: int = 0) -> CsaSelection:
        """``QuestSelector::Select`` for queries [G, d]."""
        q = _check_select_input("quest", queries, self.head_dim, budget)
        n, b = self.n_tokens, self.page_size
        k = _length_budget(budget, self.rho, n)
        score = quest_page_scores(q, self.page_min, self.page_max)
        per_head = []
        for h in range(q.shape[0]):
            ids = [np.arange(p * b, min(n, (p + 1) * b))
                   for p in quest_take_pages_exact(score[h], n, b, k)]
            per_head.append(np.concatenate(ids).astype(np.int32) if ids
                            else np.zeros(0, np.int32))
        return _selection(per_head, [])


ORACLE_KEY_CHUNK = 4096  # ScoreAllKeys gathers and scores the keys in chunks of this many


def oracle_scores(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """q.k of queries [G, d] against keys [n, d] -> [G, n] float32, as a
    server session's oracle computes them: ``ScoreAllKeys`` over a page
    fetcher's keys, ``K * q`` per chunk of :data:`ORACLE_KEY_CHUNK` rows in
    Eigen's GEMV order (:func:`eigen_gemv`)."""
    q = np.asarray(q, dtype=_F32)
    n = keys.shape[0]
    out = np.empty((q.shape[0], n), dtype=_F32)
    for start in range(0, n, ORACLE_KEY_CHUNK):
        chunk = keys[start:start + ORACLE_KEY_CHUNK]
        for h in range(q.shape[0]):
            out[h, start:start + chunk.shape[0]] = eigen_gemv(chunk, q[h])
    return out


class OracleIndex:
    """``index::OracleSelector`` of one (layer, kv head): the exact top-k of
    q.k over every key (ties: the lower id), logits ``q.k * (1 / sqrt(d))``
    in float32 (the page cap ranks pages by their estimated mass).

    The ``ORCL`` artifact holds the shape only: the keys [n, d] are the
    context's stored keys as a server session reads them (bf16 widened to
    float32; ``Client.fetch_pages``)."""

    method = "oracle"

    def __init__(self, artifact: Union[OracleArtifact, bytes, bytearray, memoryview],
                 keys: Any) -> None:
        if not isinstance(artifact, OracleArtifact):
            artifact = parse_oracle_artifact(artifact)
        self.artifact = artifact
        self.n_tokens, self.head_dim, self.rho = artifact.n_tokens, artifact.head_dim, artifact.rho
        k = _to_numpy(keys)
        if k.shape != (self.n_tokens, self.head_dim):
            raise ValueError(f"oracle: keys have shape {list(k.shape)}, expected "
                             f"[{self.n_tokens}, {self.head_dim}]")
        if not np.isfinite(k).all():
            raise ValueError("oracle: keys have NaN/Inf")
        self.keys = k

    def reset(self) -> None:
        """No state (for the session interface)."""

    def select(self, queries: Any, budget: int = 0) -> CsaSelection:
        """``OracleSelector::Select`` for queries [G, d]."""
        q = _check_select_input("oracle", queries, self.head_dim, budget)
        k = _budget_for(budget, self.rho, self.n_tokens)
        scores = oracle_scores(q, self.keys)
        inv = _F32(_F32(1.0) / np.sqrt(_F32(self.head_dim)))
        per_head, logits = [], []
        for h in range(q.shape[0]):
            ids = _top_k_by_id(scores[h], k)
            per_head.append(ids.astype(np.int32))
            logits.append((scores[h, ids] * inv).astype(_F32))
        return _selection(per_head, logits)


Index = Union[CsaIndex, StreamingIndex, QuestIndex, OracleIndex]
METHODS = ("csa", "quest", "streaming", "oracle")  # the methods with a client-side index


def make_index(method: str, artifact: Any, keys: Any = None) -> Index:
    """The client-side index of ``method`` from its artifact (bytes as
    ``Client.fetch_index`` returns them, or parsed); ``keys`` [n, d] for
    oracle. ValueError for another method."""
    if method == "csa":
        return artifact if isinstance(artifact, CsaIndex) else CsaIndex(artifact)
    if method == "streaming":
        return artifact if isinstance(artifact, StreamingIndex) else StreamingIndex(artifact)
    if method == "quest":
        return artifact if isinstance(artifact, QuestIndex) else QuestIndex(artifact)
    if method == "oracle":
        if isinstance(artifact, OracleIndex):
            return artifact
        if keys is None:
            raise ValueError("oracle: needs the context's keys (keys=[n_tokens, head_dim] per "
                             "layer and kv head)")
        return OracleIndex(artifact, keys)
    raise ValueError(f"method '{method}' has no client-side selection; expected one of "
                     f"{', '.join(METHODS)}")


# --------------------------------------------------------------------------
# Stages 2-4.


@dataclass
class PageTable:
    """``index::PageTable``: the pages of one subgroup of q heads."""

    subgroup: int
    q_heads: List[int]
    pages: np.ndarray  # int32, ascending, unique
    selected_tokens: int = 0
    fetched_tokens: int = 0

    @property
    def efficiency(self) -> float:
        return self.selected_tokens / self.fetched_tokens if self.fetched_tokens else 1.0


def _page_mass(per_q_head: Sequence[np.ndarray], logits: Sequence[np.ndarray], n_pages: int,
               page_size: int, n_tokens: int) -> np.ndarray:
    """Estimated softmax mass per page, float64, in the C++ summation order."""
    mass = np.zeros(n_pages, dtype=np.float64)
    for ids, lg in zip(per_q_head, logits):
        lg = np.asarray(lg, dtype=_F32)
        if lg.size == 0:
            continue
        mx = lg.max()
        # exp(double(x - mx)) with the C library's exp, as std::exp.
        e = np.array(list(map(math.exp, (lg - mx).astype(np.float64).tolist())),
                     dtype=np.float64)
        z = float(np.cumsum(e)[-1])  # summed in order
        if not z > 0:
            continue
        ids = np.asarray(ids, dtype=np.int64)
        ok = (ids >= 0) & (ids < n_tokens)
        np.add.at(mass, ids[ok] // page_size, e[ok] / z)  # in order, like the C++ loop
    return mass


def cap_selected_pages(per_q_head: Sequence[np.ndarray], page_size: int, n_tokens: int,
                       max_pages: int, recent_blocks: int,
                       logits: Optional[Sequence[np.ndarray]] = None) -> List[np.ndarray]:
    """``index::CapSelectedPages``: keeps the selected tokens of at most
    ``max_pages`` pages ranked by estimated mass (with logits for every
    selected token of every head; else by selected-token count; ties: the
    later page), plus page 0 and the last ``recent_blocks + 1`` pages."""
    if max_pages < 1:
        raise ValueError("page cap: max_pages must be >= 1")
    if page_size < 1:
        raise ValueError("page cap: page_size must be >= 1")
    n_pages = (n_tokens + page_size - 1) // page_size
    heads = [np.asarray(h, dtype=np.int64) for h in per_q_head]
    count = np.zeros(n_pages, dtype=np.int64)
    for ids in heads:
        ok = ids[(ids >= 0) & (ids < n_tokens)]
        np.add.at(count, ok // page_size, 1)
    use_mass = (logits is not None and len(logits) == len(heads)
                and all(len(lg) == h.size for lg, h in zip(logits, heads)))
    keep = np.zeros(n_pages, dtype=bool)
    if n_pages > 0:
        keep[0] = True
    keep[max(0, n_pages - 1 - recent_blocks):] = True
    order = np.flatnonzero(~keep & (count > 0))
    if use_mass:
        mass = _page_mass(heads, logits, n_pages, page_size, n_tokens)
        order = order[np.lexsort((-order, -mass[order]))]  # mass desc, later page first
    else:
        order = order[np.lexsort((-order, -count[order]))]
    keep[order[:max_pages]] = True
    out = []
    for ids in heads:
        ok = (ids >= 0) & (ids < n_tokens)
        ok[ok] = keep[ids[ok] // page_size]
        out.append(ids[ok].astype(np.int32))
    return out


def build_page_tables(per_q_head: Sequence[np.ndarray], n_tokens: int, subgroup: int = 4,
                      page_size: int = 16, recent_blocks: int = 1) -> List[PageTable]:
    """``index::BuildPageTables``: per subgroup of ``subgroup`` consecutive q
    heads, the sorted union of their tokens' pages plus the current page and
    the ``recent_blocks`` pages before it."""
    g = len(per_q_head)
    if g <= 0 or subgroup <= 0 or page_size <= 0 or recent_blocks < 0 or n_tokens < 0:
        raise ValueError(f"page_table: bad sizes (group {g}, subgroup {subgroup}, page "
                         f"{page_size}, recent_blocks {recent_blocks}, n_tokens {n_tokens})")
    n_pages = (n_tokens + page_size - 1) // page_size
    sg = min(subgroup, g)
    tables = []
    for s in range((g + sg - 1) // sg):
        heads = list(range(s * sg, min(g, (s + 1) * sg)))
        toks = np.concatenate([np.asarray(per_q_head[h], dtype=np.int64) for h in heads])
        if toks.size and (toks.min() < 0 or toks.max() >= n_tokens):
            raise ValueError(f"page_table: token id outside [0, {n_tokens})")
        toks = np.unique(toks)
        pages = toks // page_size
        if n_pages > 0:
            pages = np.concatenate([pages, np.arange(max(0, n_pages - 1 - recent_blocks),
                                                     n_pages)])
        pages = np.unique(pages).astype(np.int32)
        last = n_tokens - pages.astype(np.int64) * page_size
        fetched = int(np.minimum(page_size, last).clip(min=0).sum())
        tables.append(PageTable(subgroup=s, q_heads=heads, pages=pages,
                                selected_tokens=int(toks.size), fetched_tokens=fetched))
    return tables


def expand_to_table_pages(tables: Sequence[PageTable], group_size: int, page_size: int,
                          n_tokens: int) -> List[np.ndarray]:
    """``index::ExpandToTablePages``: per q head, every token (< n_tokens) of
    its subgroup's pages, ascending."""
    out = [np.zeros(0, dtype=np.int32) for _ in range(max(group_size, 0))]
    for t in tables:
        p = np.asarray(t.pages, dtype=np.int64)
        toks = (p[:, None] * page_size + np.arange(page_size)).reshape(-1)
        toks = toks[toks < n_tokens].astype(np.int32)
        for h in t.q_heads:
            if not 0 <= h < group_size:
                raise ValueError(f"page_table: table names q head {h}, expected in "
                                 f"[0, {group_size})")
            out[h] = toks
    return out


@dataclass
class HeadStep:
    """``session::HeadStep`` of one (layer, kv head) step.

    per_q_head: per q head of the group, the token ids it attends (ascending),
        after the page cap and (with whole_pages) the widening.
    tables: one :class:`PageTable` per subgroup.
    pages: the union of the tables' pages, ascending (all stored pages: no
        appended tokens).
    selection: the selector's raw :class:`CsaSelection` (before stage 2).
    """

    per_q_head: List[Any]
    tables: List[PageTable]
    pages: Any
    selection: Optional[CsaSelection] = field(default=None, repr=False)


def _torch_like(queries: Any) -> Any:
    return queries if type(queries).__module__.startswith("torch") else None


def session_step(index: Any, queries: Any,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 as_torch: Optional[bool] = None) -> HeadStep:
    """One layer-step of one kv head: ``SparseSession::PlanHeadWith`` with the
    index's selector, for a session with no appended tokens.

    Args:
        index: the kv head's index (:class:`CsaIndex`, :class:`QuestIndex`,
            :class:`StreamingIndex` or :class:`OracleIndex`; a csa search
            schedule advances).
        queries: [G, d] post-RoPE queries of the kv head's q heads.
        params: a :class:`SessionParams`, or the session params dict (as given
            to ``Client.open_session``).
        as_torch: return torch int64 tensors (on the queries' device) for
            ``per_q_head`` and ``pages``; None = when the queries are torch.
    """
    if not isinstance(params, SessionParams):
        params = SessionParams.parse(params)
    n = index.n_tokens
    b = params.page_size
    sel = index.select(queries, params.token_budget(n))
    per_q_head = list(sel.per_head)
    if params.page_fraction > 0:
        per_q_head = cap_selected_pages(per_q_head, b, n,
                                        page_budget(params.page_fraction, n, b),
                                        params.recent_blocks, sel.per_head_logits)
    tables = build_page_tables(per_q_head, n, params.subgroup, b, params.recent_blocks)
    if params.whole_pages:
        per_q_head = expand_to_table_pages(tables, len(per_q_head), b, n)
    pages = np.unique(np.concatenate([t.pages for t in tables])).astype(np.int32)
    ref = _torch_like(queries)
    if as_torch is None:
        as_torch = ref is not None
    if as_torch:
        import torch

        device = ref.device if ref is not None else "cpu"
        per_q_head = [torch.as_tensor(h.astype(np.int64), device=device) for h in per_q_head]
        pages = torch.as_tensor(pages.astype(np.int64), device=device)
    return HeadStep(per_q_head=per_q_head, tables=tables, pages=pages, selection=sel)


def _layer_head_keys(keys: Any, layer: int, kv_head: int) -> Any:
    """keys[(layer, kv_head)] of a mapping, else keys[layer][kv_head] (an
    array or tensor [n_layers, n_kv_heads, n, d], or nested lists)."""
    if isinstance(keys, Mapping):
        return keys[(layer, kv_head)]
    return keys[layer][kv_head]


class ClientSession:
    """Client-side selection over a whole context: one index per (layer, kv
    head) of ``method`` (csa, quest, streaming or oracle; :func:`make_index`)
    and the session params, planning a layer like a server-side
    ``Session.step`` of that method (same selections, same page tables),
    before any append.

    >>> arts = client.fetch_index(ctx.context_id, "quest")
    >>> sel = ClientSession(arts, n_q_heads=ctx.model.n_q_heads, method="quest")
    >>> steps = sel.step(layer, queries)       # [n_q_heads, d] -> one HeadStep per kv head
    >>> client.fetch_pages(ctx.context_id, sel.page_tables(layer, steps))

    ``keys`` (oracle only): the context's keys per (layer, kv head), [n, d]
    each, as a mapping ``{(layer, kv_head): keys}`` or indexable
    ``keys[layer][kv_head]``.
    """

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None,
                 method: str = "csa", keys: Any = None) -> None:
        if method not in METHODS:
            raise ValueError(f"method '{method}' has no client-side selection; expected one "
                             f"of {', '.join(METHODS)}")
        if not artifacts:
            raise ValueError(f"{type(self).__name__}: no artifacts")
        if method == "oracle" and keys is None:
            raise ValueError("oracle: needs the context's keys (keys=[n_tokens, head_dim] per "
                             "layer and kv head)")
        self.method = method
        self.params = (params if isinstance(params, SessionParams)
                       else SessionParams.parse(params, method=method))

        def index_of(item: Tuple[Tuple[int, int], Any]) -> Index:
            (l, h), a = item
            return make_index(method, a, None if keys is None
                              else _layer_head_keys(keys, int(l), int(h)))

        # Artifacts parse side by side (numpy drops the GIL in its bulk ops);
        # the first bad one in key order raises, as a loop would.
        items = list(artifacts.items())
        workers = min(len(items), os.cpu_count() or 1, 16)
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                parsed = list(pool.map(index_of, items))
        else:
            parsed = [index_of(it) for it in items]
        self.indexes: Dict[Tuple[int, int], Index] = {
            (int(l), int(h)): ix for ((l, h), _), ix in zip(items, parsed)}
        if self.params.rerank is not None:  # csa's per-session stage-2 factor
            _check_rerank_method(method)
            for key, ix in self.indexes.items():
                ix.set_rerank(self.params.rerank, where=f"(layer, kv head) {key}")
        self.n_layers = 1 + max(l for l, _ in self.indexes)
        self.n_kv_heads = 1 + max(h for _, h in self.indexes)
        missing = [(l, h) for l in range(self.n_layers) for h in range(self.n_kv_heads)
                   if (l, h) not in self.indexes]
        if missing:
            raise ValueError(f"{type(self).__name__}: no artifact for (layer, kv head) "
                             f"{missing[0]}")
        if n_q_heads % self.n_kv_heads:
            raise ValueError(f"{type(self).__name__}: n_q_heads {n_q_heads} is not a multiple "
                             f"of n_kv_heads {self.n_kv_heads}")
        self.n_q_heads = n_q_heads
        self.group_size = n_q_heads // self.n_kv_heads
        first = self.indexes[(0, 0)]
        self.n_tokens, self.head_dim = first.n_tokens, first.head_dim
        for key, ix in self.indexes.items():
            if (ix.n_tokens, ix.head_dim) != (self.n_tokens, self.head_dim):
                raise ValueError(f"{type(self).__name__}: (layer, kv head) {key} covers "
                                 f"{ix.n_tokens} tokens of dim {ix.head_dim}, expected "
                                 f"{self.n_tokens} of dim {self.head_dim}")

    def step(self, layer: int, queries: Any, as_torch: Optional[bool] = None) -> List[HeadStep]:
        """Plans ``layer`` for queries [n_q_heads, d]: one :class:`HeadStep`
        per kv head (q heads ``h * G .. h * G + G - 1`` for kv head h)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"step.layer {layer} out of range [0, {self.n_layers})")
        g = self.group_size
        shape = tuple(queries.shape)
        if shape != (self.n_q_heads, self.head_dim):
            raise ValueError(f"queries have shape {list(shape)}, expected "
                             f"[{self.n_q_heads}, {self.head_dim}]")
        return [session_step(self.indexes[(layer, h)], queries[h * g:(h + 1) * g],
                             self.params, as_torch) for h in range(self.n_kv_heads)]

    @staticmethod
    def page_tables(layer: int, steps: Sequence[HeadStep]) -> List[Tuple[int, int, List[int]]]:
        """``(layer, kv_head, blocks)`` per kv head, for ``Client.fetch_pages``."""
        out = []
        for h, s in enumerate(steps):
            pages = s.pages.tolist() if hasattr(s.pages, "tolist") else list(s.pages)
            out.append((layer, h, [int(p) for p in pages]))
        return out


class CsaSession(ClientSession):
    """:class:`ClientSession` with method csa.

    >>> arts = client.fetch_index(ctx.context_id, "csa")
    >>> sel = CsaSession(arts, n_q_heads=ctx.model.n_q_heads, params={"rho": 0.05})
    """

    def __init__(self, artifacts: Mapping[Tuple[int, int], Any], n_q_heads: int,
                 params: Union[SessionParams, Mapping[str, Any], None] = None) -> None:
        super().__init__(artifacts, n_q_heads, params, method="csa")
