"""The engine's Triton kernels (CUDA only): miss resolution of the page pool,
Quest page bounds for the planner, attention over pool pages plus each
sequence's own tokens, and the elementwise steps of a Llama layer. Import
needs triton and a CUDA device; the CPU reference of each is in the module
that calls it."""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ctxcache.torch import kernels as _k
from ctxcache.torch.kernels import attend_rows


@triton.jit
def _claim_kernel(pages_ptr, slot_of_ptr, stamp_ptr, ref_ptr, clock_ptr, n_miss_ptr, miss_ptr,
                  counts_ptr, layer, n_req, H, P, KP, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_req
    page = tl.load(pages_ptr + offs, mask=ok, other=0).to(tl.int64)
    h = (offs // KP) % H
    unit = (layer * H + h).to(tl.int64) * P + page
    slot = tl.load(slot_of_ptr + unit, mask=ok, other=-1)
    now = tl.load(clock_ptr + 1)
    hit = ok & (slot >= 0)
    tl.store(stamp_ptr + slot, now + tl.zeros_like(slot), mask=hit)
    tl.store(ref_ptr + slot, 1 + tl.zeros_like(slot), mask=hit)
    miss = ok & (slot < 0)
    # Only -1 (absent) or -2 (claimed this resolve) can be here: exactly one
    # exchange per absent unit returns -1.
    old = tl.atomic_xchg(slot_of_ptr + unit, -2 + tl.zeros_like(slot), mask=miss)
    won = miss & (old == -1)
    idx = tl.atomic_add(n_miss_ptr + tl.zeros_like(slot), 1 + tl.zeros_like(slot), mask=won)
    tl.store(miss_ptr + idx, unit.to(tl.int32), mask=won)
    tl.atomic_add(counts_ptr, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(miss.to(tl.int64), axis=0))


@triton.jit
def _victim_kernel(stamp_ptr, ref_ptr, clock_ptr, n_miss_ptr, vict_ptr, counts_ptr, n_slots,
                   HELD: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.load(n_miss_ptr)
    hand = tl.load(clock_ptr)
    now = tl.load(clock_ptr + 1)
    if HELD:
        floor = tl.load(clock_ptr + 2)
    else:
        floor = now
    offs = tl.arange(0, BLOCK)
    found = m * 0
    swept = m * 0
    limit = 2 * n_slots
    while (found < m) & (swept < limit):
        # One block never crosses a lap of the ring: no slot twice in it.
        lap_left = n_slots - swept % n_slots
        valid = offs < lap_left
        idx = (hand + swept + offs) % n_slots
        st = tl.load(stamp_ptr + idx, mask=valid, other=0)
        rf = tl.load(ref_ptr + idx, mask=valid, other=0)
        free = valid & (st < floor)
        cand = free & (rf == 0)
        csum = tl.cumsum(cand.to(tl.int32), axis=0)
        take = cand & (found + csum <= m)
        n_take = tl.sum(take.to(tl.int32), axis=0)
        done = found + n_take >= m
        last = tl.max(tl.where(take, offs, -1), axis=0)
        span = tl.where(done, last + 1, tl.minimum(lap_left, BLOCK))
        passed = offs < span
        tl.store(ref_ptr + idx, tl.zeros_like(rf), mask=passed & free & (rf != 0))
        tl.store(vict_ptr + found + csum - 1, idx, mask=take)
        tl.store(stamp_ptr + idx, now + tl.zeros_like(st), mask=take)
        found += n_take
        swept += span
    tl.store(clock_ptr, (hand + swept) % n_slots)
    tl.store(clock_ptr + 1, now + 1)
    if not HELD:
        tl.store(clock_ptr + 2, now + 1)
    tl.store(n_miss_ptr + 1, found)
    tl.store(n_miss_ptr, m * 0)
    tl.atomic_add(counts_ptr + 2, found.to(tl.int64))
    tl.atomic_add(counts_ptr + 3, (m - found).to(tl.int64))


@triton.jit
def _install_kernel(miss_ptr, vict_ptr, n_miss_ptr, slot_of_ptr, page_of_ptr, ref_ptr,
                    host_k, host_v, pool_k, pool_v, UNIT: tl.constexpr):
    i = tl.program_id(0)
    m = tl.load(n_miss_ptr + 1)
    if i < m:
        u = tl.load(miss_ptr + i)
        s = tl.load(vict_ptr + i)
        old = tl.load(page_of_ptr + s)
        if old >= 0:
            tl.store(slot_of_ptr + old, -1)
        tl.store(slot_of_ptr + u, s)
        tl.store(page_of_ptr + s, u)
        tl.store(ref_ptr + s, 0)
        offs = tl.arange(0, UNIT)
        src = u.to(tl.int64) * UNIT + offs
        dst = s.to(tl.int64) * UNIT + offs
        tl.store(pool_k + dst, tl.load(host_k + src))
        tl.store(pool_v + dst, tl.load(host_v + src))


def resolve(pool, layer: int, pages: torch.Tensor, miss_units: torch.Tensor,
            miss_slots: torch.Tensor, held: bool = False) -> None:
    t = pool.tier
    n_req = pages.numel()
    block = 1024
    pages = pages.contiguous()
    _claim_kernel[(triton.cdiv(n_req, block),)](
        pages, pool.slot_of, pool.stamp, pool.ref, pool.clock, pool.n_miss, miss_units,
        pool.counts, layer, n_req, t.n_kv_heads, t.n_pages, pages.shape[2], BLOCK=block,
        num_warps=4)
    _victim_kernel[(1,)](pool.stamp, pool.ref, pool.clock, pool.n_miss, miss_slots,
                         pool.counts, pool.n_slots, HELD=held, BLOCK=1024, num_warps=8)
    _install_kernel[(n_req,)](miss_units, miss_slots, pool.n_miss, pool.slot_of, pool.page_of,
                              pool.ref, t.k, t.v, pool.k, pool.v, UNIT=t.page * t.head_dim,
                              num_warps=4)


@triton.jit
def _quest_kernel(q_ptr, kmin_ptr, kmax_ptr, out_ptr, layer, H, P, NQ, OS,
                  G: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr):
    """Rows (b, g) of kv head h: U = q+ . max + q- . min over pages of a block
    (= sum_j max(q_j min_j, q_j max_j); bf16 operands are exact, the sum is
    fp32 in the tensor cores' order)."""
    h = tl.program_id(0)
    pb = tl.program_id(1)
    qb = tl.program_id(2)
    offs_q = qb * BQ + tl.arange(0, BQ)          # b * G + g
    offs_d = tl.arange(0, D)
    offs_p = pb * BP + tl.arange(0, BP)
    qok = offs_q < NQ
    b = offs_q // G
    g = offs_q % G
    qrow = (b * H + h) * G + g                    # q [B, H * G, D] row
    q = tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=qok[:, None], other=0.0)
    qp = tl.maximum(q, 0.0).to(q.dtype)
    qn = tl.minimum(q, 0.0).to(q.dtype)
    pok = offs_p < P
    base = ((layer * H + h) * P + offs_p).to(tl.int64) * D
    mx = tl.load(kmax_ptr + base[:, None] + offs_d[None, :], mask=pok[:, None], other=0.0)
    mn = tl.load(kmin_ptr + base[:, None] + offs_d[None, :], mask=pok[:, None], other=0.0)
    s = tl.dot(qp, tl.trans(mx)) + tl.dot(qn, tl.trans(mn))
    tl.store(out_ptr + qrow[:, None].to(tl.int64) * OS + 1 + offs_p[None, :], s,
             mask=qok[:, None] & pok[None, :])


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, layer: int,
                 out: torch.Tensor) -> None:
    """q [B, H*G, D]; kmin/kmax [L, H, P, D]; out [B * H*G, P + 1] float32,
    page p's bound in column p + 1 (column 0 is the planner's)."""
    b, hq, d = q.shape
    _, h, p, _ = kmin.shape
    g = hq // h
    nq = b * g
    bq = min(64, max(16, triton.next_power_of_2(nq)))
    bp = 64
    _quest_kernel[(h, triton.cdiv(p, bp), triton.cdiv(nq, bq))](
        q, kmin, kmax, out, layer, h, p, nq, out.shape[1], G=g, D=d, BQ=bq, BP=bp, num_warps=4)


@triton.jit
def _cap_kernel(top_ptr, counts_ptr, out_ptr, P, KH1, KP, N_RECENT, G: tl.constexpr,
                BT: tl.constexpr, BLOCK: tl.constexpr):
    """Row (b, kv head): count how many of its G q heads' top entries (global
    ids row * (P + 1) + column; column 0 is the stand-in) name each page;
    write page 0, the last N_RECENT pages and the KP - those best pages by
    (count, page) descending to out[row, :KP] (any order); leave the counts
    zero."""
    row = tl.program_id(0)
    zero = row * 0
    cnt = counts_ptr + row.to(tl.int64) * P
    offs_t = tl.arange(0, BT)
    n_top = G * KH1
    for start in range(0, n_top, BT):
        i = start + offs_t
        ok = i < n_top
        ids = tl.load(top_ptr + row.to(tl.int64) * n_top + i, mask=ok, other=0)
        page = (ids % (P + 1) - 1).to(tl.int32)
        ok = ok & (page >= 0)
        tl.atomic_add(cnt + page, 1 + tl.zeros_like(page), mask=ok)
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK)
    # Histogram of the counts of the pages not forced (counts are 0..G).
    bins = tl.arange(0, 16)
    hist = tl.zeros([16], dtype=tl.int32)
    n_forced = zero
    for start in range(0, P, BLOCK):
        p = start + offs
        ok = p < P
        c = tl.load(cnt + p, mask=ok, other=0, cache_modifier=".cg")
        forced = ok & ((p == 0) | (p >= P - N_RECENT))
        free = ok & ~forced
        n_forced += tl.sum(forced.to(tl.int32), axis=0)
        for j in tl.static_range(G + 1):
            hist += tl.where(bins == j, tl.sum((free & (c == j)).to(tl.int32), axis=0), 0)
    r = KP - n_forced
    # The threshold t: fewer than r pages have a count > t, at least r >= t.
    n_ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    t = tl.max(tl.where(n_ge >= r, bins, 0), axis=0)
    n_gt = tl.sum(tl.where(bins > t, hist, 0), axis=0)
    m = r - n_gt  # equal-count pages to take: the latest ones
    n_out = zero
    eq_seen = zero
    nb = tl.cdiv(P, BLOCK)
    for i in range(0, nb):
        start = (nb - 1 - i) * BLOCK
        p = start + offs
        ok = p < P
        c = tl.load(cnt + p, mask=ok, other=0, cache_modifier=".cg")
        forced = ok & ((p == 0) | (p >= P - N_RECENT))
        free = ok & ~forced
        eq = free & (c == t)
        eqi = eq.to(tl.int32)
        # Equal pages at or after p within the block, plus those of later blocks.
        after = tl.sum(eqi, axis=0) - tl.cumsum(eqi, axis=0) + eqi
        take = forced | (free & (c > t)) | (eq & (eq_seen + after <= m))
        ti = take.to(tl.int32)
        pos = n_out + tl.cumsum(ti, axis=0) - 1
        tl.store(out_ptr + row.to(tl.int64) * KP + pos, p, mask=take)
        tl.store(cnt + p, tl.zeros_like(c), mask=ok)
        n_out += tl.sum(ti, axis=0)
        eq_seen += tl.sum(eqi, axis=0)


