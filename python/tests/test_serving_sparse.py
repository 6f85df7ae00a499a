"""The serving backend's sparse attention over stored prefixes in a paged
cache (ctxcache.serving.sparse), on the CPU: with every page kept it is
dense causal attention over each request's whole read set; with a budget it
is dense attention over exactly the pages the engine's block-union table
picks, plus the request's own tokens; the new tokens land at write_index.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from ctxcache.engine.planner import (chunk_pages, decode_pages, quest_bounds,  # noqa: E402
                                     warm_decode_pages)
from ctxcache.serving.sparse import (PAGE_TOKENS, ForwardPlan, PrefixIndex,  # noqa: E402
                                     RequestSpan, block_table_rows, masked_attention,
                                     paged_sparse_attention)

H, G, D = 2, 2, 16
HQ = H * G
BLOCK = 32           # the paged cache's block: two index pages
N_SLOTS = 64 * BLOCK


def paged_cache(gen):
    """Random K and V caches of N_SLOTS rows, and ``rows(n)``: the rows of n
    tokens in blocks taken at random (each block once)."""
    k_cache = torch.randn(N_SLOTS, H, D, generator=gen)
    v_cache = torch.randn(N_SLOTS, H, D, generator=gen)
    blocks = torch.randperm(N_SLOTS // BLOCK, generator=gen).tolist()

    def rows(n: int) -> list:
        out = []
        while len(out) < n:
            b = blocks.pop()
            out.extend(range(b * BLOCK, b * BLOCK + BLOCK))
        return out[:n]
    return k_cache, v_cache, rows


class Batch:
    """A paged cache holding one stored prefix in scattered blocks, and two
    requests: A reads the prefix, then its own earlier tokens, then a chunk
    of new tokens; B has no prefix: earlier tokens and one new token."""

    def __init__(self, prefix_tokens: int, own_a: int, new_a: int, own_b: int,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.k_cache, self.v_cache, rows = paged_cache(gen)
        self.c = prefix_tokens
        a_rows = rows(prefix_tokens) + rows(own_a + new_a)   # prefix blocks, then its own
        b_rows = rows(own_b + 1)
        self.read = torch.tensor(a_rows + b_rows)
        self.write = torch.tensor(a_rows[-new_a:] + b_rows[-1:])
        self.a_past, self.b_past = prefix_tokens + own_a, own_b
        self.q = torch.randn(1, HQ, new_a + 1, D, generator=gen)
        self.k = torch.randn(1, H, new_a + 1, D, generator=gen)
        self.v = torch.randn(1, H, new_a + 1, D, generator=gen)
        self.new_a = new_a
        # The prefix's keys as the stored context holds them: [L=1, H, n, d]
        self.prefix_k = self.k_cache[torch.tensor(a_rows[:prefix_tokens])].permute(1, 0, 2)
        self.prefix_k = self.prefix_k.unsqueeze(0).contiguous()

    def spans(self, prefix):
        na = self.a_past + self.new_a
        return [RequestSpan(0, self.new_a, 0, na, prefix),
                RequestSpan(self.new_a, self.new_a + 1, na, self.b_past + 1, None)]


def reference(batch: Batch, keep_a=None) -> torch.Tensor:
    """Plain causal attention per request over its read rows after the
    write; ``keep_a`` [H, n_prefix] bool drops request A's prefix tokens."""
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    kc[batch.write] = batch.k[0].transpose(0, 1)
    vc[batch.write] = batch.v[0].transpose(0, 1)
    out = torch.zeros(1, batch.q.shape[2], HQ, D)
    na = batch.a_past + batch.new_a
    for q0, q1, rows, past in ((0, batch.new_a, batch.read[:na], batch.a_past),
                               (batch.new_a, batch.new_a + 1, batch.read[na:], batch.b_past)):
        k, v = kc[rows], vc[rows]                                     # [n, H, d]
        for j in range(q1 - q0):
            for hq in range(HQ):
                h = hq // G
                vis = torch.zeros(len(rows), dtype=torch.bool)
                vis[:past + j + 1] = True
                if keep_a is not None and q0 == 0:
                    vis[:batch.c] &= keep_a[h]
                s = (k[vis, h] @ batch.q[0, hq, q0 + j]) / math.sqrt(D)
                out[0, q0 + j, hq] = torch.softmax(s, 0) @ v[vis, h]
    return out


