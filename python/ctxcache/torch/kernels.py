"""Triton kernels of the GPU sparse decode path.

csa_score_pages   csa's score-add: per (row, subspace) the nearest centroid of
                  the pooled group query, its list's entries added to page bins.
sketch_scores     csa's stage 2: gathered int8 key-sketch rows dotted with
                  each q head's int16-range query codes in int32 (exact),
                  scaled in float64 (index/csa.h "Two-stage retrieval").
select_top_pages  exact per-row top-k of page scores (ties: lower page first),
                  on the order-preserving integer image of the float
                  scores, then a prefix-sum compaction. Three ways to find
                  the k-th largest key (SELECT_ALGO): "radix", one program
                  per row, one histogram per digit of RADIX_BITS bits, most
                  significant first, stopping once the bin holding the k-th
                  key is taken whole; "split", the same with
                  each row spread over up to 16 programs that meet at
                  atomic-counter barriers (faster from ~16K pages per row);
                  or "search", a FAN-ary search over the key range. Replaces torch.topk, whose
                  single-block radix select dominated the selection at 8-64
                  rows of 8K pages.
PagedDecodeAttention
                  flash-decoding over the selected pages read in place from
                  the page pool (no gather copy): each program attends the G
                  q heads of one kv head over a split of its pages with an
                  online softmax; a second kernel combines the splits
                  (folding it into the last split to finish, by an arrival
                  counter, was measured slower: docs/benchmarks.md).

Shapes (R = batch * n_kv_heads rows, P pages per row, B = 16 tokens/page):
  scores  [R, P] float32
  pages   [R, kp] int64 global page ids (row * P + page), any order
  q       [R, G, D] (the batch's queries viewed by kv head), bf16/fp16
  k, v    [R * P * B, D] page pool, page-major, same dtype as q
Import needs triton and a CUDA device. The session pipeline (csa selection,
page cap, page tables) is the C++ session core's (ctxcache.native.DecodeSession
runs it through the native library); ctxcache.torch.gpu_session runs it as
torch tensor ops.
"""
import functools
import math
import os

import torch
import triton
import triton.language as tl


# Warps of the top-k kernel; 0 = by row length (override: CTXCACHE_SELECT_WARPS).
SELECT_WARPS = int(os.environ.get("CTXCACHE_SELECT_WARPS", "0"))
# Branching of the top-k search (a power of 2): FAN - 1 thresholds per step.
# 4 measured fastest on an H100 (8 and 16 rows of 8K pages): the compares
# grow with FAN faster than the steps shrink.
SELECT_FAN = int(os.environ.get("CTXCACHE_SELECT_FAN", "4"))
# How select_top_pages finds the k-th largest key: "radix" or "search"
# (override: CTXCACHE_SELECT_ALGO).
SELECT_ALGO = os.environ.get("CTXCACHE_SELECT_ALGO", "radix")
# Bits per radix digit, 5 to 8 (tl.histogram needs >= 32 bins). Its cost per
# key grows with the bins (~log2(bins) + bins / 32 * (log2(bins) + 1) ops per
# thread), so narrow digits can win despite more rounds. Default: 5 (the
# sweep: docs/benchmarks.md, "Narrow radix digits"). Override: CTXCACHE_RADIX_BITS.
RADIX_BITS = int(os.environ.get("CTXCACHE_RADIX_BITS", "5"))
# Programmatic dependent launch (compute capability >= 9): each kernel of a
# decode step is launched while the one before it still runs and waits for
# it on the GPU (griddepcontrol), hiding the launch gaps between them.
# "1" on, "0" off, "auto" (default) on for steps of at most PDL_AUTO_ROWS
# rows (batch x kv heads), where every kernel of the step is one wave; with
# more rows the next grid's waiting programs take SM slots (measurements:
# docs/benchmarks.md, "Narrow radix digits"). Override: CTXCACHE_PDL.
PDL = os.environ.get("CTXCACHE_PDL", "auto")
PDL_AUTO_ROWS = 16


