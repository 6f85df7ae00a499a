"""Parsers for the index artifacts that client-side selection reads: csa's
``CSAP`` (plain) and ``CSAC`` (compact), and ``QST1`` (quest), ``STR1``
(streaming) and ``ORCL`` (oracle).

The bytes are those :meth:`ctxcache.Client.fetch_index` returns for method
``"csa"``: one artifact per (layer, kv head), the serialized
``index::CsaSelector`` (``index/csa.cc``). Byte layouts: docs/storage-format.md,
"Index artifacts". Everything is little-endian and packed (no alignment).

>>> arts = client.fetch_index(context_id, "csa")
>>> a = parse_csa_artifact(arts[(0, 1)])      # layer 0, kv head 1
>>> a.centroids.shape, a.ids.shape            # [m, C, d/m], [m, C, L]

After parsing, ``scores`` are exactly the fp16 scores the C++ loader holds:
the stored ones for ``CSAP``; for ``CSAC`` versions 2
and 3 (3 written today: Elias-Fano list ids as a third id coding) each
list's fp16 codebook entry of its 4-bit code; for ``CSAC`` version 1 (older
stored contexts) the dequantized ``fp16(fma(q, step, lo))`` (the compiled
loader fuses ``lo + q * step`` into one fused multiply-add, so that is what is
reproduced here; with ``step = (hi - lo) / 255`` in fp32).

List order: ``CSAP`` lists are in the stored binary min-heap order; ``CSAC``
lists are in ascending id order (the C++ loader rebuilds a heap from them; the
order of entries within a list does not change any selection, as every id
occurs at most once per list).

Errors: ``ValueError`` with a message that names the problem (bad magic,
unsupported version, truncated or corrupt field), mirroring the checks of
``CsaSelector::ReadTables``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = ["CsaOptions", "CsaArtifact", "parse_csa_artifact", "fma_f32",
           "CSA_FORMAT_VERSION", "CSA_HEADER_BYTES", "QuestArtifact", "StreamingArtifact",
           "OracleArtifact", "QuestLayout", "parse_quest_artifact", "parse_streaming_artifact",
           "parse_oracle_artifact", "quest_layout"]

CSA_FORMAT_VERSION = 4  # the newest version this parser (and the C++ build) reads
CSA_PLAIN_VERSION = 2  # CSAP: 1 (no key sketch) or 2
_CSAC_SKETCH_VERSION = 4  # the first versions with the key-sketch section
_CSAP_SKETCH_VERSION = 2
_SKETCH_BITS = 8
CSA_HEADER_BYTES = 118  # magic, version, options and shape fields; the arrays follow

# Options and shape fields, offsets 8..117 (docs/storage-format.md table):
# m, C, alpha, L, query_cap, iters, center, seed, rho, R, sinks, tau,
# backoff_cos, norm, proj, impute_min, impute_tail_mean, period, compact,
# d, n_tokens, n_built, L (entries per list).
_FIELDS = struct.Struct("<iidqqiBQdiiidBBBBiBiqqq")
assert 8 + _FIELDS.size == CSA_HEADER_BYTES


@dataclass
class CsaOptions:
    """``index::CsaOptions`` as serialized (build settings and the default
    retrieval settings, which a server-side session uses as they are)."""

    m: int = 0                    # subspaces (serialized: resolved, >= 1)
    C: int = 128                  # centroids per subspace
    alpha: float = 0.125          # L = ceil(alpha * N) unless fixed_L > 0
    fixed_L: int = 0              # the `L` param
    query_cap: int = 4096
    iters: int = 8                # k-means iterations
    center: bool = True           # keys centred (key_mean subtracted) before scoring
    seed: int = 42
    rho: float = 0.05
    recent: int = 32              # `R`: recent window always selected
    sinks: int = 4                # leading tokens always selected
    tau: int = 2                  # centroids per subspace on backoff
    backoff_cos: float = 0.3
    norm_weights: bool = True     # weights=norm
    proj_weights: bool = False    # weights=proj (overrides norm)
    impute_min: bool = False      # missing=min
    impute_tail_mean: bool = False  # missing=mean (overrides min)
    period: int = 1               # search period
    compact: bool = True          # format=compact
    rerank: float = 0.0           # two-stage retrieval factor (0: the lists alone;
                                  # artifacts without a key sketch have 0)

    @property
    def weights(self) -> str:
        return "proj" if self.proj_weights else "norm" if self.norm_weights else "uniform"

    @property
    def missing(self) -> str:
        return "mean" if self.impute_tail_mean else "min" if self.impute_min else "zero"

    def check(self) -> Optional[str]:
        """The C++ option check (``CheckOptions``): None, or what is wrong."""
        if self.m < 1:
            return f"m={self.m}, expected >= 1"
        if self.C < 1:
            return f"C={self.C}, expected >= 1"
        if not (0 < self.alpha <= 1):
            return f"alpha={self.alpha}, expected in (0, 1]"
        if self.fixed_L < 0:
            return f"L={self.fixed_L}, expected >= 0"
        if self.iters < 1:
            return f"iters={self.iters}, expected >= 1"
        if not (0 < self.rho <= 1):
            return f"rho={self.rho}, expected in (0, 1]"
        if self.recent < 0:
            return f"R={self.recent}, expected >= 0"
        if self.sinks < 0:
            return f"sinks={self.sinks}, expected >= 0"
        if self.tau < 1 or self.tau > self.C:
            return f"tau={self.tau}, expected in [1, C={self.C}]"
        if not (-1 <= self.backoff_cos <= 1):
            return f"backoff_cos={self.backoff_cos}, expected in [-1, 1]"
        if self.period < 1:
            return f"period={self.period}, expected >= 1"
        if not (self.rerank == 0 or 1 <= self.rerank <= 64):
            return f"rerank={self.rerank}, expected 0 or in [1, 64]"
        return None


@dataclass
class CsaArtifact:
    """One parsed csa artifact (one layer and kv head).

    Attributes:
        magic: ``"CSAP"`` or ``"CSAC"``.
        version: the format version (CSAP: 1 or 2; CSAC: 1 to 4).
        options: the serialized :class:`CsaOptions`.
        head_dim: d. ``sub_dim`` = d / m.
        n_tokens: tokens covered (appended ones included).
        n_built: tokens at build time.
        L: entries per list.
        centroids: float32 ``[m, C, d/m]``, unit rows.
        key_mean: float32 ``[d]`` (zeros when ``options.center`` is false).
        tail_mean: float32 ``[m, C]``: mean build score of the keys outside each list.
        ids: int32 ``[m, C, L]`` token ids of list (b, j).
        scores: float16 ``[m, C, L]``, parallel to ``ids``, as the C++ loader holds them.
        lo, hi: ``CSAC`` version 1 only: float32 ``[m, C]`` score range of each list.
        q: ``CSAC`` only: uint8 ``[m, C, L]`` quantized scores (ascending-id
            order): 8-bit codes (version 1) or 4-bit codebook indices (version 2).
        book: ``CSAC`` version >= 2 only: float16 ``[m, C, min(16, L)]``: each
            list's codebook (ascending).
        sketch: int8 ``[n_tokens, d]`` key-sketch codes and
        sketch_scale: float16 ``[n_tokens]`` their scales (``k - key_mean ~
            scale * code``), when ``options.rerank`` > 0 (CSAP >= 2, CSAC
            >= 4); else None.
        id_coding: ``CSAC`` version >= 2 only: uint8 ``[m, C]``: 0 = delta
            varints, 1 = bitmap, 2 = Elias-Fano (version 3).
    """

    magic: str
    version: int
    options: CsaOptions
    head_dim: int
    n_tokens: int
    n_built: int
    L: int
    centroids: np.ndarray
    key_mean: np.ndarray
    tail_mean: np.ndarray
    ids: np.ndarray
    scores: np.ndarray
    lo: Optional[np.ndarray] = field(default=None, repr=False)
    hi: Optional[np.ndarray] = field(default=None, repr=False)
    q: Optional[np.ndarray] = field(default=None, repr=False)
    book: Optional[np.ndarray] = field(default=None, repr=False)
    id_coding: Optional[np.ndarray] = field(default=None, repr=False)
    sketch: Optional[np.ndarray] = field(default=None, repr=False)
    sketch_scale: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def compact(self) -> bool:
        return self.magic == "CSAC"

    @property
    def m(self) -> int:
        return self.options.m

    @property
    def C(self) -> int:
        return self.options.C

    @property
    def sub_dim(self) -> int:
        return self.head_dim // self.options.m


def _fail(what: str) -> ValueError:
    return ValueError(f"csa artifact: {what}")


def fma_f32(a, b, c) -> np.ndarray:
    """``fmaf(a, b, c)`` elementwise (broadcasting): a*b + c rounded once to
    float32, what the x86 ``vfmadd`` instructions of the compiled C++ core
    compute.

    a*b of two float32 values is exact in float64; the float64 sum is rounded
    to odd (its last bit set when inexact), which makes the final rounding to
    float32 (round to nearest even) the correctly rounded result.
    """
    a, b, c = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  np.asarray(c, np.float32))
    p = a.astype(np.float64) * b
    cd = c.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.atleast_1d(p + cd)
        # TwoSum: s + err == p + c exactly (for finite s).
        bb = s - p
        err = (p - (s - bb)) + (cd - bb)
        fix = (err != 0) & np.isfinite(s) & ((s.view(np.uint64) & np.uint64(1)) == 0)
        if fix.any():
            s[fix] = np.nextafter(s[fix], np.where(err[fix] > 0, np.inf, -np.inf))
        return s.astype(np.float32).reshape(p.shape)


def _list_ids(buf: bytes, pos: int, L: int, n_tokens: int):
    """Decodes one CSAC list's L delta varints (LEB128, at most 10 bytes each)
    at `pos` into ascending ids. Returns (int32 ids [L], new position)."""
    window = np.frombuffer(buf, dtype=np.uint8, count=min(10 * L, len(buf) - pos), offset=pos)
    ends = np.flatnonzero(window < 0x80)[:L]
    if ends.size < L:
        if window.size < 10 * L:
            raise _fail("bad list ids (truncated varint)")
        raise _fail("bad list ids (varint longer than 10 bytes)")
    starts = np.empty(L, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    if int((ends - starts).max()) >= 10:
        raise _fail("bad list ids (varint longer than 10 bytes)")
    used = window[:ends[-1] + 1]
    shift = 7 * (np.arange(used.size, dtype=np.int64) - np.repeat(starts, ends - starts + 1))
    groups = (used & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    deltas = np.bitwise_or.reduceat(groups, starts)
    if (deltas == 0).any():
        raise _fail("bad list ids (zero delta)")
    if (deltas > np.uint64(n_tokens)).any():
        raise _fail(f"bad list ids (id >= n_tokens={n_tokens})")
    ids = np.cumsum(deltas.astype(np.int64)) - 1
    if ids[-1] >= n_tokens:
        raise _fail(f"bad list ids (id >= n_tokens={n_tokens})")
    return ids.astype(np.int32), pos + int(used.size)


_SCORE_BITS = 4  # CSAC version >= 2: bits per score code
_IDS_VARINT, _IDS_BITMAP, _IDS_ELIAS_FANO = 0, 1, 2


def _elias_fano_ids(buf: bytes, pos: int, L: int, n_tokens: int):
    """Decodes one list's Elias-Fano ids at `pos` (after the coding byte): a
    byte k <= 31, then L k-bit low parts packed little-endian (entry e at bits
    [e*k, (e+1)*k)), then an upper bitmap of L + ((n_tokens - 1) >> k) + 1 bits
    where entry e sets bit (id_e >> k) + e. Returns (int32 ids [L], new pos)."""
    if pos + 1 > len(buf):
        raise _fail("truncated Elias-Fano ids")
    k = buf[pos]
    pos += 1
    if k > 31:
        raise _fail("bad Elias-Fano low bits")
    low_bytes = (L * k + 7) // 8
    upper_bits = L + ((n_tokens - 1) >> k) + 1
    upper_bytes = (upper_bits + 7) // 8
    if pos + low_bytes + upper_bytes > len(buf):
        raise _fail("truncated Elias-Fano ids")
    raw = np.frombuffer(buf, dtype=np.uint8, count=low_bytes + upper_bytes, offset=pos)
    pos += low_bytes + upper_bytes
    low = np.zeros(L, dtype=np.int64)
    if k:
        bits = np.unpackbits(raw[:low_bytes], bitorder="little")[:L * k].reshape(L, k)
        low = (bits.astype(np.int64) << np.arange(k, dtype=np.int64)).sum(axis=1)
    set_bits = np.flatnonzero(np.unpackbits(raw[low_bytes:], bitorder="little"))
    if set_bits.size != L or (set_bits.size and set_bits[-1] >= upper_bits):
        raise _fail("bad Elias-Fano ids")
    ids = ((set_bits - np.arange(L, dtype=np.int64)) << k) | low
    if (ids >= n_tokens).any() or (np.diff(ids) <= 0).any():
        raise _fail("bad Elias-Fano ids")
    return ids.astype(np.int32), pos


def _read_v2_list(buf: bytes, pos: int, li: int, L: int, n_tokens: int, version: int,
                  ids: np.ndarray, codes: np.ndarray, book: np.ndarray,
                  id_coding: np.ndarray) -> int:
    """Decodes list `li` of a ``CSAC`` version 2 or 3 artifact at `pos` (its
    id coding byte; the layout: :func:`_read_v2_lists`) into row `li` of the
    arrays, checking every field in stream order. Returns the new position."""
    levels = book.shape[1]
    code_bytes = (L * _SCORE_BITS + 7) // 8
    if pos + 1 > len(buf):
        raise _fail("truncated lists")
    coding = buf[pos]
    pos += 1
    if coding == _IDS_BITMAP:
        bitmap_bytes = (n_tokens + 7) // 8
        if pos + bitmap_bytes > len(buf):
            raise _fail("truncated list bitmap")
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, count=bitmap_bytes,
                                           offset=pos), bitorder="little")
        pos += bitmap_bytes
        set_ids = np.flatnonzero(bits)
        if set_ids.size != L or (set_ids.size and set_ids[-1] >= n_tokens):
            raise _fail("bad list bitmap")
        ids[li] = set_ids
    elif coding == _IDS_VARINT:
        ids[li], pos = _list_ids(buf, pos, L, n_tokens)
    elif coding == _IDS_ELIAS_FANO and version >= 3:
        ids[li], pos = _elias_fano_ids(buf, pos, L, n_tokens)
    else:
        raise _fail("bad list id coding")
    id_coding[li] = coding
    if pos + 2 * levels > len(buf):
        raise _fail("truncated score codebook")
    book[li] = np.frombuffer(buf, dtype="<f2", count=levels, offset=pos)
    pos += 2 * levels
    if not np.isfinite(book[li]).all():
        raise _fail("bad score codebook")
    if pos + code_bytes > len(buf):
        raise _fail("truncated scores")
    packed = np.frombuffer(buf, dtype=np.uint8, count=code_bytes, offset=pos)
    pos += code_bytes
    nib = np.empty(2 * code_bytes, dtype=np.uint8)
    nib[0::2] = packed & 0x0F
    nib[1::2] = packed >> 4
    codes[li] = nib[:L]
    if (codes[li] >= levels).any():
        raise _fail("bad score code")
    return pos


# Batched decoding of many lists at once (_read_v2_lists) goes in chunks of
# lists small enough for the temporaries to stay in cache: about this many
# unpacked bitmap bits (bytes, as numpy bools), and this many score codes.
_CHUNK_BITS = 1 << 20
_CHUNK_CODES = 1 << 19


def _rows(arr: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """``arr[at[i]:at[i] + width]`` for every i as an [len(at), width] array: a
    view when `at` is evenly spaced (lists of one size back to back), else a
    copy. Every row must lie inside `arr`."""
    n = at.size
    if n == 0 or width == 0:
        return np.zeros((n, width), dtype=np.uint8)
    step = int(at[1] - at[0]) if n > 1 else 1
    if step > 0 and (n == 1 or (np.diff(at) == step).all()):
        return np.lib.stride_tricks.as_strided(arr[int(at[0]):], shape=(n, width),
                                               strides=(step, 1), writeable=False)
    return arr[at[:, None] + np.arange(width, dtype=np.int64)]


def _set_bits(rows: np.ndarray, L: int, limit: int, dtype=np.int32):
    """The set bits of each row of `rows` (uint8 [n, B], bit i of a row is bit
    i % 8 of byte i // 8). A row is good when it has exactly L set bits, all
    below `limit` (<= 8 B; `dtype` must hold limit - 1). Returns (good: bool
    [n], `dtype` [n_good, L]: the ascending bit positions of the good rows)."""
    n, width = rows.shape
    bits = np.unpackbits(rows, axis=1, bitorder="little").view(np.bool_)
    flat = np.flatnonzero(bits)
    base = np.arange(n, dtype=np.int64) * (8 * width)
    # When there are n L set bits in all, row r has exactly L if entries
    # r L and r L + L - 1 of `flat` (its first and last) are in it.
    if (flat.size == n * L and (flat[::L] >= base).all()
            and (flat[L - 1::L] - base < limit).all()):
        pos = np.empty((n, L), dtype=dtype)
        np.subtract(flat.reshape(n, L), base[:, None], out=pos, casting="unsafe")
        return np.ones(n, dtype=bool), pos
    count = np.count_nonzero(bits, axis=1)
    last = flat[np.maximum(np.cumsum(count) - 1, 0)] - base if flat.size else base
    good = (count == L) & (last < limit)
    if not good.any():
        return good, np.empty((0, L), dtype=dtype)
    return good, _set_bits(rows[good], L, limit, dtype)[1]


def _low_bits(rows: np.ndarray, L: int, k: int) -> np.ndarray:
    """The L k-bit fields packed little-endian in each row of `rows` (uint8
    [n, >= ceil(L k / 8)]; field e at bits [e k, (e + 1) k)), 0 < k <= 31.
    Returns [n, L] uint8 (k <= 8), uint16 (k <= 16) or int32."""
    n = rows.shape[0]
    if 8 % k == 0:  # whole fields per byte
        per = 8 // k
        used = (L + per - 1) // per
        out = np.empty((n, used, per), dtype=np.uint8)
        for j in range(per):
            np.right_shift(rows[:, :used], np.uint8(j * k), out=out[:, :, j])
        out &= np.uint8((1 << k) - 1)
        return out.reshape(n, used * per)[:, :L]
    groups = (L + 7) // 8  # 8 fields fill k bytes
    g = np.zeros((n, groups * k), dtype=np.uint8)
    used = min(rows.shape[1], groups * k)
    g[:, :used] = rows[:, :used]
    g = g.reshape(n, groups, k)
    window = np.uint16 if k <= 9 else np.uint32 if k <= 25 else np.uint64
    out = np.empty((n, groups, 8), dtype=np.uint8 if k <= 8 else np.uint16 if k <= 16
                   else np.int32)
    for j in range(8):  # field j of each group
        at = j * k
        first, last = at >> 3, (at + k - 1) >> 3
        if first == last:  # within one byte
            v = g[:, :, first] >> np.uint8(at & 7)
            out[:, :, j] = v & np.uint8((1 << k) - 1)
            continue
        w = g[:, :, first].astype(window)
        for b in range(1, last - first + 1):
            w |= g[:, :, first + b].astype(window) << window(8 * b)
        out[:, :, j] = (w >> window(at & 7)) & window((1 << k) - 1)
    return out.reshape(n, groups * 8)[:, :L]


def _read_v2_lists(buf: bytes, pos: int, n_lists: int, L: int, n_tokens: int,
                   version: int = 2):
    """The lists of a ``CSAC`` version 2 or 3 artifact from `pos`: per list an
    id coding byte (0: L delta varints, 1: a bitmap of ceil(n_tokens / 8)
    bytes, bit i of byte i // 8 least significant first, 2 (version 3):
    Elias-Fano, :func:`_elias_fano_ids`), min(16, L) fp16 codebook entries,
    then ceil(L / 2) bytes of 4-bit codes (entry e in the low nibble of byte
    e // 2 when e is even, the high nibble when odd), in ascending-id order.
    Returns (ids, scores, codes, book, id_coding, new position).

    Decoding is batched: one pass over the lists finds where each starts (it
    reads the coding and Elias-Fano k bytes; varint ids are decoded there, as
    their length is that of the varints), then the bitmap and Elias-Fano ids
    (by k), codebooks and codes of many lists are decoded together. From the
    first list that is not well-formed on, lists are decoded one at a time by
    :func:`_read_v2_list`, which raises the error of the sequential checks."""
    levels = min(1 << _SCORE_BITS, L)
    code_bytes = (L * _SCORE_BITS + 7) // 8
    bitmap_bytes = (n_tokens + 7) // 8
    ids = np.empty((n_lists, L), dtype=np.int32)
    codes = np.empty((n_lists, L), dtype=np.uint8)
    book = np.empty((n_lists, levels), dtype=np.float16)
    id_coding = np.zeros(n_lists, dtype=np.uint8)
    size = len(buf)
    tail = 2 * levels + code_bytes  # codebook and codes
    # Pass 1: each list's start, id coding and codebook offset; it stops at
    # the first list whose fields do not fit or whose coding (or k) is bad.
    starts = [0] * n_lists
    book_at = [0] * n_lists
    groups = {}  # (coding, k) -> ([list], [offset of its ids after the coding and k bytes])
    ef_bytes = {}
    stop = n_lists
    for li in range(n_lists):
        starts[li] = pos
        if pos + 1 > size:
            stop = li
            break
        coding = buf[pos]
        at = pos + 1
        if coding == _IDS_ELIAS_FANO and version >= 3:
            if at + 1 > size or buf[at] > 31:
                stop = li
                break
            k = buf[at]
            at += 1
            nbytes = ef_bytes.get(k)
            if nbytes is None:
                nbytes = ef_bytes[k] = ((L * k + 7) // 8
                                        + (L + ((n_tokens - 1) >> k) + 1 + 7) // 8)
            key = (coding, k)
        elif coding == _IDS_BITMAP:
            nbytes, key = bitmap_bytes, (coding, 0)
        elif coding == _IDS_VARINT:
            try:
                ids[li], end = _list_ids(buf, at, L, n_tokens)
            except ValueError:
                stop = li
                break
            nbytes, key = end - at, None
        else:
            stop = li
            break
        if at + nbytes + tail > size:
            stop = li
            break
        id_coding[li] = coding
        if key is not None:
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
            group[0].append(li)
            group[1].append(at)
        book_at[li] = at + nbytes
        pos = at + nbytes + tail
    arr = np.frombuffer(buf, dtype=np.uint8)
    bad = np.zeros(n_lists, dtype=bool)  # lists before `stop` that fail a check
    for (coding, k), (lists, offsets) in groups.items():
        lists = np.array(lists, dtype=np.int64)
        offsets = np.array(offsets, dtype=np.int64)
        if coding == _IDS_BITMAP:
            low_bytes, width, limit = 0, bitmap_bytes, n_tokens
        else:
            low_bytes = (L * k + 7) // 8
            limit = L + ((n_tokens - 1) >> k) + 1  # upper bits
            width = low_bytes + (limit + 7) // 8
        # Positions and ids are computed in int32 unless they may not fit
        # (with a corrupt upper part, ids reach n_tokens - 1 + 2^(k + 1)).
        wide = limit > 2**31 - 1 or (coding != _IDS_BITMAP and n_tokens + (2 << k) > 2**31 - 1)
        dtype = np.int64 if wide else np.int32
        entry = np.arange(L, dtype=dtype)
        step = max(1, _CHUNK_BITS // (8 * (width - low_bytes) + 1))
        for c0 in range(0, lists.size, step):
            li = lists[c0:c0 + step]
            rows = _rows(arr, offsets[c0:c0 + step], width)
            good, got = _set_bits(rows[:, low_bytes:], L, limit, dtype)
            if coding != _IDS_BITMAP:
                if not good.all():
                    rows = rows[good]
                got -= entry  # the high parts
                if k:
                    got <<= k
                    got |= _low_bits(rows[:, :low_bytes], L, k)
                ok = got[:, -1] < n_tokens
                if L > 1:
                    ok &= (got[:, 1:] > got[:, :-1]).all(axis=1)
                if not ok.all():
                    good[good] = ok
                    got = got[ok]
            bad[li[~good]] = True
            ids[li[good]] = got
    # Codebooks, codes and scores of lists [0, stop). Scores are looked up a
    # byte (two codes) at a time in a per-list table of 256 fp16 pairs.
    book_at = np.array(book_at[:stop], dtype=np.int64)
    scores = np.empty((n_lists, 2 * code_bytes), dtype=np.float16)
    nibble = np.arange(256)  # a byte's two codes: nibble & 15, nibble >> 4
    step = max(1, _CHUNK_CODES // L)
    for c0 in range(0, stop, step):
        c1 = min(stop, c0 + step)
        rows = _rows(arr, book_at[c0:c1], tail)
        b = np.ascontiguousarray(rows[:, :2 * levels]).view("<f2")
        book[c0:c1] = b
        bad[c0:c1] |= ~np.isfinite(b).all(axis=1)
        packed = rows[:, 2 * levels:]
        nib = np.empty((c1 - c0, code_bytes, 2), dtype=np.uint8)
        np.bitwise_and(packed, 0x0F, out=nib[:, :, 0])
        np.right_shift(packed, 4, out=nib[:, :, 1])
        codes[c0:c1] = nib.reshape(c1 - c0, 2 * code_bytes)[:, :L]
        h = book[c0:c1].view(np.uint16)
        if levels < 1 << _SCORE_BITS:
            bad[c0:c1] |= (codes[c0:c1] >= levels).any(axis=1)
            h = np.pad(h, ((0, 0), (0, (1 << _SCORE_BITS) - levels)))
        pairs = np.empty((c1 - c0, 256, 2), dtype=np.uint16)  # [list, byte, nibble]
        pairs[:, :, 0] = h[:, nibble & 0x0F]
        pairs[:, :, 1] = h[:, nibble >> 4]
        at = packed.astype(np.intp)
        at += (np.arange(c1 - c0, dtype=np.intp) * 256)[:, None]
        # Moves 4-byte pairs (two fp16 scores) as they are, whatever the byte order.
        np.take(pairs.view(np.uint32).ravel(), at, out=scores[c0:c1].view(np.uint32),
                mode="clip")
    first = int(np.argmax(bad)) if bad[:stop].any() else stop
    if first < n_lists:
        pos = starts[first]
        for li in range(first, n_lists):
            pos = _read_v2_list(buf, pos, li, L, n_tokens, version, ids, codes, book, id_coding)
        scores[first:, :L] = np.take_along_axis(book[first:], codes[first:].astype(np.intp),
                                                axis=1)
    return ids, np.ascontiguousarray(scores[:, :L]), codes, book, id_coding, pos


def parse_csa_artifact(data: bytes) -> CsaArtifact:
    """Parses one ``CSAP`` or ``CSAC`` artifact (bytes, bytearray or memoryview).

    Raises ValueError on a bad magic, an unsupported version, truncation,
    corrupt fields or trailing bytes (the cases ``CsaSelector::ReadTables``
    rejects; docs/storage-format.md lists them).
    """
    buf = bytes(data)
    if len(buf) < 8:
        raise ValueError(f"csa: bad magic, expected \"CSAP\" or \"CSAC\" "
                         f"(artifact of {len(buf)} bytes)")
    magic = buf[:4]
    if magic not in (b"CSAP", b"CSAC"):
        raise ValueError(f"csa: bad magic {magic!r}, expected \"CSAP\" or \"CSAC\"")
    (version,) = struct.unpack_from("<I", buf, 4)
    compact = magic == b"CSAC"
    newest = CSA_FORMAT_VERSION if compact else CSA_PLAIN_VERSION
    if version == 0 or version > newest:
        raise ValueError(f"csa: unsupported format version {version}, this parser reads "
                         f"<= {newest}")
    if len(buf) < CSA_HEADER_BYTES:
        raise _fail(f"truncated options/header ({len(buf)} bytes, the header has "
                    f"{CSA_HEADER_BYTES})")
    f = _FIELDS.unpack_from(buf, 8)
    o = CsaOptions(m=f[0], C=f[1], alpha=f[2], fixed_L=f[3], query_cap=f[4], iters=f[5],
                   center=f[6] != 0, seed=f[7], rho=f[8], recent=f[9], sinks=f[10],
                   tau=f[11], backoff_cos=f[12], norm_weights=f[13] != 0,
                   proj_weights=f[14] != 0, impute_min=f[15] != 0,
                   impute_tail_mean=f[16] != 0, period=f[17], compact=f[18] != 0)
    d, n_tokens, n_built, L = f[19], f[20], f[21], f[22]
    problem = o.check()
    if problem is not None:
        raise _fail(f"corrupt options ({problem})")
    if not (1 <= d <= 4096 and d % o.m == 0 and 1 <= n_tokens <= 2**31 - 1
            and 1 <= n_built <= n_tokens and 1 <= L <= n_built and o.C <= n_built):
        raise _fail(f"corrupt shape fields (d={d}, m={o.m}, C={o.C}, n_tokens={n_tokens}, "
                    f"n_built={n_built}, L={L})")
    m, C, ds = o.m, o.C, d // o.m
    pos = CSA_HEADER_BYTES

    def take(dtype: str, count: int, what: str) -> np.ndarray:
        nonlocal pos
        size = np.dtype(dtype).itemsize * count
        if pos + size > len(buf):
            raise _fail(f"truncated {what} (needs {size} bytes at offset {pos}, "
                        f"{len(buf) - pos} left)")
        a = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
        pos += size
        return a

    centroids = take("<f4", C * d, "centroids").astype(np.float32).reshape(m, C, ds)
    key_mean = take("<f4", d, "key mean").astype(np.float32)
    if not (np.isfinite(centroids).all() and np.isfinite(key_mean).all()):
        raise _fail("bad centroids or key mean (not finite)")
    tail_mean = take("<f4", m * C, "list tail means").astype(np.float32).reshape(m, C)
    if not np.isfinite(tail_mean).all():
        raise _fail("bad list tail means (not finite)")
    n_lists = m * C
    lo = hi = q = book = id_coding = None
    v2 = compact and version >= 2
    if v2:
        if pos + 1 > len(buf) or buf[pos] != _SCORE_BITS:
            raise _fail("bad score bits")
        pos += 1
        levels = min(1 << _SCORE_BITS, L)
        code_bytes = (L * _SCORE_BITS + 7) // 8
        if n_lists * (1 + 2 * levels + code_bytes) > len(buf) - pos:
            raise _fail("truncated lists")
    elif n_lists * L > len(buf) - pos:  # every entry takes >= 1 byte
        raise _fail("truncated lists")
    if v2:
        ids, scores, q, book, id_coding, pos = _read_v2_lists(buf, pos, n_lists, L, n_tokens,
                                                               version)
        ids = ids.reshape(m, C, L)
        scores = scores.reshape(m, C, L)
        q = q.reshape(m, C, L)
        book = book.reshape(m, C, -1)
        id_coding = id_coding.reshape(m, C)
    elif not compact:
        ids = take("<i4", n_lists * L, "lists (ids)").astype(np.int32)
        scores = take("<f2", n_lists * L, "lists (scores)").astype(np.float16)
        if ids.size and (ids.min() < 0 or ids.max() >= n_tokens):
            raise _fail(f"list id out of range [0, {n_tokens})")
        ids = ids.reshape(m, C, L)
        scores = scores.reshape(m, C, L)
    else:  # CSAC version 1
        ids = np.empty((n_lists, L), dtype=np.int32)
        q = np.empty((n_lists, L), dtype=np.uint8)
        lo = np.empty(n_lists, dtype=np.float32)
        hi = np.empty(n_lists, dtype=np.float32)
        for li in range(n_lists):
            if pos + 8 > len(buf):
                raise _fail("bad list range (truncated)")
            rng = np.frombuffer(buf, dtype="<f4", count=2, offset=pos)
            pos += 8
            if not (np.isfinite(rng).all() and rng[1] >= rng[0]):
                raise _fail(f"bad list range (lo={rng[0]}, hi={rng[1]})")
            lo[li], hi[li] = rng
            ids[li], pos = _list_ids(buf, pos, L, n_tokens)
            if pos + L > len(buf):
                raise _fail("truncated scores")
            q[li] = np.frombuffer(buf, dtype=np.uint8, count=L, offset=pos)
            pos += L
        # Dequantization as the compiled loader does it: step in fp32, then one
        # fused multiply-add, then fp16 (round to nearest even).
        with np.errstate(over="ignore", invalid="ignore"):
            step = np.where(hi > lo, (hi - lo) / np.float32(255.0), np.float32(0.0))
        step = step.astype(np.float32)
        s = fma_f32(q.astype(np.float32), step[:, None], lo[:, None])
        with np.errstate(over="ignore"):
            scores = s.astype(np.float16).reshape(m, C, L)
        ids = ids.reshape(m, C, L)
        q = q.reshape(m, C, L)
        lo = lo.reshape(m, C)
        hi = hi.reshape(m, C)
    sketch = sketch_scale = None
    if version >= (_CSAC_SKETCH_VERSION if compact else _CSAP_SKETCH_VERSION):
        if pos + 9 > len(buf):
            raise _fail("truncated key sketch header")
        (o.rerank,) = struct.unpack_from("<d", buf, pos)
        bits = buf[pos + 8]
        pos += 9
        problem = o.check()
        if problem is not None:
            raise _fail(f"bad rerank ({problem})")
        if bits not in (0, _SKETCH_BITS):
            raise _fail(f"bad key sketch bits {bits}, expected 0 or {_SKETCH_BITS}")
        if (bits != 0) != (o.rerank > 0):
            raise _fail(f"rerank and key sketch disagree (rerank={o.rerank}, bits={bits})")
        if bits:
            sketch = take("<i1", n_tokens * d, "key sketch").reshape(n_tokens, d)
            sketch_scale = take("<f2", n_tokens, "key sketch").astype(np.float16)
            if sketch.size and sketch.min() < -127:
                raise _fail("bad key sketch code (-128)")
            sc = sketch_scale.astype(np.float32)
            if not (np.isfinite(sc).all() and (sc >= 0).all()):
                raise _fail("bad key sketch scale")
    if pos != len(buf):
        raise _fail(f"trailing bytes ({len(buf) - pos} after the last list)")
    return CsaArtifact(magic=magic.decode(), version=version, options=o, head_dim=d,
                       n_tokens=n_tokens, n_built=n_built, L=L, centroids=centroids,
                       key_mean=key_mean, tail_mean=tail_mean, ids=ids, scores=scores,
                       lo=lo, hi=hi, q=q, book=book, id_coding=id_coding,
                       sketch=sketch, sketch_scale=sketch_scale)


# --------------------------------------------------------------------------
# Quest (QST1), StreamingLLM (STR1) and oracle (ORCL) artifacts.


@dataclass
class QuestArtifact:
    """A parsed ``QST1`` artifact (``index::QuestSelector``).

    page_size: tokens per Quest page (the index's own parameter, not the
        store's page size); ``P = ceil(n_tokens / page_size)`` pages.
    page_min, page_max: float32 [P, d], the element-wise minimum and maximum
        of each page's keys (the last page may be partial).
    """

    magic: str
    version: int
    n_tokens: int
    head_dim: int
    page_size: int
    rho: float
    page_min: np.ndarray
    page_max: np.ndarray


@dataclass
class StreamingArtifact:
    """A parsed ``STR1`` artifact (``index::StreamingSelector``)."""

    magic: str
    version: int
    n_tokens: int
    head_dim: int
    n_sink: int
    rho: float


@dataclass
class OracleArtifact:
    """A parsed ``ORCL`` artifact (``index::OracleSelector``): the shape only;
    the oracle scores the context's keys, which the caller supplies."""

    magic: str
    version: int
    n_tokens: int
    head_dim: int
    rho: float


def _header(buf: Any, magic: bytes, what: str, newest: int = 1) -> int:
    """Checks magic and a version in [1, newest] like
    ``ByteReader::GetHeader``; returns the version. ``buf``: any bytes-like."""
    if len(buf) < 8 or bytes(buf[:4]) != magic:
        got = bytes(buf[:4]) if len(buf) >= 4 else f"an artifact of {len(buf)} bytes"
        raise ValueError(f"{what}: bad magic {got!r}, expected {magic.decode()!r}")
    (version,) = struct.unpack_from("<I", buf, 4)
    if not 1 <= version <= newest:
        raise ValueError(f"{what}: unsupported format version {version}, this parser reads "
                         f"{'1' if newest == 1 else f'1 to {newest}'}")
    return version


class QuestLayout(NamedTuple):
    """Where a ``QST1`` artifact holds its bounds: ``pages`` x ``head_dim``
    minima at byte 32, the maxima right after them, each ``item`` bytes
    (version 1: float32, 4; version 2: bf16, 2)."""
    version: int
    n_tokens: int
    head_dim: int
    page_size: int
    rho: float
    pages: int
    item: int


def quest_layout(buf: Any) -> QuestLayout:
    """Checks a ``QST1`` artifact's header and size (any bytes-like, read in
    place) as ``QuestSelector::Load`` does: ValueError for a bad magic or
    version, a truncated header, page <= 0, rho outside (0, 1], n_tokens
    outside [0, 2^31 - 2], d outside [1, 4096], or a size other than
    32 + 2 * item * P * d."""
    version = _header(buf, b"QST1", "quest", newest=2)
    if len(buf) < 32:
        raise ValueError(f"quest artifact: truncated header ({len(buf)} bytes, expected >= 32)")
    n, d, page, rho = struct.unpack_from("<qiid", buf, 8)
    if page <= 0:
        raise ValueError(f"quest artifact: corrupt page size {page}, expected > 0")
    if not (0 < rho <= 1):
        raise ValueError(f"quest artifact: corrupt rho {rho}, expected in (0, 1]")
    if not (0 <= n < 2**31 - 1 and 1 <= d <= 4096):
        raise ValueError(f"quest artifact: corrupt header (n_tokens={n}, d={d}); expected "
                         "n_tokens in [0, 2^31 - 2], d in [1, 4096]")
    p = (n + page - 1) // page
    item = 2 if version == 2 else 4
    want = 32 + 2 * item * p * d
    if len(buf) < want:
        raise ValueError(f"quest artifact: truncated ({len(buf)} bytes, expected {want} for "
                         f"{p} pages of dim {d})")
    if len(buf) > want:
        raise ValueError(f"quest artifact: trailing bytes ({len(buf) - want} after the page "
                         "bounds)")
    return QuestLayout(version, int(n), int(d), int(page), float(rho), int(p), item)


def parse_quest_artifact(data: bytes) -> QuestArtifact:
    """Parses one ``QST1`` artifact (docs/storage-format.md, "Quest").

    Raises ValueError naming the problem for the cases ``QuestSelector::Load``
    rejects (:func:`quest_layout`; version 2's bf16 bounds are widened here)
    and for non-finite page bounds.
    """
    buf = bytes(data)
    lay = quest_layout(buf)
    version, n, d, page, rho, p = (lay.version, lay.n_tokens, lay.head_dim, lay.page_size,
                                   lay.rho, lay.pages)
    if version == 2:  # bf16: the high half of a float32
        raw = np.frombuffer(buf, dtype="<u2", count=2 * p * d, offset=32).astype(np.uint32)
        both = (raw << 16).view(np.float32)
        mn, mx = both[:p * d].copy(), both[p * d:].copy()
    else:
        mn = np.frombuffer(buf, dtype="<f4", count=p * d, offset=32).astype(np.float32)
        mx = np.frombuffer(buf, dtype="<f4", count=p * d,
                           offset=32 + 4 * p * d).astype(np.float32)
    if not (np.isfinite(mn).all() and np.isfinite(mx).all()):
        raise ValueError("quest artifact: bad page bounds (not finite)")
    return QuestArtifact(magic="QST1", version=version, n_tokens=int(n), head_dim=int(d),
                         page_size=int(page), rho=float(rho), page_min=mn.reshape(p, d),
                         page_max=mx.reshape(p, d))


def parse_streaming_artifact(data: bytes) -> StreamingArtifact:
    """Parses one ``STR1`` artifact (exactly 32 bytes). ValueError for a bad
    magic or version, any other length, n_tokens < 0, d <= 0, sink < 0 or
    rho outside (0, 1] (``StreamingSelector::Load``)."""
    buf = bytes(data)
    version = _header(buf, b"STR1", "streaming")
    if len(buf) != 32:
        raise ValueError(f"streaming artifact: truncated or oversized ({len(buf)} bytes, "
                         "expected 32)")
    n, d, sink, rho = struct.unpack_from("<qiid", buf, 8)
    if n < 0 or d <= 0 or sink < 0 or not (0 < rho <= 1):
        raise ValueError(f"streaming artifact: corrupt fields (n_tokens={n}, d={d}, "
                         f"sink={sink}, rho={rho})")
    return StreamingArtifact(magic="STR1", version=version, n_tokens=int(n), head_dim=int(d),
                             n_sink=int(sink), rho=float(rho))


def parse_oracle_artifact(data: bytes) -> OracleArtifact:
    """Parses one ``ORCL`` artifact (28 bytes; like ``LoadOracleSelector``,
    trailing bytes are not rejected). ValueError for a bad magic or version,
    truncation, n_tokens outside [1, 2^31 - 1], d outside [1, 4096] or rho
    outside (0, 1]."""
    buf = bytes(data)
    version = _header(buf, b"ORCL", "oracle")
    if len(buf) < 28:
        raise ValueError(f"oracle artifact: truncated ({len(buf)} bytes, expected 28)")
    n, d, rho = struct.unpack_from("<qid", buf, 8)
    if not (1 <= n <= 2**31 - 1 and 1 <= d <= 4096):
        raise ValueError(f"oracle artifact: corrupt n_tokens/head_dim (n_tokens={n}, d={d})")
    if not (0 < rho <= 1):
        raise ValueError(f"oracle artifact: corrupt rho {rho}, expected in (0, 1]")
    return OracleArtifact(magic="ORCL", version=version, n_tokens=int(n), head_dim=int(d),
                          rho=float(rho))
