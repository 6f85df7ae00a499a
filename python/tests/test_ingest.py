"""IngestContext against a real ctxcached: synthetic K/V/Q of a made-up model
(as an external GPU engine would send), then sessions on the stored context."""
from __future__ import annotations

import os
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest

import ctxcache
from ctxcache import tensors

L, NQ, NKV, D, B = 2, 4, 2, 32, 16
T = 200  # 12.5 pages


def spec(fingerprint: bytes = b"ctxcache-python-tests-synthetic-") -> dict:
    return {"name": "synthetic", "n_layers": L, "n_q_heads": NQ, "n_kv_heads": NKV,
            "head_dim": D, "rope": {"theta": 10000.0}, "kv_dtype": "bf16",
            "fingerprint": fingerprint}


def synthetic_kv(seed: int, t: int = T) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((NKV, t, D)).astype(np.float32),
             rng.standard_normal((NKV, t, D)).astype(np.float32),
             rng.standard_normal((NQ, t, D)).astype(np.float32)) for _ in range(L)]


@pytest.fixture(scope="module")
def ingested(client: ctxcache.Client) -> Tuple[ctxcache.pb.ContextInfo, list]:
    kv = synthetic_kv(1)
    tokens = list(range(1000, 1000 + T))
    info = client.ingest(spec(), tokens, kv, indexes=["csa"], name="ingested",
                         labels={"source": "synthetic"})
    return info, kv


def test_ingest_stores_the_kv_as_sent(client: ctxcache.Client, ingested) -> None:
    info, kv = ingested
    assert info.n_tokens == T and info.state == ctxcache.storage_pb.CONTEXT_STATE_READY
    assert info.model.name == "synthetic" and info.name == "ingested"
    assert "csa" in {i.method for i in info.indexes}
    assert info.bytes_by_kind["index/csa"] > 0
    assert client.get(info.context_id).labels["source"] == "synthetic"
    pages = client.fetch_pages(info.context_id, [(1, 1, [0, 5, 12])])
    for p in pages:
        lo = p.block * B
        n = min(B, T - lo)
        assert p.n_tokens == n
        want_k = tensors.bf16_to_float32(tensors.float32_to_bf16(kv[1][0][1, lo:lo + n]))
        want_v = tensors.bf16_to_float32(tensors.float32_to_bf16(kv[1][1][1, lo:lo + n]))
        assert np.array_equal(p.k, want_k) and np.array_equal(p.v, want_v)