def test_every_page_kept_is_dense_causal_attention() -> None:
    b = Batch(prefix_tokens=5 * PAGE_TOKENS + 7, own_a=9, new_a=4, own_b=13)
    prefix = PrefixIndex(b.prefix_k, b.c, torch.device("cpu"), torch.float32, rho=1.0,
                         min_tokens=0, recent_pages=1)
    want = reference(b)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = paged_sparse_attention(b.q, b.k, b.v, kc, vc, b.read, b.write, b.spans(prefix),
                                 layer=0)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # The new tokens were written where the engine reads them next.
    assert torch.equal(kc[b.write], b.k[0].transpose(0, 1))
    assert torch.equal(vc[b.write], b.v[0].transpose(0, 1))
    # Without a prefix index request A attends its whole read set densely.
    kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
    dense = paged_sparse_attention(b.q, b.k, b.v, kc2, vc2, b.read, b.write, b.spans(None), 0)
    assert torch.allclose(dense, want, atol=1e-5)


def test_a_budget_attends_exactly_the_block_union_pages() -> None:
    b = Batch(prefix_tokens=40 * PAGE_TOKENS, own_a=6, new_a=3, own_b=20, seed=3)
    prefix = PrefixIndex(b.prefix_k, b.c, torch.device("cpu"), torch.float32, rho=0.05,
                         min_tokens=0, recent_pages=1, prefill_rho=0.1)
    # a real budget: 4 + page 0 + 2 recent of 40 for a chunk (2 + 3 a step)
    assert (prefix.kp_prefill, prefix.kp) == (7, 5)
    q_a = b.q[0, :, :b.new_a].transpose(0, 1)                          # [T, Hq, d]
    pages = chunk_pages(q_a, prefix.kmin[0], prefix.kmax[0], prefix.kp_prefill,
                        prefix.n_recent)
    keep = torch.zeros(H, b.c, dtype=torch.bool)
    for h in range(H):
        for p in pages[h].tolist():
            keep[h, p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS] = True
    assert bool(keep[:, :PAGE_TOKENS].all()) and bool(keep[:, -PAGE_TOKENS:].all())
    want = reference(b, keep_a=keep)
    got = paged_sparse_attention(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.read,
                                 b.write, b.spans(prefix), layer=0)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # ... and differs from dense attention (the budget dropped pages).
    assert not torch.allclose(got, reference(b), atol=1e-3)
    # By default (prefill_rho 1) a chunk of several tokens attends the whole
    # prefix; a one-token step still reads its budget.
    dense_prefill = PrefixIndex(b.prefix_k, b.c, torch.device("cpu"), torch.float32, rho=0.05,
                                min_tokens=0, recent_pages=1)
    got = paged_sparse_attention(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.read,
                                 b.write, b.spans(dense_prefill), layer=0)
    assert torch.allclose(got, reference(b), atol=1e-5)
    one = Batch(prefix_tokens=40 * PAGE_TOKENS, own_a=6, new_a=1, own_b=20, seed=4)
    got = paged_sparse_attention(one.q, one.k, one.v, one.k_cache.clone(), one.v_cache.clone(),
                                 one.read, one.write, one.spans(dense_prefill), layer=0)
    assert not torch.allclose(got[0, :1], reference(one)[0, :1], atol=1e-3)


def test_prefix_index_bounds_and_budget() -> None:
    k = torch.randn(2, H, 100, D)
    p = PrefixIndex(k, 70, torch.device("cpu"), torch.bfloat16, rho=0.05, min_tokens=32,
                    recent_pages=1)
    assert p.n_pages == 5 and p.kmin.shape == (2, H, 5, D)
    kb = torch.nn.functional.pad(k[:, :, :70].to(torch.bfloat16), (0, 0, 0, 10))
    mn, mx = quest_bounds(kb, 70, PAGE_TOKENS)
    assert torch.equal(p.kmin, mn) and torch.equal(p.kmax, mx)
    # budget: max(ceil(0.05 * 5), 32 / 16) = 2 pages, plus page 0 and 2 recent
    assert (p.n_recent, p.kp) == (2, 5)
    assert p.nbytes == 2 * 2 * H * 5 * D * 2
    with pytest.raises(ValueError, match="rho"):
        PrefixIndex(k, 70, torch.device("cpu"), torch.float32, rho=0.0, min_tokens=0,
                    recent_pages=1)
    with pytest.raises(ValueError, match="n_tokens"):
        PrefixIndex(k, 101, torch.device("cpu"), torch.float32, rho=0.1, min_tokens=0,
                    recent_pages=1)


