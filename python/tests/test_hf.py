"""ctxcache.torch.hf: the decode attention (torch, CPU) always; the HF
transformers path only where transformers is installed (the GPU machine:
scripts/gpu-suite.sh), against the real ctxcached."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ctxcache.types import HeadResult, StepResult  # noqa: E402
from ctxcache.torch import hf  # noqa: E402


def dense(q, k, v, scale):
    # q [nq, d], k/v [nkv, n, d]
    g = q.shape[0] // k.shape[0]
    out = []
    for h in range(q.shape[0]):
        w = torch.softmax(k[h // g] @ q[h] * scale, dim=0)
        out.append(w @ v[h // g])
    return torch.stack(out)


def test_attend_over_everything_is_dense_attention() -> None:
    g = torch.Generator().manual_seed(0)
    nq, nkv, n, t, d = 8, 2, 50, 3, 16
    q = torch.randn(nq, d, generator=g)
    k = torch.randn(nkv, n + t, d, generator=g)
    v = torch.randn(nkv, n + t, d, generator=g)
    got = hf.attend(q, k[:, :n], v[:, :n], None, k[:, n:], v[:, n:], d ** -0.5)
    torch.testing.assert_close(got, dense(q, k, v, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_attend_masks_each_query_head_to_its_own_selection() -> None:
    g = torch.Generator().manual_seed(1)
    nq, nkv, n, t, d = 4, 2, 30, 2, 8
    q = torch.randn(nq, d, generator=g)
    k = torch.randn(nkv, n + t, d, generator=g)
    v = torch.randn(nkv, n + t, d, generator=g)
    rng = np.random.default_rng(0)
    masks = torch.as_tensor(rng.random((nkv, 2, n)) < 0.3)
    got = hf.attend(q, k[:, :n], v[:, :n], masks, k[:, n:], v[:, n:], 0.3)
    for h in range(nq):
        rows = torch.cat([torch.nonzero(masks[h // 2][h % 2])[:, 0], torch.arange(n, n + t)])
        w = torch.softmax(k[h // 2, rows] @ q[h] * 0.3, dim=0)
        torch.testing.assert_close(got[h], w @ v[h // 2, rows], rtol=1e-5, atol=1e-5)


def test_gather_selected_masks_each_q_heads_rows() -> None:
    d = 4
    ids = np.array([1, 5, 9], dtype=np.int64)
    k = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    head = HeadResult(kv_head=0, per_q_head=[np.array([1, 9]), np.array([5])], ids=ids, k=k,
                      v=k + 100)
    step = StepResult(layer=0, heads=[head], selections=[], page_tables=[], stats=None,
                      bytes_received=0)
    ks, vs, masks = hf.gather_selected(step, 2, "cpu", torch.float32)
    assert torch.equal(ks[0], torch.tensor(k))
    assert torch.equal(vs[0], torch.tensor(k + 100))
    assert masks[0].tolist() == [[True, False, True], [False, True, False]]


def test_gather_selected_pads_heads_and_drops_appended_ids() -> None:
    d = 2
    h0 = HeadResult(kv_head=0, per_q_head=[np.array([0, 12]), np.array([3])],
                    ids=np.array([0, 3, 12]), k=np.ones((3, d), np.float32),
                    v=np.zeros((3, d), np.float32))
    h1 = HeadResult(kv_head=1, per_q_head=[np.array([7]), np.array([7])], ids=np.array([7]),
                    k=np.full((1, d), 2, np.float32), v=np.zeros((1, d), np.float32))
    step = StepResult(layer=0, heads=[h0, h1], selections=[], page_tables=[], stats=None,
                      bytes_received=0)
    # Token 12 was appended by the session (the context has 10 tokens): the
    # worker attends it from its own cache, so it is not a context row.
    ks, vs, masks = hf.gather_selected(step, 4, "cpu", torch.float32, n_context=10)
    assert ks.shape == (2, 2, d)
    assert masks.tolist() == [[[True, False], [False, True]], [[True, False], [True, False]]]
    assert ks[1, 0].tolist() == [2, 2] and ks[1, 1].tolist() == [0, 0]
    # Padding rows never get weight.
    q = torch.randn(4, d)
    dk, dv = torch.randn(2, 1, d), torch.randn(2, 1, d)
    out = hf.attend(q, ks, vs, masks, dk, dv, 1.0)
    w = torch.softmax(torch.stack([q[2] @ ks[1, 0], q[2] @ dk[1, 0]]), 0)
    torch.testing.assert_close(out[2], w[0] * vs[1, 0] + w[1] * dv[1, 0])


transformers = pytest.importorskip("transformers") if os.environ.get("CTXCACHE_HF_TESTS") else None


@pytest.mark.skipif(transformers is None, reason="set CTXCACHE_HF_TESTS=1 with transformers")
def test_hf_full_through_ctxcache_equals_dense_and_csa_agrees(make_server) -> None:
    import ctxcache
    from transformers import AutoModelForCausalLM

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(repo, "models", "ctxcache-ref"),
                                                 dtype=torch.bfloat16).to(dev).eval()
    server = make_server(["--default-indexes", "csa"])
    ids = list(np.random.default_rng(0).integers(3, 1000, size=1200))
    with ctxcache.Client(server.address, timeout=120) as c:
        info, pre = hf.prefill_and_ingest(c, model, ids[:-1], indexes=["csa"])
        dense_out = hf.generate_dense(model, pre, ids[-1], 16)
        # The generated tokens go back to the session (append=True); its
        # selections of them are dropped (the model's cache holds them), so
        # full still decodes exactly like dense.
        full = hf.generate(c, model, info, ids[-1], 16, method="full")
        assert full.tokens == dense_out.tokens
        assert full.appended_tokens == 16
        for a, b in zip(full.logits, dense_out.logits):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        csa = hf.generate(c, model, info, ids[-1], 16, method="csa", append=False)
        assert len(csa.tokens) == 16
        assert csa.bytes_received < full.bytes_received
        # Client-side selection by the C++ session core through the native
        # library (a client-mode session): the server's selections, so the
        # server's tokens.
        client_csa = hf.generate_client(c, model, info, ids[-1], 16, selection="exact",
                                        append=False)
        assert client_csa.tokens == csa.tokens
        # ... and the library's counts: the pages it fetched (each once: its
        # page cache serves repeats), fewer bytes than full's
        assert 0 < client_csa.bytes_received < full.bytes_received
        assert client_csa.pool_misses > 0
        # The torch core on the device: the same stages as tensor ops; teacher
        # forced on the server's tokens, near-ties aside it predicts the same.
        torch_csa = hf.generate_client(c, model, info, ids[-1], 16, selection="torch",
                                       forced=csa.tokens)
        assert torch_csa.appended_tokens == 16 and torch_csa.ttft_s > 0
        same = sum(a == b for a, b in zip(torch_csa.tokens, csa.tokens))
        assert same >= 15, (torch_csa.tokens, csa.tokens)
        assert torch_csa.bytes_received < full.bytes_received
        # Speculative next-layer prefetch (the decoder layers' pre-hooks):
        # some missed pages come from it, and the decoding is the same.
        pre = hf.generate_client(c, model, info, ids[-1], 16, selection="torch",
                                 forced=csa.tokens, append=False, prefetch=True)
        assert pre.prefetch_hits > 0
        assert sum(a == b for a, b in zip(pre.tokens, csa.tokens)) >= 15, pre.tokens


def test_gpu_page_pool_fetches_only_missing_pages_and_evicts_lru(make_server) -> None:
    import ctxcache
    from conftest import random_tokens

    server = make_server(["--default-indexes", "streaming"])
    with ctxcache.Client(server.address) as c:
        info = c.build(tokens=random_tokens(400, 3)).context
        d = info.model.head_dim
        pool = hf.GpuPagePool(c, info, "cpu", budget_bytes=6 * 2 * 16 * d * 2)
        assert pool.n_slots == 6

        def lookup(layer, by_head):
            heads = [by_head.get(h, []) for h in range(info.model.n_kv_heads)]
            pages, valid = hf._pad_pages(heads, "cpu")
            slots = pool.lookup(layer, pages, valid)
            return {h: slots[h, :len(b)] for h, b in enumerate(heads)}

        slots = lookup(0, {0: [0, 1, 2], 1: [3]})
        assert (pool.misses, pool.hits) == (4, 0)
        ref = c.fetch_pages(info.context_id, [(0, 0, [1]), (0, 1, [3])], dtype="raw",
                            as_torch=True)
        for p, s in zip(ref, [slots[0][1], slots[1][0]]):
            assert torch.equal(pool.k[s, :p.n_tokens], p.k.view(p.n_tokens, -1))
            assert torch.equal(pool.v[s, :p.n_tokens], p.v.view(p.n_tokens, -1))
        again = lookup(0, {0: [0, 1, 2]})
        assert (pool.misses, pool.hits) == (4, 3)
        assert torch.equal(again[0], slots[0])
        # 3 more pages: 2 free slots, then the least recently used page that
        # is not needed now, (0, 1, 3), goes.
        lookup(1, {0: [4, 5, 6]})
        assert pool.misses == 7
        assert not pool.holds(0, 1, 3) and pool.holds(0, 0, 0) and pool.holds(1, 0, 6)
        # gather: the pages' rows in order, K and V as fetched.
        pages, valid = hf._pad_pages([[2, 24], [0]], "cpu")
        k, v = pool.gather(0, pages, valid)
        assert k.shape == (2, 32, d)
        ref = c.fetch_pages(info.context_id, [(0, 0, [2, 24]), (0, 1, [0])], dtype="raw",
                            as_torch=True)
        assert torch.equal(k[0, :16], ref[0].k.view(16, d))
        n_last = ref[1].n_tokens  # page 24: the last one (tokens 384..399)
        assert torch.equal(v[0, 16:16 + n_last], ref[1].v.view(n_last, d))
        assert torch.equal(k[1, :16], ref[2].k.view(16, d))
        with pytest.raises(ValueError):
            lookup(0, {0: list(range(7))})
        # load_all: every page of every (layer, kv head), then lookups only hit.
        with pytest.raises(ValueError, match="load_all"):
            pool.load_all()
        m = info.model
        n_pages = (info.n_tokens + 15) // 16
        full = hf.GpuPagePool(c, info, "cpu",
                              budget_bytes=m.n_layers * m.n_kv_heads * n_pages * 2 * 16 * d * 2)
        full.load_all()
        assert full.misses == m.n_layers * m.n_kv_heads * n_pages and full.hits == 0
        assert full.holds(m.n_layers - 1, m.n_kv_heads - 1, n_pages - 1)
        pages, valid = hf._pad_pages([[0, 7], [24]], "cpu")
        k, _ = full.gather(1, pages, valid)
        assert full.misses == m.n_layers * m.n_kv_heads * n_pages and full.hits == 3
        ref = c.fetch_pages(info.context_id, [(1, 0, [7])], dtype="raw", as_torch=True)
        assert torch.equal(k[0, 16:32], ref[0].k.view(16, d))
