"""ctxcache.torch.kernels (Triton) against torch references. GPU only: skipped
where there is no CUDA device or no triton (Debian CI); run on the GPU
machine by scripts/gpu-suite.sh."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from ctxcache.torch import kernels  # noqa: E402

DEV = "cuda"


def reference_top_pages(scores: torch.Tensor, k: int, n_recent: int, key_bits: int):
    """Global ids of each row's k best pages, ties by lower page, as sets."""
    rows, p = scores.shape
    x = scores.clone()
    x[:, 0] = float("inf")
    if n_recent:
        x[:, p - n_recent:] = float("inf")
    bits = x.view(torch.int32).to(torch.int64)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) + 2**31
    key = key >> (32 - key_bits)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    base = torch.arange(rows, device=scores.device).view(rows, 1) * p
    return [set(r.tolist()) for r in (order + base)]


def score_cases(rows: int, p: int):
    g = torch.Generator(device=DEV).manual_seed(rows * 7919 + p)
    yield "uniform", torch.rand(rows, p, device=DEV, generator=g)
    yield "signed", torch.randn(rows, p, device=DEV, generator=g)
    # Most pages never scored (exact zeros): the k-th key is a huge tie.
    sparse = torch.rand(rows, p, device=DEV, generator=g)
    sparse[torch.rand(rows, p, device=DEV, generator=g) < 0.97] = 0.0
    yield "mostly_zero", sparse
    # Few distinct values: ties everywhere, decided by page order.
    yield "coarse", torch.randint(0, 5, (rows, p), device=DEV, generator=g).float()
    yield "all_equal", torch.ones(rows, p, device=DEV)