def test_a_span_past_the_packed_tensors_is_refused() -> None:
    b = Batch(prefix_tokens=2 * PAGE_TOKENS, own_a=1, new_a=2, own_b=1)
    bad = [RequestSpan(0, 2, 0, b.read.numel() + 5, None)]
    with pytest.raises(ValueError, match="does not fit"):
        paged_sparse_attention(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.read,
                               b.write, bad, layer=0)


def test_block_table_rows_are_the_read_index_the_engine_would_build() -> None:
    bs = 4
    table = torch.tensor([[7, 2, 9, -1], [3, -1, -1, -1], [5, 6, -1, -1]], dtype=torch.int32)
    lens = [10, 3, 0]                      # the third: a padding sequence
    cu = [0, 10, 13, 13]
    read, write = block_table_rows(table, [0, 1, 2, 2], cu, bs)
    want = []
    for b, n in enumerate(lens):
        want += [int(table[b, p // bs]) * bs + p % bs for p in range(n)]
    assert read.tolist() == want
    assert write.tolist() == [want[9], want[12]]
    # a chunk of new tokens (a prompt read through the table): its last 4
    read, write = block_table_rows(table, [0, 4, 5, 5], cu, bs)
    assert read.tolist() == want and write.tolist() == want[6:10] + [want[12]]
    with pytest.raises(ValueError, match="exceed key lengths"):
        block_table_rows(table, [0, 11, 12, 12], cu, bs)


class DecodeBatch:
    """A decode forward as the serving engine packs it: several requests of
    one new token each, in a paged cache whose prefix blocks are shared by
    the requests that read the same stored prefix. ``plan``: per request,
    (prefix number or None, own earlier tokens)."""

    def __init__(self, prefix_tokens, plan, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.k_cache, self.v_cache, rows = paged_cache(gen)
        prefix_rows = [rows(n) for n in prefix_tokens]
        self.prefixes = []
        for pr in prefix_rows:
            k = self.k_cache[torch.tensor(pr)].permute(1, 0, 2).unsqueeze(0).contiguous()
            self.prefixes.append(PrefixIndex(k, len(pr), torch.device("cpu"), torch.float32,
                                             rho=0.05, min_tokens=0, recent_pages=1))
        read, write, self.spans, self.reads = [], [], [], []
        for i, (which, own) in enumerate(plan):
            r = (prefix_rows[which] if which is not None else []) + rows(own + 1)
            self.spans.append(RequestSpan(i, i + 1, len(read), len(r),
                                          None if which is None else self.prefixes[which]))
            self.reads.append((which, r))
            read += r
            write.append(r[-1])
        self.read, self.write = torch.tensor(read), torch.tensor(write)
        n = len(plan)
        self.q = torch.randn(1, HQ, n, D, generator=gen)
        self.k = torch.randn(1, H, n, D, generator=gen)
        self.v = torch.randn(1, H, n, D, generator=gen)

    def reference(self) -> torch.Tensor:
        """Each request: softmax over its block-union pages of its prefix
        (chunk_pages of its one query) and all its own tokens."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        kc[self.write] = self.k[0].transpose(0, 1)
        vc[self.write] = self.v[0].transpose(0, 1)
        out = torch.zeros(1, len(self.reads), HQ, D)
        for i, (which, r) in enumerate(self.reads):
            rows = torch.tensor(r)
            keep = torch.ones(H, len(r), dtype=torch.bool)
            if which is not None:
                p = self.prefixes[which]
                pages = chunk_pages(self.q[0, :, i:i + 1].transpose(0, 1), p.kmin[0], p.kmax[0],
                                    p.kp, p.n_recent)
                keep[:, :p.n_tokens] = False
                for h in range(H):
                    for pg in pages[h].tolist():
                        keep[h, pg * PAGE_TOKENS:min(p.n_tokens, (pg + 1) * PAGE_TOKENS)] = True
            for hq in range(HQ):
                h = hq // G
                s = (kc[rows[keep[h]], h] @ self.q[0, hq, i]) / math.sqrt(D)
                out[0, i, hq] = torch.softmax(s, 0) @ vc[rows[keep[h]], h]
        return out


def test_a_decode_batch_is_one_call_per_prefix_with_each_requests_own_pages() -> None:
    # two prefixes (one ending mid-page), requests of both with own tokens
    # of many lengths, and one request with no prefix
    plan = [(0, 0), (1, 5), (0, 17), (None, 9), (0, 3), (1, 40)]
    b = DecodeBatch([40 * PAGE_TOKENS, 25 * PAGE_TOKENS + 9], plan, seed=5)
    fp = ForwardPlan(b.spans, len(plan), b.read.numel(), torch.device("cpu"))
    assert len(fp.groups) == 3 and not fp.chunks and fp.decode_requests == len(plan)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = paged_sparse_attention(b.q, b.k, b.v, kc, vc, b.read, b.write, fp, layer=0)
    want = b.reference()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.equal(kc[b.write], b.k[0].transpose(0, 1))
    # The budget dropped pages: not dense attention over the read set.
    dense = DecodeBatch([40 * PAGE_TOKENS, 25 * PAGE_TOKENS + 9], plan, seed=5)
    dense.spans = [RequestSpan(s.q0, s.q1, s.k0, s.n_k, None) for s in dense.spans]
    assert not torch.allclose(got, paged_sparse_attention(
        dense.q, dense.k, dense.v, dense.k_cache.clone(), dense.v_cache.clone(), dense.read,
        dense.write, dense.spans, layer=0), atol=1e-3)
    # A request with more own keys than max_batched_own is attended alone:
    # the same result.
    alone = ForwardPlan(b.spans, len(plan), b.read.numel(), torch.device("cpu"),
                        max_batched_own=20)
    assert len(alone.chunks) == 1 and alone.decode_requests == len(plan) - 1
    got_alone = paged_sparse_attention(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(),
                                       b.read, b.write, alone, layer=0)
    assert torch.allclose(got_alone, want, atol=1e-5), (got_alone - want).abs().max()
    # A group larger than the gather bound is attended in slices: the same.
    from ctxcache.serving import sparse
    bound, sparse.MAX_GATHER_BYTES = sparse.MAX_GATHER_BYTES, 1
    try:
        sliced = paged_sparse_attention(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(),
                                        b.read, b.write, fp, layer=0)
    finally:
        sparse.MAX_GATHER_BYTES = bound
    assert torch.allclose(sliced, want, atol=1e-5), (sliced - want).abs().max()
    # A plan made for other packed tensors is refused.
    with pytest.raises(ValueError, match="forward plan for 6 queries"):
        paged_sparse_attention(b.q, b.k, b.v, kc, vc, b.read[:-1], b.write, fp, layer=0)


def test_decode_pages_are_each_rows_chunk_pages() -> None:
    gen = torch.Generator().manual_seed(2)
    kmin = torch.randn(3, H, 50, D, generator=gen)
    kmax = kmin + torch.rand(3, H, 50, D, generator=gen)
    q = torch.randn(7, HQ, D, generator=gen)
    got = decode_pages(q, kmin, kmax, 2, 9, 2)
    assert got.shape == (7, H, 9)
    for i in range(7):
        want = chunk_pages(q[i:i + 1], kmin[2], kmax[2], 9, 2)
        assert torch.equal(torch.sort(got[i], 1).values, torch.sort(want, 1).values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_decode_path_matches_the_cpu_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    # decode_pages: the Triton bounds and top-k pick the CPU's pages (bf16
    # operands, fp32 sums; random data has no ties)
    kmin = torch.randn(2, 2, 300, 64, generator=gen).to(torch.bfloat16)
    kmax = (kmin.float() + torch.rand(2, 2, 300, 64, generator=gen)).to(torch.bfloat16)
    q = torch.randn(13, 8, 64, generator=gen).to(torch.bfloat16)   # padded to 16 rows
    cpu = decode_pages(q, kmin, kmax, 1, 20, 2)
    gpu = decode_pages(q.cuda(), kmin.cuda(), kmax.cuda(), 1, 20, 2).cpu()
    assert gpu.shape == (13, 2, 20)
    assert torch.equal(torch.sort(cpu, 2).values, torch.sort(gpu, 2).values)
    # the warmup runs each padded batch shape once: 1, 2, 4, 8, 16
    assert warm_decode_pages("cuda", torch.bfloat16, 8, 2, 64, 300, 20, 2, 16) == 5
    assert warm_decode_pages("cpu", torch.bfloat16, 8, 2, 64, 300, 20, 2, 16) == 0
    # masked_attention: SDPA with a boolean mask in bf16 vs fp32
    qa = torch.randn(5, 2, 4, 64, generator=gen)
    ka = torch.randn(5, 2, 96, 64, generator=gen)
    va = torch.randn(5, 2, 96, 64, generator=gen)
    keep = torch.rand(5, 2, 96, generator=gen) < 0.3
    keep[..., 0] = True
    want = masked_attention(qa, ka, va, keep, 0.125)
    got = masked_attention(qa.cuda().bfloat16(), ka.cuda().bfloat16(), va.cuda().bfloat16(),
                           keep.cuda(), 0.125)
    err = (got.float().cpu() - want).abs().max()
    assert err < 3e-2, err
