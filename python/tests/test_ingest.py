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

    def recording(chunks: Iterator[ctxcache.pb.IngestChunk]) -> Any:
        def rec() -> Iterator[ctxcache.pb.IngestChunk]:
            for c in chunks:
                sizes.append(c.ByteSize())
                kinds.append(c.WhichOneof("msg"))
                yield c
        return real(rec())

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
    # A stream that ends without the commit is ABORTED.
    header = ctxcache.pb.IngestHeader(tokens=ctxcache.pb.TokenIds(ids=toks))
    header.model.CopyFrom(ctxcache.storage_pb.ModelSpec(
        name="synthetic", n_layers=L, n_q_heads=NQ, n_kv_heads=NKV, head_dim=D,
        kv_dtype=ctxcache.storage_pb.DTYPE_BF16, fingerprint=os.urandom(16)))
    with pytest.raises(ctxcache.Aborted, match="nothing was stored"):
        client.ingest_chunks(iter([ctxcache.pb.IngestChunk(header=header)]))
    assert {c.context_id for c in client.list(page_size=1000)} == before