@functools.lru_cache(maxsize=None)
def _pdl_capable(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(device, rows: int) -> bool:
    if PDL not in ("0", "1", "auto"):
        raise ValueError(f"CTXCACHE_PDL: expected 0, 1 or auto, got {PDL!r}")
    on = PDL == "1" or (PDL == "auto" and rows <= PDL_AUTO_ROWS)
    return on and _pdl_capable(device)


@triton.jit
def _gdc_wait(GDC: tl.constexpr):
    """First statement of a kernel launched with launch_pdl: wait until the
    grid before it has finished and its writes are visible."""
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _gdc_trigger(GDC: tl.constexpr):
    """Let the grid after this one launch once every program has passed here
    (it waits with _gdc_wait before reading anything). Early in one-wave
    kernels; in many-wave kernels late, or the waiting programs of the next
    grid would take SM slots from this one's later waves."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _gdc_enter(GDC: tl.constexpr):
    _gdc_wait(GDC)
    _gdc_trigger(GDC)


@triton.jit
def _csa_score_add(q_ptr, cent_ptr, ids_ptr, sc_ptr, bins_ptr, r, b, split, L, per_split,
                   bin_stride, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   M: tl.constexpr, C: tl.constexpr, DS: tl.constexpr, BL: tl.constexpr,
                   GDC: tl.constexpr, LIST_DIV: tl.constexpr):
    """Row r, subspace b: nearest centroid of the group's pooled sub-query,
    then w_b * score of list entries [split * per_split, +per_split) added
    to bins[r * bin_stride + id]. The centroids and lists are row
    r // LIST_DIV's (LIST_DIV q-head rows share a kv head's index). The adds
    are relaxed (fire-and-forget reductions): whoever reads the bins is
    ordered after them by the kernel boundary."""
    offs_g = tl.arange(0, GP)
    offs_s = tl.arange(0, DS)
    qs = tl.load(q_ptr + (r * G + offs_g[:, None]) * D + b * DS + offs_s[None, :],
                 mask=offs_g[:, None] < G, other=0.0).to(tl.float32)
    qv = tl.sum(qs, axis=0) / G  # the group's pooled sub-query
    w = tl.sqrt(tl.sum(qv * qv, axis=0))  # norm weight w_b = ||q^b||
    offs_c = tl.arange(0, C)
    lr = r // LIST_DIV
    cent = tl.load(cent_ptr + ((lr * M + b) * C + offs_c[:, None]) * DS + offs_s[None, :])
    j = tl.argmax(tl.sum(cent.to(tl.float32) * qv[None, :], axis=1), axis=0)  # best cosine
    _gdc_trigger(GDC)  # many waves at larger batches: trigger late
    base = ((lr * M + b) * C + j).to(tl.int64) * L
    row_bins = bins_ptr + r.to(tl.int64) * bin_stride
    l_end = tl.minimum(split * per_split + per_split, L)
    for l0 in range(split * per_split, l_end, BL):
        offs = l0 + tl.arange(0, BL)
        ok = offs < l_end
        ids = tl.load(ids_ptr + base + offs, mask=ok, other=0)
        sc = tl.load(sc_ptr + base + offs, mask=ok, other=0.0).to(tl.float32)
        tl.atomic_add(row_bins + ids, sc * w, mask=ok, sem="relaxed")


@triton.jit
def _csa_score_pages_kernel(q_ptr, cent_ptr, ids_ptr, sc_ptr, bins_ptr, L, per_split,
                            bin_stride, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            M: tl.constexpr, C: tl.constexpr, DS: tl.constexpr,
                            BL: tl.constexpr, GDC: tl.constexpr, LIST_DIV: tl.constexpr):
    _gdc_wait(GDC)
    _csa_score_add(q_ptr, cent_ptr, ids_ptr, sc_ptr, bins_ptr, tl.program_id(0),
                   tl.program_id(1), tl.program_id(2), L, per_split, bin_stride, G, GP, D, M,
                   C, DS, BL, GDC, LIST_DIV)


def csa_score_pages(q: torch.Tensor, centroids: torch.Tensor, list_bins: torch.Tensor,
                    list_scores: torch.Tensor, bins: torch.Tensor, list_div: int = 1,
                    bin_stride: int = 0) -> None:
    """Adds every row's CSA scores into `bins` (zero on entry).

    q [R, G, D]; centroids [R / list_div, M, C, DS] unit rows; list_bins
    [R / list_div * M * C, L] int32 bin ids; list_scores [same] fp16; bins
    float32. One program per (row, subspace): nearest centroid of the pooled
    group query, then w_b * score of each list entry atomically added to
    bins[row * bin_stride + id].

    Page bins per kv head (the default): list ids are global page bins
    (row * P + page), bin_stride 0, list_div 1. Token bins per q head: q
    [R * G, 1, D] (each q head its own row), list_div G (a kv head's lists
    serve its G q heads), list ids are token ids, bin_stride N.
    """
    rows, g, m, c, ds, n_list, splits = _csa_grid(q, centroids, list_bins)
    if list_div < 1 or rows % list_div or centroids.shape[0] * list_div != rows:
        raise ValueError(f"csa_score_pages: {rows} rows, {centroids.shape[0]} centroid rows "
                         f"and list_div {list_div} do not match")
    pdl = _pdl(q.device, rows)
    _csa_score_pages_kernel[(rows, m, splits)](q, centroids, list_bins, list_scores, bins,
                                               n_list, CSA_PER_SPLIT, bin_stride, G=g,
                                               GP=max(2, triton.next_power_of_2(g)),
                                               D=q.shape[2], M=m, C=c, DS=ds, BL=1024,
                                               num_warps=4, GDC=pdl, launch_pdl=pdl,
                                               LIST_DIV=list_div)


# List entries per score-add program: long lists spread over more SMs.
CSA_PER_SPLIT = 512


def _csa_grid(q, centroids, list_bins):
    rows, g, _ = q.shape
    _, m, c, ds = centroids.shape
    n_list = list_bins.shape[1]
    return rows, g, m, c, ds, n_list, (n_list + CSA_PER_SPLIT - 1) // CSA_PER_SPLIT


def _key_params(exact: bool, digit_bits: int) -> dict:
    """Constexprs of the radix kernels: rank by all 32 bits, or by the top 16
    (bf16 precision); digits of digit_bits bits."""
    if not 5 <= digit_bits <= 8:
        raise ValueError(f"radix_bits: expected 5 to 8, got {digit_bits}")
    key_bits = 32 if exact else 16
    return dict(KEY_BITS=key_bits, KEY_MASK=-1 if exact else (1 << key_bits) - 1,
                KEY_SIGN=-2**31 if exact else 1 << (key_bits - 1), DIGIT_BITS=digit_bits)


@triton.jit
def _select_top_pages_kernel(x_ptr, out_ptr, P, K, N_RECENT, RESET: tl.constexpr,
                             KEY_BITS: tl.constexpr, FAN: tl.constexpr, STEPS: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < P
    x = tl.load(x_ptr + row * P + offs, mask=valid, other=float("-inf"))
    # The sink page and the N_RECENT last pages are always taken.
    x = tl.where(valid & ((offs == 0) | (offs >= P - N_RECENT)), float("inf"), x)
    if RESET:  # leave the bins zeroed for the next step
        tl.store(x_ptr + row * P + offs, tl.zeros([BLOCK], tl.float32), mask=valid)
    bits = x.to(tl.int32, bitcast=True)
    # Order-preserving int32 image of IEEE floats (negatives: flip all but
    # sign). Keys stay 32-bit (the compares are the kernel's work); only the
    # search bounds' arithmetic is 64-bit.
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # KEY_BITS 16: rank by the top 16 bits (bf16 precision), ties by page
    # order; about half the search steps of the exact 32-bit ranking.
    key = key >> (32 - KEY_BITS)
    key = tl.where(valid, key, -2**31)  # padding ranks below every page
    lo = tl.min(tl.where(valid, key, 2**31 - 1), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64)
    # FAN-ary search for the K-th largest key: FAN - 1 thresholds counted in
    # one 2-D reduction per step. Invariant: count(key >= lo) >= K > count(key > hi).
    fan = tl.arange(0, FAN)
    for _ in tl.static_range(STEPS):
        span = hi - lo + 1
        ts = (lo + (span * fan) // FAN).to(tl.int32)  # ts[0] = lo
        cnt = tl.sum(((key[None, :] >= ts[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        best = tl.max(tl.where(cnt >= K, fan, 0), axis=0)  # counts fall with the threshold
        new_lo = lo + (span * best) // FAN
        hi = tl.where(best == FAN - 1, hi, lo + (span * (best + 1)) // FAN - 1)
        lo = new_lo
    lo = lo.to(tl.int32)
    gt = (key > lo) & valid
    _radix_store(out_ptr, row, P, K, offs, gt, (key == lo) & valid,
                 K - tl.sum(gt.to(tl.int32), axis=0), 0, 0)


@triton.jit
def _radix_keys(x_ptr, row, P, offs, valid, N_RECENT, RESET: tl.constexpr,
                KEY_BITS: tl.constexpr, KEY_MASK: tl.constexpr, KEY_SIGN: tl.constexpr):
    """Unsigned order-preserving keys in [0, 2^KEY_BITS) of a row's scores at
    `offs` (the top KEY_BITS bits of each float). Page 0 and the N_RECENT
    last pages count as +inf."""
    x = tl.load(x_ptr + row * P + offs, mask=valid, other=0.0)
    x = tl.where(valid & ((offs == 0) | (offs >= P - N_RECENT)), float("inf"), x)
    if RESET:  # leave the bins zeroed for the next step
        tl.store(x_ptr + row * P + offs, tl.zeros_like(x), mask=valid)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order-preserving image
    key = key >> (32 - KEY_BITS)  # arithmetic: the top KEY_BITS bits, signed
    return ((key & KEY_MASK) ^ KEY_SIGN).to(tl.uint32, bitcast=True)  # flip the sign bit


@triton.jit
def _radix_digits(u, cand, n_local, SHIFT: tl.constexpr, NB: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The candidates' digit at SHIFT (non-candidates: 0) and its histogram
    over the candidates only (they are counted into bin 0 and subtracted: no
    histogram mask in older Triton). n_local = candidates in `cand`."""
    d = tl.where(cand, ((u >> SHIFT) & (NB - 1)).to(tl.int32), 0)
    h = tl.histogram(d, NB)
    return d, h - tl.where(tl.arange(0, NB) == 0, BLOCK - n_local, 0)


@triton.jit
def _radix_pick(h, n_cand, krem, NB: tl.constexpr):
    """The bin holding the krem-th largest of n_cand candidates (histogram h):
    (bin, krem within that bin, candidates in that bin). Exactly one bin
    hits; its three numbers come out of one packed reduction."""
    bins = tl.arange(0, NB)
    above = n_cand - tl.cumsum(h, axis=0)  # candidates in higher bins
    hit = (above < krem) & (above + h >= krem)
    packed = tl.sum(tl.where(hit, (above.to(tl.int64) << 40) | (h.to(tl.int64) << 20) |
                             bins.to(tl.int64), 0), axis=0)
    b = (packed & 0xFFFFF).to(tl.int32)
    return b, krem - (packed >> 40).to(tl.int32), ((packed >> 20) & 0xFFFFF).to(tl.int32)


@triton.jit
def _radix_store(out_ptr, row, P, K, offs, gt, cand, krem, gt_before, eq_before):
    """Writes the row's K pages: every key above the candidates' bin (`gt`),
    then the first krem candidates in page order; gt_before / eq_before =
    such keys at lower offsets in other programs of the row."""
    # One scan for both prefix counts (P < 65536): > in the low 16 bits.
    both = tl.cumsum(gt.to(tl.uint32) + (cand.to(tl.uint32) << 16), axis=0)
    gt_rank = gt_before + (both & 0xFFFF).to(tl.int32)
    eq_rank = eq_before + (both >> 16).to(tl.int32)
    take = gt | (cand & (eq_rank <= krem))
    pos = tl.where(gt, gt_rank - 1, (K - krem) + eq_rank - 1)
    tl.store(out_ptr + row * K + pos, (row * P + offs).to(tl.int64), mask=take)


@triton.jit
def _radix_select_row(x_ptr, out_ptr, row, P, K, N_RECENT, RESET: tl.constexpr,
                      KEY_BITS: tl.constexpr, KEY_MASK: tl.constexpr, KEY_SIGN: tl.constexpr,
                      DIGIT_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One program's exact top-K of row `row` (BLOCK >= P keys)."""
    offs = tl.arange(0, BLOCK)
    valid = offs < P
    u = _radix_keys(x_ptr, row, P, offs, valid, N_RECENT, RESET, KEY_BITS, KEY_MASK, KEY_SIGN)
    NB: tl.constexpr = 1 << DIGIT_BITS
    ROUNDS: tl.constexpr = (KEY_BITS + DIGIT_BITS - 1) // DIGIT_BITS
    # Most significant digit first: histogram the candidates' digit, find the
    # bin that holds the k-th largest, keep only that bin's candidates.
    # krem = rank of the k-th largest among the n_cand remaining candidates;
    # every key above the candidates' bin (u > hi) is taken. A round runs
    # only while n_cand > krem: once they are equal every candidate is taken
    # and their order does not matter.
    cand = valid
    n_cand = P + tl.zeros([], tl.int32)  # tensors, not constexprs (K = 1 is specialized)
    krem = K + tl.zeros([], tl.int32)
    prefix = tl.zeros([], tl.uint32)
    hi = ~tl.zeros([], tl.uint32)
    for r in tl.static_range(ROUNDS):
        shift = DIGIT_BITS * (ROUNDS - 1 - r)  # the first digit takes the remainder bits
        if n_cand > krem:
            d, h = _radix_digits(u, cand, n_cand, shift, NB, BLOCK)
            b, krem, n_cand = _radix_pick(h, n_cand, krem, NB)
            prefix = (prefix << DIGIT_BITS) | b.to(tl.uint32)
            hi = (prefix << shift) | tl.full([], (1 << shift) - 1, tl.uint32)
            cand = cand & (d == b)
    _radix_store(out_ptr, row, P, K, offs, (u > hi) & valid, cand, krem, 0, 0)


@triton.jit
def _select_top_pages_radix_kernel(x_ptr, out_ptr, P, K, N_RECENT, RESET: tl.constexpr,
                                   KEY_BITS: tl.constexpr, KEY_MASK: tl.constexpr,
                                   KEY_SIGN: tl.constexpr, DIGIT_BITS: tl.constexpr,
                                   BLOCK: tl.constexpr, GDC: tl.constexpr):
    _gdc_enter(GDC)
    _radix_select_row(x_ptr, out_ptr, tl.program_id(0), P, K, N_RECENT, RESET, KEY_BITS,
                      KEY_MASK, KEY_SIGN, DIGIT_BITS, BLOCK)


@triton.jit
def _select_top_pages_split_kernel(x_ptr, out_ptr, ws_ptr, P, K, N_RECENT, CHUNK,
                                   S: tl.constexpr, SP: tl.constexpr, RESET: tl.constexpr,
                                   KEY_BITS: tl.constexpr, KEY_MASK: tl.constexpr,
                                   KEY_SIGN: tl.constexpr, DIGIT_BITS: tl.constexpr,
                                   BLOCK: tl.constexpr):
    # The radix select of _radix_select_row with each row split over S
    # programs (CHUNK keys each): per round every program adds its chunk's
    # histogram into the row's global one, the S programs meet at a barrier
    # (an atomic counter they spin on; all R * S programs must be resident at
    # once, which the caller ensures), and each reads the summed histogram
    # and takes the same decision. A last barrier exchanges the chunks'
    # counts for the output offsets. ws (int32, zeroed by the caller before
    # each call): [R, ROUNDS + 1] counters | [R, ROUNDS, NB] histograms |
    # [R, S, 2] chunk counts.
    row = tl.program_id(0)
    s = tl.program_id(1)
    n_rows = tl.num_programs(0)
    NB: tl.constexpr = 1 << DIGIT_BITS
    ROUNDS: tl.constexpr = (KEY_BITS + DIGIT_BITS - 1) // DIGIT_BITS
    sync = ws_ptr + row * (ROUNDS + 1)
    hist = ws_ptr + n_rows * (ROUNDS + 1) + row * (ROUNDS * NB)
    cnts = ws_ptr + n_rows * (ROUNDS + 1) + n_rows * (ROUNDS * NB) + row * (S * 2)
    lane = tl.arange(0, BLOCK)
    offs = s * CHUNK + lane
    valid = (lane < CHUNK) & (offs < P)
    u = _radix_keys(x_ptr, row, P, offs, valid, N_RECENT, RESET, KEY_BITS, KEY_MASK, KEY_SIGN)
    bins = tl.arange(0, NB)
    cand = valid
    n_cand = P + tl.zeros([], tl.int32)  # candidates of the whole row
    krem = K + tl.zeros([], tl.int32)
    prefix = tl.zeros([], tl.uint32)
    hi = ~tl.zeros([], tl.uint32)
    for r in tl.static_range(ROUNDS):
        shift = DIGIT_BITS * (ROUNDS - 1 - r)  # the first digit takes the remainder bits
        if n_cand > krem:  # the same values in every program of the row
            d, h = _radix_digits(u, cand, tl.sum(cand.to(tl.int32), axis=0), shift, NB, BLOCK)
            tl.atomic_add(hist + r * NB + bins, h)
            tl.debug_barrier()  # every thread's adds issued before the arrival
            arrived = tl.atomic_add(sync + r, 1) + 1
            while arrived < S:
                arrived = tl.atomic_add(sync + r, 0)
            gh = tl.atomic_add(hist + r * NB + bins, tl.zeros([NB], tl.int32))
            b, krem, n_cand = _radix_pick(gh, n_cand, krem, NB)
            prefix = (prefix << DIGIT_BITS) | b.to(tl.uint32)
            hi = (prefix << shift) | tl.full([], (1 << shift) - 1, tl.uint32)
            cand = cand & (d == b)
    gt = (u > hi) & valid
    tl.atomic_add(cnts + s * 2, tl.sum(gt.to(tl.int32), axis=0))
    tl.atomic_add(cnts + s * 2 + 1, tl.sum(cand.to(tl.int32), axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(sync + ROUNDS, 1) + 1
    while arrived < S:
        arrived = tl.atomic_add(sync + ROUNDS, 0)
    so = tl.arange(0, SP)
    before = (so < s) & (so < S)
    c_gt = tl.atomic_add(cnts + so * 2, tl.zeros([SP], tl.int32), mask=so < S)
    c_eq = tl.atomic_add(cnts + so * 2 + 1, tl.zeros([SP], tl.int32), mask=so < S)
    _radix_store(out_ptr, row, P, K, offs, gt, cand, krem,
                 tl.sum(tl.where(before, c_gt, 0), axis=0),
                 tl.sum(tl.where(before, c_eq, 0), axis=0))


_split_workspaces = {}


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_programs(rows: int, p: int, device) -> int:
    """Programs per row for algo "split": as many as keep every program of
    the grid resident (<= one per SM) and chunks of >= 256 keys; 1 = none."""
    sm = _sm_count(device)
    s = 1
    while s * 2 <= 16 and rows * s * 2 <= sm and p // (s * 2) >= 256:
        s *= 2
    return s


def select_top_pages(scores: torch.Tensor, k: int, n_recent: int = 0, reset: bool = False,
                     out: torch.Tensor = None, exact: bool = True,
                     algo: str = "", num_warps: int = 0, radix_bits: int = 0) -> torch.Tensor:
    """Global ids (row * P + page) of the k best pages of each row: [R, k].

    Page 0 and the n_recent last pages of each row count as +inf (always
    taken). reset: zero `scores` after reading it (the next step's bins).
    exact False: rank by bf16-rounded scores (ties by page order), faster.
    algo: "split", "radix" or "search" (the same pages); "" = SELECT_ALGO.
        "split" spreads each row over several programs that meet at grid
        barriers (radix when the grid would not fit one program per SM).
    num_warps: warps per row's program; 0 = SELECT_WARPS, else by row length.
    radix_bits: bits per digit of "radix" and "split", 5 to 8; 0 = RADIX_BITS.
    """
    assert scores.dim() == 2 and scores.is_contiguous() and scores.dtype == torch.float32
    rows, p = scores.shape
    assert 1 <= k <= p < 65536
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    block = triton.next_power_of_2(p)
    key_bits = 32 if exact else 16
    algo = algo or SELECT_ALGO
    digit_bits = radix_bits or RADIX_BITS
    pdl = _pdl(scores.device, scores.shape[0])
    warps = num_warps or SELECT_WARPS or (16 if block >= 4096 else 4)
    if algo == "split":
        n_split = _split_programs(rows, p, scores.device)
        if n_split == 1:
            algo = "radix"
        else:
            chunk = (p + n_split - 1) // n_split
            cblock = max(triton.next_power_of_2(chunk), 1 << digit_bits)
            rounds = (key_bits + digit_bits - 1) // digit_bits
            size = rows * (rounds + 1) + rows * rounds * (1 << digit_bits) + rows * n_split * 2
            ws_key = (scores.device, size)
            ws = _split_workspaces.get(ws_key)
            if ws is None:
                ws = _split_workspaces[ws_key] = torch.empty(size, dtype=torch.int32,
                                                             device=scores.device)
            ws.zero_()
            _select_top_pages_split_kernel[(rows, n_split)](
                scores, out, ws, p, k, n_recent, chunk, S=n_split,
                SP=max(2, triton.next_power_of_2(n_split)), RESET=reset, BLOCK=cblock,
                **_key_params(exact, digit_bits),
                num_warps=num_warps or (4 if cblock <= 1024 else 8 if cblock <= 2048 else 16))
            return out
    if algo == "radix":
        _select_top_pages_radix_kernel[(rows,)](
            scores, out, p, k, n_recent, RESET=reset, BLOCK=max(block, 1 << digit_bits),
            num_warps=warps, GDC=pdl, launch_pdl=pdl, **_key_params(exact, digit_bits))
        return out
    if algo != "search":
        raise ValueError(f"algo: expected 'split', 'radix' or 'search', got {algo!r}")
    fan_bits = SELECT_FAN.bit_length() - 1
    steps = (key_bits + fan_bits - 1) // fan_bits + 1
    _select_top_pages_kernel[(rows,)](scores, out, p, k, n_recent, RESET=reset,
                                      KEY_BITS=key_bits, FAN=SELECT_FAN, STEPS=steps,
                                      BLOCK=block, num_warps=warps)
    return out


@triton.jit
def attend_rows(q, k_ptr, v_ptr, tok, ok, offs_d, m_i, l_i, acc, scale_log2, D: tl.constexpr):
    """One block of flash-decoding: the q rows [GP, D] attend the keys and
    values at rows `tok` (int64, masked by `ok`) of k/v [*, D], folded into
    the online softmax state (m_i, l_i, acc; base-2 logits). Returns it."""
    k = tl.load(k_ptr + tok[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    sc = tl.dot(q, tl.trans(k)) * scale_log2
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + tok[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, sel_ptr, acc_ptr, m_ptr, l_ptr, KP, per_split,
                       scale_log2, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       PAGE: tl.constexpr, PAGES_PER_BLOCK: tl.constexpr,
                       GDC: tl.constexpr):
    _gdc_enter(GDC)
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_split = tl.num_programs(1)
    BN: tl.constexpr = PAGE * PAGES_PER_BLOCK
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(q_ptr + (r * G + offs_g[:, None]) * D + offs_d[None, :],
                mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    p_begin = s * per_split
    p_end = tl.minimum(p_begin + per_split, KP)
    for p0 in range(p_begin, p_end, PAGES_PER_BLOCK):
        slot = p0 + offs_n // PAGE
        ok = slot < p_end
        page = tl.load(sel_ptr + r * KP + slot, mask=ok, other=0)
        tok = page * PAGE + offs_n % PAGE
        m_i, l_i, acc = attend_rows(q, k_ptr, v_ptr, tok, ok, offs_d, m_i, l_i, acc, scale_log2,
                                    D)
    base = (r * n_split + s) * G
    gmask = offs_g < G
    tl.store(acc_ptr + (base + offs_g[:, None]) * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(m_ptr + base + offs_g, m_i, mask=gmask)
    tl.store(l_ptr + base + offs_g, l_i, mask=gmask)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, S, G: tl.constexpr, D: tl.constexpr,
                    SP: tl.constexpr, GDC: tl.constexpr):
    _gdc_enter(GDC)
    r = tl.program_id(0)
    g = tl.program_id(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    ok = offs_s < S
    ms = tl.load(m_ptr + (r * S + offs_s) * G + g, mask=ok, other=float("-inf"))
    ls = tl.load(l_ptr + (r * S + offs_s) * G + g, mask=ok, other=0.0)
    mx = tl.max(ms, axis=0)
    w = tl.where(ok & (ms > float("-inf")), tl.exp2(ms - mx), 0.0)
    acc = tl.load(acc_ptr + ((r * S + offs_s[:, None]) * G + g) * D + offs_d[None, :],
                  mask=ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(ls * w, axis=0)
    tl.store(out_ptr + (r * G + g) * D + offs_d, o.to(out_ptr.dtype.element_ty))


class PagedDecodeAttention:
    """Attention of the G q heads of each row over its selected pages, in place.

    Buffers for the split partials and the output are allocated once per
    shape, so a call allocates nothing and can be captured in a CUDA graph.
    One call at a time per instance (the buffers are shared); the returned
    tensor is overwritten by the next call.
    """

    def __init__(self, rows: int, group: int, head_dim: int, kp: int, device, dtype,
                 page: int = 16, sm_count: int = 0, programs_per_sm: int = 2,
                 pages_per_block: int = 4):
        """programs_per_sm: split each row's pages so that about this many
        programs per SM run (Default: 2); pages_per_block: pages per inner
        step of a program (Default: 4, 64 tokens)."""
        self.rows, self.g, self.d, self.kp, self.page = rows, group, head_dim, kp, page
        sm = sm_count or _sm_count(device)
        self.ppb = pages_per_block if kp >= pages_per_block else 1
        want = max(1, (programs_per_sm * sm + rows - 1) // rows)
        self.splits = max(1, min(want, (kp + self.ppb - 1) // self.ppb))
        self.per_split = (kp + self.splits - 1) // self.splits
        self.per_split = ((self.per_split + self.ppb - 1) // self.ppb) * self.ppb
        self.splits = (kp + self.per_split - 1) // self.per_split
        self.acc = torch.empty(rows, self.splits, group, head_dim, device=device,
                               dtype=torch.float32)
        self.m = torch.empty(rows, self.splits, group, device=device, dtype=torch.float32)
        self.l = torch.empty_like(self.m)
        self.out = torch.empty(rows, group, head_dim, device=device, dtype=dtype)
        self.pdl = _pdl(device, rows)
        self.scale_log2 = (1.0 / math.sqrt(head_dim)) * math.log2(math.e)

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 pages: torch.Tensor) -> torch.Tensor:
        """q [rows, G, D]; k_pool/v_pool [n_pages * page, D]; pages [rows, kp] global ids."""
        gp = max(16, triton.next_power_of_2(self.g))
        _paged_attn_kernel[(self.rows, self.splits)](
            q, k_pool, v_pool, pages, self.acc, self.m, self.l, self.kp, self.per_split,
            self.scale_log2, G=self.g, GP=gp, D=self.d, PAGE=self.page,
            PAGES_PER_BLOCK=self.ppb, num_warps=4, GDC=self.pdl, launch_pdl=self.pdl)
        _combine_kernel[(self.rows, self.g)](
            self.acc, self.m, self.l, self.out, self.splits, G=self.g, D=self.d,
            SP=max(2, triton.next_power_of_2(self.splits)), num_warps=4, GDC=self.pdl,
            launch_pdl=self.pdl)
        return self.out


@triton.jit
def _sketch_scores_kernel(codes_ptr, scale_ptr, rows_ptr, qi_ptr, qs_ptr, out_ptr, R, N,
                          G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < R
    head = row // G
    ids = tl.load(rows_ptr + row * R + offs, mask=valid, other=0).to(tl.int64)
    cols = tl.arange(0, D)
    base = (head * N + ids) * D
    c = tl.load(codes_ptr + base[:, None] + cols[None, :], mask=valid[:, None], other=0)
    q = tl.load(qi_ptr + row * D + cols)
    dot = tl.sum(c.to(tl.int32) * q[None, :], axis=1)
    sc = tl.load(scale_ptr + head * N + ids, mask=valid, other=0.0)
    qs = tl.load(qs_ptr + row)
    r = (dot.to(tl.float64) * (qs * sc)).to(tl.float32)
    tl.store(out_ptr + row * R + offs, r, mask=valid)


def sketch_scores(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
                  qi: torch.Tensor, qs: torch.Tensor, group: int) -> torch.Tensor:
    """csa key-sketch scores, [hg, R] float32.

    codes  int8 [H, N, D] (D a power of 2), scales float64 [H, N]
    rows   int64 [hg, R] token ids; row i belongs to kv head i // group
    qi     [hg, D] integer-valued query codes (|qi| <= 2047), any float or int dtype
    qs     [hg, 1] the queries' scales
    Row i, entry e: float32(double(sum_j qi[i, j] * codes[i // group, rows[i, e], j])
    * (double(qs[i]) * scales[i // group, rows[i, e]])), the sum exact in int32.
    """
    hg, r = rows.shape
    h, n, d = codes.shape
    out = torch.empty(hg, r, dtype=torch.float32, device=rows.device)
    if r == 0:
        return out
    block = 64
    _sketch_scores_kernel[(hg, triton.cdiv(r, block))](
        codes, scales.to(torch.float64).contiguous(), rows.contiguous(),
        qi.to(torch.int32).contiguous(), qs.reshape(hg).to(torch.float64).contiguous(), out,
        r, n, G=group, D=d, BLOCK=block, num_warps=4)
    return out
