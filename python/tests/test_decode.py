"""DecodeService against a real ctxcached: fetch_index, fetch_pages and
server-select sessions (step, append, in-band errors)."""
from __future__ import annotations

import time
from typing import Dict, Tuple

import numpy as np
import pytest

import ctxcache
from ctxcache import tensors
from ctxcache.crc32c import crc32c
from conftest import random_tokens

L, NQ, NKV, D, B = 2, 4, 2, 32, 16  # tests/data/golden/llama3; pages of 16 tokens


def queries(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((NQ, D)).astype(np.float32)


def test_model_is_the_expected_golden_llama(built: ctxcache.pb.ContextInfo) -> None:
    m = built.model
    assert (m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim) == (L, NQ, NKV, D)
    assert built.block_tokens == B and built.n_tokens == 300
    assert m.kv_dtype == ctxcache.storage_pb.DTYPE_BF16 and len(m.fingerprint) > 0


def test_fetch_index_sizes_and_crc(client: ctxcache.Client,
                                   built: ctxcache.pb.ContextInfo) -> None:
    for method in ("csa", "tactic"):
        arts = client.fetch_index(built.context_id, method)
        assert sorted(arts) == [(l, h) for l in range(L) for h in range(NKV)]
        assert all(len(b) > 0 for b in arts.values())
        # The artifacts are the stored index bytes of the method.
        assert sum(len(b) for b in arts.values()) == built.bytes_by_kind[f"index/{method}"]
    csa = client.fetch_index(built.context_id, "csa")
    # Filters select a subset, byte-identical to the full fetch.
    part = client.fetch_index(built.context_id, "csa", layers=[1], kv_heads=[0])
    assert list(part) == [(1, 0)] and part[(1, 0)] == csa[(1, 0)]
    assert part[(1, 0)] != csa[(0, 0)]


def test_fetch_index_reassembles_multi_chunk_artifacts(client: ctxcache.Client) -> None:
    # ~1,500 bytes of plain csa tables per token and (layer, kv head) (the
    # compact default is ~260): 2500 tokens make artifacts over the 1 MiB
    # chunk size, sent as several IndexChunks.
    ctx = client.build(tokens=random_tokens(2500, 21),
                       indexes=[("csa", {"format": "plain"})]).context
    arts = client.fetch_index(ctx.context_id, "csa")
    assert len(arts) == L * NKV
    assert max(len(b) for b in arts.values()) > (1 << 20)
    assert sum(len(b) for b in arts.values()) == ctx.bytes_by_kind["index/csa"]
    client.evict(ctx.context_id)


def test_fetch_index_errors(client: ctxcache.Client, built: ctxcache.pb.ContextInfo) -> None:
    with pytest.raises(ctxcache.InvalidArgument, match="unknown method"):
        client.fetch_index(built.context_id, "nope")
    with pytest.raises(ctxcache.FailedPrecondition):
        client.fetch_index(built.context_id, "lfps")  # not built for this context
    with pytest.raises(ctxcache.NotFound):
        client.fetch_index("00112233445566778899aabbccddeeff", "csa")


def test_fetch_pages_shapes_dtypes_and_crc(client: ctxcache.Client,
                                           built: ctxcache.pb.ContextInfo) -> None:
    tables = [(0, 1, [0, 3, 18]), {"layer": 1, "kv_head": 0, "blocks": [7]}]
    pages = client.fetch_pages(built.context_id, tables)
    assert [(p.layer, p.kv_head, p.block) for p in pages] == [(0, 1, 0), (0, 1, 3), (0, 1, 18),
                                                              (1, 0, 7)]
    for p in pages:
        want_n = 300 - 18 * B if p.block == 18 else B  # the last page holds 12 tokens
        assert p.n_tokens == want_n
        assert p.k.shape == (want_n, D) and p.v.shape == (want_n, D)
        assert p.k.dtype == np.float32 and p.dtype == "bf16"
        assert np.isfinite(p.k).all() and np.abs(p.k).sum() > 0
        assert not np.array_equal(p.k, p.v)
    raw = client.fetch_pages(built.context_id, tables, dtype="raw")
    for p, r in zip(pages, raw):
        assert r.k.dtype == np.uint16 and r.k.shape == p.k.shape
        # The crc covers the stored k || v bytes.
        assert crc32c(r.k.tobytes() + r.v.tobytes()) == r.crc32c == p.crc32c
        # float32 output is the exact widening of the stored bf16.
        assert np.array_equal(tensors.bf16_to_float32(r.k), p.k)
    # Block 3 of (0, 1) is tokens 48..63, rows of the same matrix as block 0.
    assert not np.array_equal(pages[0].k, pages[1].k)


def test_fetch_pages_as_torch(client: ctxcache.Client, built: ctxcache.pb.ContextInfo) -> None:
    torch = pytest.importorskip("torch")
    f32 = client.fetch_pages(built.context_id, [(1, 1, [2])], as_torch=True)[0]
    raw = client.fetch_pages(built.context_id, [(1, 1, [2])], dtype="raw", as_torch=True)[0]
    assert isinstance(f32.k, torch.Tensor) and f32.k.dtype == torch.float32
    assert raw.k.dtype == torch.bfloat16 and tuple(raw.k.shape) == (B, D)
    assert torch.equal(raw.k.float(), f32.k) and torch.equal(raw.v.float(), f32.v)


def test_fetch_pages_errors(client: ctxcache.Client, built: ctxcache.pb.ContextInfo) -> None:
    with pytest.raises(ctxcache.InvalidArgument):
        client.fetch_pages(built.context_id, [(5, 0, [0])])  # layer out of range
    with pytest.raises(ctxcache.InvalidArgument):
        client.fetch_pages(built.context_id, [(0, 0, [1000])])  # block out of range
    with pytest.raises(ctxcache.NotFound):
        client.fetch_pages("00112233445566778899aabbccddeeff", [(0, 0, [0])])


def _check_step(r: ctxcache.StepResult, layer: int, n_tokens: int) -> None:
    assert r.layer == layer and len(r.heads) == NKV and len(r.selections) == NQ
    for h in r.heads:
        assert h.blocks == sorted(set(h.blocks)) and h.blocks
        assert [p.block for p in h.pages] == h.blocks
        assert len(h.per_q_head) == NQ // NKV
        for sel in h.per_q_head:
            assert sel.size > 0 and np.all(np.diff(sel) > 0)
            assert sel.min() >= 0 and sel.max() < n_tokens
            # Page-table consistent: every selected token lies in a returned page.
            assert set((sel // B).tolist()) <= set(h.blocks)
        assert h.k.shape == (h.ids.size, D) and h.v.shape == (h.ids.size, D)
        for i in (0, h.ids.size // 2, h.ids.size - 1):  # K rows come from the pages
            tok = int(h.ids[i])
            page = h.page(tok // B)
            assert np.array_equal(h.k[i], page.k[tok % B])
            assert np.array_equal(h.v[i], page.v[tok % B])
    tables_blocks: Dict[int, set] = {}
    for kv_head, _sub, blocks in r.page_tables:
        tables_blocks.setdefault(kv_head, set()).update(blocks)
    for h in r.heads:
        assert tables_blocks.get(h.kv_head, set()) <= set(h.blocks)
    assert r.bytes_received > 0 and r.n_pages == sum(len(h.blocks) for h in r.heads)


def test_session_pages_match_fetch_pages(client: ctxcache.Client,
                                         built: ctxcache.pb.ContextInfo) -> None:
    base = client.stats().open_sessions
    with client.open_session(built.context_id, "csa", {"rho": 0.1}) as s:
        assert s.n_tokens == 300 and len(s.session_id) > 0 and s.method == "csa"
        assert client.stats().open_sessions == base + 1
        for layer in range(L):
            r = s.step(layer, queries(layer))
            _check_step(r, layer, 300)
            assert r.stats.select_us >= 0 and r.stats.entries_touched > 0
            # The same blocks fetched directly hold the same K and V.
            tables = [(layer, h.kv_head, h.blocks) for h in r.heads]
            fetched: Dict[Tuple[int, int], ctxcache.Page] = {
                (p.kv_head, p.block): p for p in client.fetch_pages(built.context_id, tables)}
            by_key = r.pages_by_key()
            assert set(fetched) == set(by_key)
            for key, p in by_key.items():
                assert np.array_equal(p.k, fetched[key].k), key
                assert np.array_equal(p.v, fetched[key].v), key
                assert p.crc32c == fetched[key].crc32c
    assert s.closed
    deadline = time.monotonic() + 10  # the server releases the session as the stream ends
    while client.stats().open_sessions != base and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.stats().open_sessions == base


@pytest.mark.parametrize("method", ["csa", "tactic", "streaming", "oracle", "full"])
def test_every_built_method_steps(client: ctxcache.Client, built: ctxcache.pb.ContextInfo,
                                  method: str) -> None:
    with client.open_session(built.context_id, method) as s:
        r = s.step(1, queries(7))
        _check_step(r, 1, 300)
        if method == "full":
            assert all(h.blocks == list(range(19)) for h in r.heads)
            assert all(h.ids.size == 300 for h in r.heads)


def test_estimated_mass_only_when_asked(client: ctxcache.Client,
                                        built: ctxcache.pb.ContextInfo) -> None:
    n_q = built.model.n_q_heads
    with client.open_session(built.context_id, "csa", {"rho": 0.1}) as s:
        r = s.step(0, queries(3))
        assert r.estimated_mass == [None] * n_q  # not asked: nothing computed or sent
    with client.open_session(built.context_id, "full", {"estimate_mass": 1}) as s:
        assert s.step(0, queries(3)).estimated_mass == [pytest.approx(1.0)] * n_q
    with client.open_session(built.context_id, "csa", {"rho": 0.1, "estimate_mass": 1}) as s:
        got = s.step(0, queries(3)).estimated_mass
        assert len(got) == n_q and all(m is not None and 0.0 < m <= 1.0 for m in got)
    with client.open_session(built.context_id, "oracle", {"rho": 0.1, "estimate_mass": 1}) as s:
        got = s.step(0, queries(3)).estimated_mass
        assert all(m is not None and 0.0 < m <= 1.0 for m in got)


def test_append_extends_the_sequence(client: ctxcache.Client,
                                     built: ctxcache.pb.ContextInfo) -> None:
    rng = np.random.default_rng(11)
    with client.open_session(built.context_id, "full") as s:
        ks = []
        for i in range(3):
            k = rng.standard_normal((L, NKV, D)).astype(np.float32)
            v = rng.standard_normal((L, NKV, D)).astype(np.float32)
            q = rng.standard_normal((L, NQ, D)).astype(np.float32)
            assert s.append(k, v, q, token_id=7 + i) == 301 + i
            ks.append((k, v))
        assert s.n_tokens == 303
        r = s.step(1, queries(3))
        _check_step(r, 1, 303)
        for h in r.heads:
            assert h.ids.size == 303 and h.ids[-1] == 302
            last = h.page(18)
            assert last.n_tokens == 303 - 18 * B  # 12 stored + 3 appended tokens
            for i, (k, v) in enumerate(ks):
                row = 12 + i
                # The appended K/V come back (as stored: within bf16 precision).
                assert np.allclose(last.k[row], k[1, h.kv_head], rtol=1e-2, atol=1e-2)
                assert np.allclose(last.v[row], v[1, h.kv_head], rtol=1e-2, atol=1e-2)
    # The stored context is unchanged by a session's appends.
    assert client.get(built.context_id).n_tokens == 300


def test_session_errors_in_band_and_out(client: ctxcache.Client,
                                        built: ctxcache.pb.ContextInfo) -> None:
    with pytest.raises(ctxcache.NotFound):
        client.open_session("00112233445566778899aabbccddeeff")
    with pytest.raises(ctxcache.InvalidArgument, match="bogus"):
        client.open_session(built.context_id, "bogus")  # unknown method
    with pytest.raises(ctxcache.InvalidArgument, match="rho"):
        client.open_session(built.context_id, "csa", {"rho": 7})
    with pytest.raises(ctxcache.FailedPrecondition):
        client.open_session(built.context_id, "lfps")  # index not built
    s = client.open_session(built.context_id, "csa")
    bad = queries(1)
    bad[0, 5] = np.nan
    with pytest.raises(ctxcache.InvalidArgument, match="NaN"):
        s.step(0, bad)  # DecodeResponse.error, mapped like a call's status
    with pytest.raises(ctxcache.InvalidArgument):
        s.step(9, queries(1))  # layer out of range (server side)
    with pytest.raises(ValueError, match="shape"):
        s.step(0, np.zeros((NQ, D - 1), np.float32))  # caught before sending
    with pytest.raises(ValueError, match="shape"):
        s.append(np.zeros((L, NKV, D)), np.zeros((L, NKV, D + 1)))
    assert not s.closed
    _check_step(s.step(0, queries(2)), 0, 300)  # still usable
    s.close()
    s.close()  # idempotent
    with pytest.raises(ctxcache.FailedPrecondition, match="closed"):
        s.step(0, queries(2))


def test_session_outputs_torch(client: ctxcache.Client, built: ctxcache.pb.ContextInfo) -> None:
    torch = pytest.importorskip("torch")
    with client.open_session(built.context_id, "csa", as_torch=True, dtype="raw") as s:
        r = s.step(0, torch.from_numpy(queries(5)).to(torch.bfloat16))
        h = r.heads[0]
        assert isinstance(h.k, torch.Tensor) and h.k.dtype == torch.float32
        assert h.pages[0].k.dtype == torch.bfloat16
        tok = int(h.ids[0])
        assert torch.equal(h.page(tok // B).k[tok % B].float(), h.k[0])