@pytest.mark.parametrize("rows,p,k", [(8, 8192, 413), (2, 20000, 1001), (64, 4096, 200),
                                      (3, 300, 300), (1, 1000, 1)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("algo", ["split", "radix", "search"])
def test_top_pages_are_the_reference_top_k_with_ties_by_page(rows, p, k, exact, algo) -> None:
    out = torch.empty(rows, k, dtype=torch.int64, device=DEV)
    for name, scores in score_cases(rows, p):
        n_recent = min(2, k - 1)
        want = reference_top_pages(scores, k, n_recent, 32 if exact else 16)
        x = scores.clone()
        got = kernels.select_top_pages(x, k, n_recent=n_recent, reset=True, out=out, exact=exact,
                                       algo=algo)
        assert [set(r.tolist()) for r in got] == want, name
        assert torch.count_nonzero(x) == 0, "reset leaves the bins zeroed"


@pytest.mark.parametrize("rows,p,k", [(8, 8192, 413), (2, 20000, 1001), (3, 300, 300)])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("algo", ["split", "radix"])
@pytest.mark.parametrize("radix_bits", [5, 6, 7])
def test_every_radix_digit_width_picks_the_reference_pages(rows, p, k, exact, algo,
                                                           radix_bits) -> None:
    out = torch.empty(rows, k, dtype=torch.int64, device=DEV)
    for name, scores in score_cases(rows, p):
        want = reference_top_pages(scores, k, 2, 32 if exact else 16)
        got = kernels.select_top_pages(scores.clone(), k, n_recent=2, out=out, exact=exact,
                                       algo=algo, radix_bits=radix_bits)
        assert [set(r.tolist()) for r in got] == want, name


def test_dependent_launch_auto_is_on_only_up_to_pdl_auto_rows() -> None:
    saved = kernels.PDL
    capable = torch.cuda.get_device_capability()[0] >= 9
    try:
        kernels.PDL = "auto"
        assert kernels._pdl(DEV, kernels.PDL_AUTO_ROWS) == capable
        assert not kernels._pdl(DEV, kernels.PDL_AUTO_ROWS + 1)
        kernels.PDL = "1"
        assert kernels._pdl(DEV, 10 * kernels.PDL_AUTO_ROWS) == capable
        kernels.PDL = "0"
        assert not kernels._pdl(DEV, 1)
    finally:
        kernels.PDL = saved


def test_an_unknown_dependent_launch_setting_is_refused() -> None:
    saved = kernels.PDL
    try:
        kernels.PDL = "yes"
        with pytest.raises(ValueError, match="CTXCACHE_PDL"):
            kernels.select_top_pages(torch.rand(1, 64, device=DEV), 4)
    finally:
        kernels.PDL = saved


def test_top_pages_rejects_a_radix_digit_width_out_of_range() -> None:
    with pytest.raises(ValueError, match="radix_bits"):
        kernels.select_top_pages(torch.rand(1, 64, device=DEV), 4, algo="radix", radix_bits=4)


@pytest.mark.parametrize("algo", ["split", "radix", "search"])
def test_top_pages_is_graph_capturable(algo) -> None:
    rows, p, k = 8, 8192, 413
    static = torch.rand(rows, p, device=DEV)
    out = torch.empty(rows, k, dtype=torch.int64, device=DEV)
    kernels.select_top_pages(static.clone(), k, out=out, algo=algo)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.select_top_pages(static, k, out=out, algo=algo)
    for seed in range(3):
        fresh = torch.rand(rows, p, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert [set(r.tolist()) for r in out] == reference_top_pages(fresh, k, 0, 32)


def test_top_pages_rejects_an_unknown_algo() -> None:
    with pytest.raises(ValueError, match="algo"):
        kernels.select_top_pages(torch.rand(1, 64, device=DEV), 4, algo="bitonic")


PAGE, GROUP, HEAD_DIM = 16, 4, 128


def paged_inputs(seed: int, rows: int, p: int, kp: int):
    """A bf16 page pool of rows x p pages (k, v [rows*p*PAGE, HEAD_DIM]),
    queries [rows, GROUP, HEAD_DIM] and kp distinct pages per row (global ids)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(rows * p * PAGE, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(rows * p * PAGE, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=g)
    q = torch.randn(rows, GROUP, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=g)
    pages = torch.stack([torch.randperm(p, device=DEV, generator=g)[:kp] + r * p
                         for r in range(rows)])
    return q, k, v, pages


def gathered_attention(q, k, v, pages):
    """fp32 softmax attention of each row's queries over its pages' tokens."""
    rows, kp = pages.shape
    tok = (pages.view(rows, kp, 1) * PAGE + torch.arange(PAGE, device=DEV)).view(rows, -1)
    ks, vs = k[tok].float(), v[tok].float()  # [rows, kp*PAGE, d]
    w = torch.softmax(q.float() @ ks.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ vs


def test_paged_attention_equals_sdpa_over_the_gathered_pages() -> None:
    q, k, v, pages = paged_inputs(3, rows=4, p=512, kp=37)
    attn = kernels.PagedDecodeAttention(4, GROUP, HEAD_DIM, 37, DEV, torch.bfloat16)
    torch.testing.assert_close(attn(q, k, v, pages).float(), gathered_attention(q, k, v, pages),
                               rtol=2e-2, atol=2e-2)


def test_csa_score_pages_equals_the_torch_score_add() -> None:
    g = torch.Generator(device=DEV).manual_seed(5)
    rows, group, d, m, c, p, lst = 4, 4, 128, 8, 64, 256, 700
    ds = d // m
    q = torch.randn(rows, group, d, device=DEV, dtype=torch.bfloat16, generator=g)
    cent = torch.nn.functional.normalize(
        torch.randn(rows, m, c, ds, device=DEV, generator=g), dim=-1).to(torch.bfloat16)
    ids = (torch.randint(0, p, (rows, m, c, lst), device=DEV, generator=g) +
           (torch.arange(rows, device=DEV) * p).view(rows, 1, 1, 1)).view(rows * m * c, lst)
    sc = torch.randn(rows * m * c, lst, device=DEV, dtype=torch.float16, generator=g)
    bins = torch.zeros(rows * p, device=DEV)
    kernels.csa_score_pages(q, cent, ids.to(torch.int32), sc, bins)
    qs = q.float().mean(dim=1).view(rows, m, ds)
    w = qs.norm(dim=-1)
    j = torch.einsum("rmd,rmcd->rmc", qs, cent.float()).argmax(dim=-1)
    lid = ((torch.arange(rows, device=DEV).view(rows, 1) * m +
            torch.arange(m, device=DEV).view(1, m)) * c + j).view(-1)
    want = torch.zeros(rows * p, device=DEV)
    want.scatter_add_(0, ids[lid].view(-1), (sc[lid].float() * w.view(-1, 1)).view(-1))
    torch.testing.assert_close(bins, want, rtol=1e-4, atol=1e-3)


def test_csa_score_pages_into_token_bins_per_q_head() -> None:
    # Each q head its own row (no pooling), its kv head's centroids and lists
    # (list_div), token ids binned per row (bin_stride): the per-q-head
    # estimates the softmax page ranking needs.
    g = torch.Generator(device=DEV).manual_seed(6)
    rows, group, d, m, c, n, lst = 2, 4, 128, 8, 64, 1024, 300
    ds = d // m
    q = torch.randn(rows * group, 1, d, device=DEV, dtype=torch.bfloat16, generator=g)
    cent = torch.nn.functional.normalize(
        torch.randn(rows, m, c, ds, device=DEV, generator=g), dim=-1).to(torch.bfloat16)
    ids = torch.randint(0, n, (rows * m * c, lst), device=DEV, generator=g)
    sc = torch.randn(rows * m * c, lst, device=DEV, dtype=torch.float16, generator=g)
    bins = torch.zeros(rows * group * n, device=DEV)
    kernels.csa_score_pages(q, cent, ids.to(torch.int32), sc, bins, list_div=group,
                            bin_stride=n)
    qs = q.float().view(rows * group, m, ds)
    w = qs.norm(dim=-1)
    kv = torch.arange(rows * group, device=DEV) // group
    j = torch.einsum("rmd,rmcd->rmc", qs, cent.float()[kv]).argmax(dim=-1)
    lid = ((kv.view(-1, 1) * m + torch.arange(m, device=DEV).view(1, m)) * c + j).view(-1)
    want = torch.zeros(rows * group, n, device=DEV)
    want.scatter_add_(1, ids[lid].view(rows * group, -1),
                      (sc[lid].float() * w.view(-1, 1)).view(rows * group, -1))
    torch.testing.assert_close(bins.view(rows * group, n), want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="list_div"):
        kernels.csa_score_pages(q, cent, ids.to(torch.int32), sc, bins, list_div=3,
                                bin_stride=n)


@pytest.mark.parametrize("programs_per_sm,pages_per_block", [(1, 4), (4, 2), (8, 1)])
def test_paged_attention_split_geometry_does_not_change_the_result(programs_per_sm,
                                                                    pages_per_block) -> None:
    rows, kp = 8, 413
    q, k, v, pages = paged_inputs(4, rows=rows, p=2048, kp=kp)
    want = kernels.PagedDecodeAttention(rows, GROUP, HEAD_DIM, kp, DEV, torch.bfloat16)(
        q, k, v, pages).float().clone()
    got = kernels.PagedDecodeAttention(rows, GROUP, HEAD_DIM, kp, DEV, torch.bfloat16,
                                       programs_per_sm=programs_per_sm,
                                       pages_per_block=pages_per_block)(q, k, v, pages).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows,kp", [(8, 413), (2, 3)])
def test_paged_attention_is_right_on_every_call_and_in_a_graph(rows, kp) -> None:
    # The split partials and the output are buffers of the instance, reused
    # by every call: repeated calls and graph replays stay right.
    q, k, v, pages = paged_inputs(6, rows=rows, p=1024, kp=kp)
    g = torch.Generator(device=DEV).manual_seed(7)
    attn = kernels.PagedDecodeAttention(rows, GROUP, HEAD_DIM, kp, DEV, torch.bfloat16)
    for _ in range(3):
        q.copy_(torch.randn(rows, GROUP, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=g))
        torch.testing.assert_close(attn(q, k, v, pages).float(), gathered_attention(q, k, v, pages),
                                   rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(q, k, v, pages)
    for _ in range(3):
        q.copy_(torch.randn(rows, GROUP, HEAD_DIM, device=DEV, dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), gathered_attention(q, k, v, pages),
                                   rtol=2e-2, atol=2e-2)


def test_a_decode_step_in_a_graph_is_the_same_with_and_without_dependent_launch() -> None:
    # score-add -> top-k (resetting the bins) -> paged attention -> combine,
    # captured once with programmatic dependent launch (each kernel waits on
    # the GPU for the one before) and once without: every replay must agree.
    rows, m, c, p, lst, k = 8, 16, 32, 2048, 256, 106
    q, kpool, vpool, _ = paged_inputs(8, rows=rows, p=p, kp=k)
    g = torch.Generator(device=DEV).manual_seed(9)
    cent = torch.nn.functional.normalize(
        torch.randn(rows, m, c, HEAD_DIM // m, device=DEV, generator=g),
        dim=-1).to(torch.bfloat16)
    ids = (torch.randint(0, p, (rows, m, c, lst), device=DEV, generator=g) +
           (torch.arange(rows, device=DEV) * p).view(rows, 1, 1, 1)).view(-1, lst).to(torch.int32)
    sc = torch.rand(rows * m * c, lst, device=DEV, generator=g).to(torch.float16)
    saved = kernels.PDL
    steps = {}
    try:
        for pdl in (False, True):
            kernels.PDL = "1" if pdl else "0"
            bins = torch.zeros(rows * p, device=DEV)
            sel = torch.empty(rows, k, dtype=torch.int64, device=DEV)
            attn = kernels.PagedDecodeAttention(rows, GROUP, HEAD_DIM, k, DEV, torch.bfloat16)

            def step():
                kernels.csa_score_pages(q, cent, ids, sc, bins)
                kernels.select_top_pages(bins.view(rows, p), k, n_recent=2, reset=True, out=sel)
                return attn(q, kpool, vpool, sel)

            step()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            steps[pdl] = (graph, sel, out, bins)
        for seed in range(4):
            q.copy_(torch.randn(rows, GROUP, HEAD_DIM, device=DEV, dtype=torch.bfloat16,
                                generator=torch.Generator(DEV).manual_seed(100 + seed)))
            got = {}
            for pdl, (graph, sel, out, bins) in steps.items():
                graph.replay()
                torch.cuda.synchronize()
                got[pdl] = ([set(r.tolist()) for r in sel], out.float().clone())
                assert torch.count_nonzero(bins) == 0
            assert got[True][0] == got[False][0], seed
            torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-2, atol=1e-2)
    finally:
        kernels.PDL = saved