def cap_pages(head_top: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, n_pages: int,
              kp: int, n_recent: int, g: int) -> None:
    """head_top int64 [R * G, KH1] (global ids of each q head's top entries,
    rows (b, kv head, g)); counts int32 [R, P], zero (left zero); out int32
    [R, kp]."""
    rows = counts.shape[0]
    assert g <= 15, "the cap kernel's histogram has 16 bins"
    # Few wide blocks: the scans are latency-bound (a reduction per block).
    block = min(4096, max(1024, triton.next_power_of_2(n_pages)))
    _cap_kernel[(rows,)](head_top, counts, out, n_pages, head_top.shape[1], kp, n_recent, G=g,
                         BT=1024, BLOCK=block, num_warps=8)


@triton.jit
def _quest_max_kernel(q_ptr, kmin_ptr, kmax_ptr, out_ptr, H, P, NR, G: tl.constexpr,
                      D: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr):
    """Kv head h, a block of pages: the largest Quest bound over the NR = T *
    G query rows (t, g) of the head's group (q [T, H * G, D])."""
    h = tl.program_id(0)
    pb = tl.program_id(1)
    offs_d = tl.arange(0, D)
    offs_p = pb * BP + tl.arange(0, BP)
    pok = offs_p < P
    base = (h * P + offs_p).to(tl.int64) * D
    mx = tl.load(kmax_ptr + base[:, None] + offs_d[None, :], mask=pok[:, None], other=0.0)
    mn = tl.load(kmin_ptr + base[:, None] + offs_d[None, :], mask=pok[:, None], other=0.0)
    best = tl.full([BP], float("-inf"), tl.float32)
    for r0 in range(0, NR, BQ):
        offs_r = r0 + tl.arange(0, BQ)
        rok = offs_r < NR
        t = offs_r // G
        g = offs_r % G
        qrow = (t * H + h) * G + g
        q = tl.load(q_ptr + qrow[:, None].to(tl.int64) * D + offs_d[None, :], mask=rok[:, None],
                    other=0.0)
        qp = tl.maximum(q, 0.0).to(q.dtype)
        qn = tl.minimum(q, 0.0).to(q.dtype)
        s = tl.dot(qp, tl.trans(mx)) + tl.dot(qn, tl.trans(mn))
        s = tl.where(rok[:, None], s, float("-inf"))
        best = tl.maximum(best, tl.max(s, axis=0))
    tl.store(out_ptr + h * P + offs_p, best, mask=pok)