def test_session_on_ingested_context_is_page_table_consistent(client: ctxcache.Client,
                                                              ingested) -> None:
    info, kv = ingested
    rng = np.random.default_rng(5)
    with client.open_session(info.context_id, "csa", {"budget": 24}) as s:
        assert s.model.name == "synthetic" and s.n_tokens == T
        for step in range(2):
            for layer in range(L):
                r = s.step(layer, rng.standard_normal((NQ, D)).astype(np.float32))
                assert len(r.heads) == NKV
                for h in r.heads:
                    sent = {p.block: p for p in h.pages}
                    for sel in h.per_q_head:
                        assert 0 < sel.size <= s.n_tokens
                        for tok in sel.tolist():
                            assert tok // B in sent, (layer, h.kv_head, tok)
                            page = sent[tok // B]
                            assert tok % B < page.n_tokens
                    # K/V rows of the selected tokens are those of the stored KV.
                    stored = [int(i) for i in h.ids if i < T][:4]
                    for i, tok in enumerate(stored):
                        want = tensors.bf16_to_float32(
                            tensors.float32_to_bf16(kv[layer][0][h.kv_head, tok]))
                        assert np.array_equal(h.k[i], want)
            n_before = s.n_tokens
            k = rng.standard_normal((L, NKV, D)).astype(np.float32)
            v = rng.standard_normal((L, NKV, D)).astype(np.float32)
            q = rng.standard_normal((L, NQ, D)).astype(np.float32)
            assert s.append(k, v, q) == n_before + 1 == s.n_tokens
    assert client.get(info.context_id).n_tokens == T


def test_ingest_chunks_stay_under_the_message_limit(client: ctxcache.Client,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: List[int] = []
    kinds: List[str] = []
    real = client.ingest_chunks

    def recording(chunks: Iterator[ctxcache.pb.IngestChunk], **kwargs: Any) -> Any:
        def rec() -> Iterator[ctxcache.pb.IngestChunk]:
            for c in chunks:
                sizes.append(c.ByteSize())
                kinds.append(c.WhichOneof("msg"))
                yield c
        return real(rec(), **kwargs)

    monkeypatch.setattr(client, "ingest_chunks", recording)
    kv = synthetic_kv(2)
    limit = 40_000  # (2*2 + 4) heads * 32 * 4 B = 1 KiB per token: ~35 tokens per chunk
    info = client.ingest(spec(), list(range(5000, 5000 + T)), kv, indexes=["csa"],
                         max_message_bytes=limit)
    assert kinds[0] == "header" and kinds[-1] == "commit"
    n_chunks = kinds.count("chunk")
    assert n_chunks >= L * -(-T * 1024 // limit)  # at least ceil(bytes / limit) per layer
    assert max(s for s, k in zip(sizes, kinds) if k == "chunk") <= limit
    # Chunked upload stores the same KV.
    p = client.fetch_pages(info.context_id, [(0, 0, [7])])[0]
    want = tensors.bf16_to_float32(tensors.float32_to_bf16(kv[0][0][0, 7 * B:8 * B]))
    assert np.array_equal(p.k, want)
    # Default limit: every message of a larger upload is at most 4 MiB.
    sizes.clear()
    kinds.clear()
    big_t = 4600  # 4.7 MB of f32 K/V/Q per layer: over 4 MiB
    rng = np.random.default_rng(3)
    big = [(rng.standard_normal((NKV, big_t, D), dtype=np.float32),
            rng.standard_normal((NKV, big_t, D), dtype=np.float32),
            rng.standard_normal((NQ, big_t, D), dtype=np.float32)) for _ in range(L)]
    info = client.ingest(spec(), list(range(big_t)), big, indexes=["streaming"])
    assert info.n_tokens == big_t
    assert kinds.count("chunk") >= 2 * L and max(sizes[1:-1]) <= 4 << 20
    client.evict(info.context_id)


def test_ingest_bf16_torch_tensors(client: ctxcache.Client) -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(NKV, 64, D, generator=g).to(torch.bfloat16),
               torch.randn(NKV, 64, D, generator=g).to(torch.bfloat16),
               torch.randn(NQ, 64, D, generator=g).to(torch.bfloat16)) for _ in range(L)]
    info = client.ingest(spec(), torch.arange(64), iter(layers), indexes=["csa"])
    p = client.fetch_pages(info.context_id, [(1, 0, [2])], dtype="raw", as_torch=True)[0]
    assert p.k.dtype == torch.bfloat16
    assert torch.equal(p.k, layers[1][0][0, 32:48]) and torch.equal(p.v, layers[1][1][0, 32:48])


def test_ingest_kv_in_the_stored_dtype_is_stored_as_sent(client: ctxcache.Client) -> None:
    """K/V already in the model's kv_dtype and no queries take the server's
    path without conversion: the pages and the Quest index equal those of the
    same KV sent as fp32; a NaN in such a chunk is refused, naming it."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    t = 3 * B + 5
    layers = [(torch.randn(NKV, t, D, generator=g).to(torch.bfloat16),
               torch.randn(NKV, t, D, generator=g).to(torch.bfloat16)) for _ in range(L)]
    toks = list(range(7000, 7000 + t))
    raw = client.ingest(spec(), toks, layers, indexes=["quest"])
    f32 = client.ingest(spec(), list(range(7100, 7100 + t)),
                        [(k.float().numpy(), v.float().numpy()) for k, v in layers],
                        indexes=["quest"])
    for layer in range(L):
        for h in range(NKV):
            want = client.fetch_pages(f32.context_id, [(layer, h, [0, 1, 2, 3])], dtype="raw")
            got = client.fetch_pages(raw.context_id, [(layer, h, [0, 1, 2, 3])], dtype="raw")
            for a, b in zip(got, want):
                assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    assert (client.fetch_index(raw.context_id, "quest")
            == client.fetch_index(f32.context_id, "quest"))
    bad = [(k.clone(), v) for k, v in layers]
    bad[1][1][0, 4, 2] = float("inf")
    with pytest.raises(ctxcache.InvalidArgument, match="chunk.v contains NaN or Inf"):
        client.ingest(spec(), list(range(7200, 7200 + t)), bad, indexes=["quest"])
    client.evict(raw.context_id)
    client.evict(f32.context_id)


def test_ingest_errors_store_nothing(client: ctxcache.Client) -> None:
    before = {c.context_id for c in client.list(page_size=1000)}
    kv = synthetic_kv(4, t=40)
    toks = list(range(9000, 9040))
    with pytest.raises(ctxcache.InvalidArgument, match="fingerprint"):
        client.ingest(spec(fingerprint=b""), toks, kv)
    with pytest.raises(ValueError, match="shape"):  # caught client side, upload cancelled
        client.ingest(spec(), toks, [(k[:, :30], v, q) for k, v, q in kv])
    with pytest.raises(ValueError, match="layers"):
        client.ingest(spec(), toks, kv[:1])
    with pytest.raises(ctxcache.InvalidArgument):
        nan = [(k.copy(), v, q) for k, v, q in kv]
        nan[0][0][0, 0, 0] = np.nan
        client.ingest(spec(), toks, nan)
    # The same in the last layer's V: chunks before it were stored (the
    # server stores a chunk while it receives the next), and are removed.
    with pytest.raises(ctxcache.InvalidArgument, match="chunk.v"):
        late = [(k, v.copy(), q) for k, v, q in kv]
        late[-1][1][0, -1, 0] = np.inf
        client.ingest(spec(), toks, late)
    # A stream that ends without the commit is ABORTED.
    header = ctxcache.pb.IngestHeader(tokens=ctxcache.pb.TokenIds(ids=toks))
    header.model.CopyFrom(ctxcache.storage_pb.ModelSpec(
        name="synthetic", n_layers=L, n_q_heads=NQ, n_kv_heads=NKV, head_dim=D,
        kv_dtype=ctxcache.storage_pb.DTYPE_BF16, fingerprint=os.urandom(16)))
    with pytest.raises(ctxcache.Aborted, match="nothing was stored"):
        client.ingest_chunks(iter([ctxcache.pb.IngestChunk(header=header)]))
    assert {c.context_id for c in client.list(page_size=1000)} == before


# ------------------------------------------------------- a child (parent_id) --

def _pages(client: ctxcache.Client, cid: str, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """The stored K, V of every token: [L, NKV, n, D] float32."""
    k = np.zeros((L, NKV, n, D), np.float32)
    v = np.zeros_like(k)
    blocks = list(range((n + B - 1) // B))
    for p in client.fetch_pages(cid, [(l, h, blocks) for l in range(L) for h in range(NKV)]):
        lo = p.block * B
        k[p.layer, p.kv_head, lo:lo + p.n_tokens] = p.k
        v[p.layer, p.kv_head, lo:lo + p.n_tokens] = p.v
    return k, v


def _bf16(a: np.ndarray) -> np.ndarray:
    return tensors.bf16_to_float32(tensors.float32_to_bf16(a))


def test_ingest_child_shares_the_parents_pages_and_holds_the_appended_kv(
        client: ctxcache.Client, ingested) -> None:
    parent, kv = ingested
    extra = synthetic_kv(7, 37)  # the parent's last page (8 tokens) is shared in part
    ids = list(range(3000, 3037))
    child = client.ingest(None, ids, extra, parent_id=parent.context_id)
    assert child.n_tokens == T + 37 and child.parent_id == parent.context_id
    assert child.prefix_tokens == T
    assert child.provenance == ctxcache.storage_pb.PROVENANCE_INGESTED
    assert child.name == "ingested" and child.labels["source"] == "synthetic"
    assert [i.method for i in child.indexes] == [i.method for i in parent.indexes]  # csa
    k, v = _pages(client, child.context_id, T + 37)
    for layer in range(L):
        assert np.array_equal(k[layer, :, :T], _bf16(kv[layer][0]))
        assert np.array_equal(v[layer, :, :T], _bf16(kv[layer][1]))
        assert np.array_equal(k[layer, :, T:], _bf16(extra[layer][0]))
        assert np.array_equal(v[layer, :, T:], _bf16(extra[layer][1]))
    # A decode session reads the child: the appended tokens are selectable.
    rng = np.random.default_rng(3)
    with client.open_session(child.context_id, "csa", {"budget": 24}) as s:
        assert s.n_tokens == T + 37
        r = s.step(0, rng.standard_normal((NQ, D)).astype(np.float32))
        assert any((sel >= T).any() for h in r.heads for sel in h.per_q_head)
    # The same child again (parent_tokens given: no GetContext) is reused.
    again = client.ingest(spec(), ids, extra, parent_id=parent.context_id, parent_tokens=T)
    assert again.context_id == child.context_id and again.stored_bytes == child.stored_bytes
    # A child of the child: a chain.
    grand = client.ingest(None, [7], synthetic_kv(8, 1), parent_id=child.context_id)
    assert grand.n_tokens == T + 38 and grand.parent_id == child.context_id
    k2, _ = _pages(client, grand.context_id, T + 38)
    assert np.array_equal(k2[:, :, :T + 37], k)
    with pytest.raises(ctxcache.FailedPrecondition):  # the parent stays while referenced
        client.evict(parent.context_id)


def test_ingest_child_errors_name_the_field_and_store_nothing(client: ctxcache.Client,
                                                               ingested) -> None:
    parent, _ = ingested
    n = len(list(client.list()))
    extra = synthetic_kv(9, 4)
    with pytest.raises(ctxcache.InvalidArgument, match="header.parent_id"):
        client.ingest(spec(), [1, 2, 3, 4], extra, parent_id="not-hex", parent_tokens=T)
    with pytest.raises(ctxcache.NotFound):
        client.ingest(spec(), [1, 2, 3, 4], extra, parent_id="ab" * 16, parent_tokens=T)
    with pytest.raises(ctxcache.FailedPrecondition, match="header.model.fingerprint"):
        client.ingest(spec(b"another-model-fingerprint"), [1, 2, 3, 4], extra,
                      parent_id=parent.context_id, parent_tokens=T)
    other = dict(spec(), kv_dtype="f16")
    with pytest.raises(ctxcache.FailedPrecondition, match="header.model.kv_dtype"):
        client.ingest(other, [1, 2, 3, 4], extra, parent_id=parent.context_id, parent_tokens=T)
    # Chunks must start at the parent's n_tokens (the child's token numbering).
    with pytest.raises(ctxcache.InvalidArgument, match=f"expected start {T}"):
        client.ingest(spec(), [1, 2, 3, 4], extra, parent_id=parent.context_id, parent_tokens=0)
    # Past the server's --max-context-tokens 65536, parent included.
    header = ctxcache.pb.IngestHeader(parent_id=parent.context_id)
    header.model.CopyFrom(parent.model)
    header.tokens.ids.extend([1] * (65536 - T + 1))
    with pytest.raises(ctxcache.InvalidArgument, match="65537 tokens"):
        client.ingest_chunks([ctxcache.pb.IngestChunk(header=header),
                              ctxcache.pb.IngestChunk(commit=ctxcache.pb.IngestCommit())])
    assert len(list(client.list())) == n


def test_regression_a_small_child_is_reused_with_csa_c_of_its_own_queries(
        client: ctxcache.Client, built) -> None:
    """A child's csa C is clamped to the query rows of its own tokens (here
    10 * 2 < 128); the reuse check once resolved C over every token's rows and
    refused the same extension again with ALREADY_EXISTS."""
    first = client.extend(built.context_id, tokens=[3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    csa = {i.method: i for i in first.context.indexes}["csa"]
    assert csa.params["C"] == "20"
    again = client.extend(built.context_id, tokens=[3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    assert again.reused and again.context.context_id == first.context.context_id


# ------------------------------------------- through the native library --

@pytest.fixture(scope="module")
def nc(server):
    from ctxcache import native
    with native.NativeClient(server.address, timeout=60) as c:
        yield c


def test_native_ingest_equals_the_grpc_clients(client: ctxcache.Client, nc) -> None:
    """The same K, V and Q through both clients: equal pages and equal csa
    artifacts (built from the queries), in frames far smaller than a layer."""
    kv = synthetic_kv(21)
    toks = list(range(11000, 11000 + T))
    a = client.ingest(spec(b"native-ingest-vs-grpc-ingest-a--"), toks, kv, indexes=["csa"])
    b = nc.ingest(spec(b"native-ingest-vs-grpc-ingest-b--"), toks, iter(kv), indexes=["csa"],
                  name="native", labels={"via": "c-abi"}, frame_bytes=5000)
    assert b.context_id != a.context_id and b.n_tokens == T and b.name == "native"
    assert client.get(b.context_id).labels["via"] == "c-abi"
    ka, va = _pages(client, a.context_id, T)
    kb, vb = _pages(client, b.context_id, T)
    assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    assert np.array_equal(kb[1], np.stack([_bf16(kv[1][0][h]) for h in range(NKV)]))
    assert client.fetch_index(a.context_id, "csa") == client.fetch_index(b.context_id, "csa")
    # The same again is the stored one.
    assert nc.ingest(spec(b"native-ingest-vs-grpc-ingest-b--"), toks, kv,
                     indexes=["csa"]).context_id == b.context_id


def test_native_ingest_reads_strided_torch_tensors_and_makes_a_child(client: ctxcache.Client,
                                                                     nc) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(4)
    t = 45
    # Token-major memory [t, heads, d], passed as [heads, t, d] views (strided).
    layers = [tuple(torch.randn(t, NKV, D, generator=gen).to(torch.bfloat16).permute(1, 0, 2)
                    for _ in range(2)) for _ in range(L)]
    assert not layers[0][0].is_contiguous()
    parent = nc.ingest(spec(), list(range(12000, 12000 + t)), layers, indexes=["quest"])
    k, v = _pages(client, parent.context_id, t)
    for layer in range(L):
        assert np.array_equal(k[layer], layers[layer][0].float().numpy())
        assert np.array_equal(v[layer], layers[layer][1].float().numpy())
    # A child (model from the parent), its KV mixed f16 and f32: sent as f32.
    extra = [(torch.randn(NKV, 3, D, generator=gen).half(), torch.randn(NKV, 3, D, generator=gen))
             for _ in range(L)]
    child = nc.ingest(None, [5, 6, 7], extra, parent_id=parent.context_id)
    assert child.n_tokens == t + 3 and child.parent_id == parent.context_id
    k2, v2 = _pages(client, child.context_id, t + 3)
    assert np.array_equal(k2[:, :, :t], k)
    for layer in range(L):
        assert np.array_equal(k2[layer, :, t:], _bf16(extra[layer][0].float().numpy()))
        assert np.array_equal(v2[layer, :, t:], _bf16(extra[layer][1].numpy()))


def test_native_ingest_errors_name_the_field_and_store_nothing(client: ctxcache.Client,
                                                               nc, ingested) -> None:
    before = {c.context_id for c in client.list(page_size=1000)}
    kv = synthetic_kv(22, 20)
    toks = list(range(13000, 13020))
    with pytest.raises(ctxcache.InvalidArgument, match=r"k: shape \[2, 19, 32\]"):
        nc.ingest(spec(), toks, [(k[:, :19], v, q) for k, v, q in kv])
    with pytest.raises(TypeError, match="tokens"):
        nc.ingest(spec(), [1.5] * 20, kv)
    with pytest.raises(ValueError, match="got 1 layers of KV, the model has 2"):
        nc.ingest(spec(), toks, kv[:1])
    with pytest.raises(ctxcache.InvalidArgument, match="header.tokens: empty"):
        nc.ingest(spec(), [], [])
    with pytest.raises(ctxcache.FailedPrecondition, match="header.model.fingerprint"):
        nc.ingest(spec(b"another-model-fingerprint"), [1], synthetic_kv(23, 1),
                  parent_id=ingested[0].context_id)
    with pytest.raises(ctxcache.NotFound):
        nc.ingest(None, [1], synthetic_kv(23, 1), parent_id="ab" * 16)

    def failing():  # the caller's generator fails mid-way: the ingest is cancelled
        yield kv[0]
        raise RuntimeError("prefill failed")
    with pytest.raises(RuntimeError, match="prefill failed"):
        nc.ingest(spec(), toks, failing())
    assert {c.context_id for c in client.list(page_size=1000)} == before