def quest_max_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                     out: torch.Tensor) -> None:
    """q [T, H*G, D]; kmin/kmax [H, P, D] (one layer); out float32 [H, P]: per
    page the largest bound over the T * G rows of its kv head."""
    t, hq, d = q.shape
    h, p, _ = kmin.shape
    g = hq // h
    bp = 64
    _quest_max_kernel[(h, triton.cdiv(p, bp))](q, kmin, kmax, out, h, p, t * g, G=g, D=d,
                                                BQ=64, BP=bp, num_warps=4)


@triton.jit
def _pool_attn_kernel(q_ptr, k_pool, v_pool, pages_ptr, slot_of_ptr, tail_k, tail_v, tail_len,
                      acc_ptr, m_ptr, l_ptr, layer, H, P, n_ctx, KP, per_split, T, scale_log2,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      PPB: tl.constexpr, BT: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    n_split = tl.num_programs(1)
    h = r % H
    b = r // H
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (r * G + offs_g[:, None]) * D + offs_d[None, :],
                mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if s < n_split - 1:
        BN: tl.constexpr = PAGE * PPB
        offs_n = tl.arange(0, BN)
        p_begin = s * per_split
        p_end = tl.minimum(p_begin + per_split, KP)
        for p0 in range(p_begin, p_end, PPB):
            idx = p0 + offs_n // PAGE
            ok = idx < p_end
            page = tl.load(pages_ptr + r * KP + idx, mask=ok, other=0)
            ok = ok & (page * PAGE + offs_n % PAGE < n_ctx)
            unit = (layer * H + h).to(tl.int64) * P + page
            slot = tl.load(slot_of_ptr + unit, mask=ok, other=0)
            tok = slot.to(tl.int64) * PAGE + offs_n % PAGE
            m_i, l_i, acc = attend_rows(q, k_pool, v_pool, tok, ok, offs_d, m_i, l_i, acc,
                                        scale_log2, D)
    else:
        n_t = tl.load(tail_len + b)
        offs_t = tl.arange(0, BT)
        base = (b * H + h).to(tl.int64) * T
        for t0 in range(0, n_t, BT):
            j = t0 + offs_t
            m_i, l_i, acc = attend_rows(q, tail_k, tail_v, base + j, j < n_t, offs_d, m_i, l_i,
                                        acc, scale_log2, D)
    out = (r * n_split + s) * G
    gmask = offs_g < G
    tl.store(acc_ptr + (out + offs_g[:, None]) * D + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(m_ptr + out + offs_g, m_i, mask=gmask)
    tl.store(l_ptr + out + offs_g, l_i, mask=gmask)


class PoolAttention:
    """Attention of each row's G q heads over its pages, read in place from the
    pool through ``slot_of``, plus the row's sequence's own tokens. Buffers
    are allocated once: calls allocate nothing (CUDA-graph safe); one call at
    a time per instance."""

    def __init__(self, rows: int, group: int, head_dim: int, kp: int, device, dtype,
                 page: int = 16, programs_per_sm: int = 2, pages_per_block: int = 4):
        self.rows, self.g, self.d, self.kp, self.page = rows, group, head_dim, kp, page
        sm = _k._sm_count(torch.device(device))
        self.ppb = pages_per_block if kp >= pages_per_block else 1
        want = max(1, (programs_per_sm * sm + rows - 1) // rows)
        splits = max(1, min(want, (kp + self.ppb - 1) // self.ppb))
        per = (kp + splits - 1) // splits
        self.per_split = ((per + self.ppb - 1) // self.ppb) * self.ppb
        self.splits = (kp + self.per_split - 1) // self.per_split + 1  # + the own tokens
        self.acc = torch.empty(rows, self.splits, group, head_dim, device=device,
                               dtype=torch.float32)
        self.m = torch.empty(rows, self.splits, group, device=device, dtype=torch.float32)
        self.l = torch.empty_like(self.m)
        self.out = torch.empty(rows, group, head_dim, device=device, dtype=dtype)
        self.scale_log2 = (1.0 / math.sqrt(head_dim)) * math.log2(math.e)

    def __call__(self, q, k_pool, v_pool, pages, slot_of, layer: int, n_kv_heads: int,
                 n_pages: int, n_ctx: int, tail_k, tail_v, tail_len) -> torch.Tensor:
        gp = max(16, triton.next_power_of_2(self.g))
        _pool_attn_kernel[(self.rows, self.splits)](
            q, k_pool, v_pool, pages, slot_of, tail_k, tail_v, tail_len, self.acc, self.m,
            self.l, layer, n_kv_heads, n_pages, n_ctx, self.kp, self.per_split,
            tail_k.shape[2], self.scale_log2, G=self.g, GP=gp, D=self.d, PAGE=self.page,
            PPB=self.ppb, BT=16, num_warps=4)
        _k._combine_kernel[(self.rows, self.g)](
            self.acc, self.m, self.l, self.out, self.splits, G=self.g, D=self.d,
            SP=max(2, triton.next_power_of_2(self.splits)), num_warps=4, GDC=False,
            launch_pdl=False)
        return self.out


@triton.jit
def _tail_merge_kernel(q_ptr, tail_k, tail_v, tail_len, o_ctx, lse_ctx, out_ptr, H, T,
                       s_ob, s_oh, s_og, s_lb, s_lh, s_lg, scale_log2, G: tl.constexpr,
                       GP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    r = tl.program_id(0)  # b * H + h
    h = r % H
    b = r // H
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    q = tl.load(q_ptr + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=gmask[:, None],
                other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n_t = tl.load(tail_len + b)
    offs_t = tl.arange(0, BT)
    base = r.to(tl.int64) * T
    for t0 in range(0, n_t, BT):
        j = t0 + offs_t
        m_i, l_i, acc = attend_rows(q, tail_k, tail_v, base + j, j < n_t, offs_d, m_i, l_i, acc,
                                    scale_log2, D)
    # The context part: normalized output and natural-log LSE, as one state
    # of the online softmax (base 2: m = lse * log2(e), l = 1).
    oc = tl.load(o_ctx + b * s_ob + h * s_oh + offs_g[:, None] * s_og + offs_d[None, :],
                 mask=gmask[:, None], other=0.0).to(tl.float32)
    mc = tl.load(lse_ctx + b * s_lb + h * s_lh + offs_g * s_lg, mask=gmask,
                 other=0.0) * 1.4426950408889634
    m = tl.maximum(m_i, mc)
    a = tl.exp2(m_i - m)
    c = tl.exp2(mc - m)
    o = (acc * a[:, None] + oc * c[:, None]) / (l_i * a + c)[:, None]
    tl.store(out_ptr + (r * G + offs_g[:, None]) * D + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def tail_merge(q: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
               tail_len: torch.Tensor, o_ctx: torch.Tensor, lse_ctx: torch.Tensor) -> torch.Tensor:
    """Each sequence's attention over its own tokens merged by log-sum-exp with
    the context part, in one kernel. q [B, Hq, d] contiguous; tail_k/v
    [B, H, T, d] contiguous, the first tail_len[b] valid; o_ctx [B, H, G, d]
    (any strides, last dim contiguous) normalized over the context, lse_ctx
    [B, H, G] its natural-log normalizer (float32). Returns [B, Hq, d] in
    q's dtype."""
    b, hq, d = q.shape
    h, t = tail_k.shape[1], tail_k.shape[2]
    g = hq // h
    if o_ctx.stride(-1) != 1:
        o_ctx = o_ctx.contiguous()
    tail_k, tail_v = tail_k.contiguous(), tail_v.contiguous()
    out = torch.empty_like(q)
    _tail_merge_kernel[(b * h,)](
        q, tail_k, tail_v, tail_len, o_ctx, lse_ctx, out, h, t, o_ctx.stride(0),
        o_ctx.stride(1), o_ctx.stride(2), lse_ctx.stride(0), lse_ctx.stride(1),
        lse_ctx.stride(2), (1.0 / math.sqrt(d)) * math.log2(math.e), G=g,
        GP=max(16, triton.next_power_of_2(g)), D=d, BT=16, num_warps=4)
    return out


# ------------------------------------------------------- a layer's elementwise --
# The Llama layer's elementwise steps of a bfloat16 model, each one kernel,
# rounding to bfloat16 where transformers' modules do (so the fused step
# decodes the module step's tokens): the residual add and RMSNorm
# (LlamaRMSNorm: float32 statistics, the normalized row rounded, then times
# the weight), RoPE on q and k (x * cos + rotate_half(x) * sin, each product
# rounded), and the gated MLP's silu(gate) * up. The torch reference of each
# is llama._module_rows, the step over the model's own modules.

@triton.jit
def _bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), as float32.
    Integer ops, so the compiler keeps the rounding (a cast to bfloat16 and
    back may be folded away)."""
    u = x.to(tl.uint32, bitcast=True)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, xo_ptr, y_ptr, N, inv_n, eps,
                        ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    xf = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(r_ptr + row * N + offs, mask=m, other=0.0)
        xf = _bf16(xf + r.to(tl.float32))
        tl.store(xo_ptr + row * N + offs, xf.to(tl.bfloat16), mask=m)
    var = tl.sum(xf * xf, axis=0) * inv_n
    h = _bf16(xf * libdevice.rsqrt(var + eps))
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (w * h).to(tl.bfloat16), mask=m)


def add_rmsnorm(x: torch.Tensor, res, weight: torch.Tensor, eps: float):
    """(x + res, rmsnorm(x + res) * weight), or (x, rmsnorm(x) * weight) when
    res is None. x, res [R, N] contiguous bfloat16, weight [N] bfloat16."""
    r, n = x.shape
    y = torch.empty_like(x)
    xo = x if res is None else torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(r,)](x, x if res is None else res, weight, xo, y, n, 1.0 / n, eps,
                              ADD=res is not None, BLOCK=block,
                              num_warps=min(16, max(1, block // 512)))
    return xo, y


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, H,
                 D: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.arange(0, D)
    if head < HQ:
        src = q_ptr + (row * HQ + head) * D
        dst = qo_ptr + (row * HQ + head) * D
    else:
        src = k_ptr + (row * H + head - HQ) * D
        dst = ko_ptr + (row * H + head - HQ) * D
    c = tl.load(cos_ptr + row * D + j).to(tl.float32)
    s = tl.load(sin_ptr + row * D + j).to(tl.float32)
    x = tl.load(src + j).to(tl.float32)
    xr = tl.load(src + (j + HALF) % D).to(tl.float32)
    xr = tl.where(j < HALF, -xr, xr)
    tl.store(dst + j, (_bf16(x * c) + _bf16(xr * s)).to(tl.bfloat16))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         hq: int, h: int, d: int):
    """RoPE of q [R, hq * d] and k [R, h * d] (contiguous bfloat16) by cos,
    sin [R, d] (contiguous bfloat16; d a power of two). Returns q [R, hq, d]
    and k [R, h, d], new tensors."""
    r = q.shape[0]
    qo = torch.empty(r, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(r, h, d, dtype=k.dtype, device=k.device)
    _rope_kernel[(r, hq + h)](q, k, cos, sin, qo, ko, hq, h, D=d, HALF=d // 2,
                              num_warps=1 if d <= 128 else 2)
    return qo, ko


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    s = _bf16(libdevice.div_rn(g, 1.0 + libdevice.exp(-g)))
    tl.store(y_ptr + row * N + offs, (s * u).to(tl.bfloat16), mask=m)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u [R, N] contiguous bfloat16, rounded as torch
    rounds them."""
    r, n = g.shape
    y = torch.empty_like(g)
    block = 1024
    _silu_mul_kernel[(r, triton.cdiv(n, block))](g, u, y, n, BLOCK=block, num_warps=4)
    return y
