"""The engine's write-back (ctxcache.engine.WriteBack) on the CPU against a
real ctxcached: an extension's K/V (a real DenseExtendAttention chunk loop)
and a sequence's own decoded tokens (OwnTokens) stored as child contexts of
the stored one; the children read back through the native library and a
decode session; errors (an evicted link, a killed server) land on the
futures without hanging. On CUDA the same code copies on a side stream
(test_writeback_copies_cuda_tensors_on_a_side_stream)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Tuple

import pytest
import torch

import ctxcache
from ctxcache import native
from ctxcache.engine import (DenseExtendAttention, OwnTokens, WriteBack, WriteBackOptions)

L, NQ, NKV, D = 2, 4, 2, 32
T0 = 120  # the stored context: 7.5 pages

SPEC = {"name": "writeback-synthetic", "n_layers": L, "n_q_heads": NQ, "n_kv_heads": NKV,
        "head_dim": D, "rope": {"theta": 10000.0}, "kv_dtype": "bf16",
        "fingerprint": b"ctxcache-pytest-writeback"}


def _kv(seed: int, t: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, NKV, t, D, generator=g).to(torch.bfloat16),
            torch.randn(L, NKV, t, D, generator=g).to(torch.bfloat16))


def _store(client: ctxcache.Client, seed: int, name: str) -> Tuple[ctxcache.pb.ContextInfo,
                                                                    torch.Tensor, torch.Tensor]:
    k, v = _kv(seed, T0)
    info = client.ingest(SPEC, list(range(seed, seed + T0)), [(k[i], v[i]) for i in range(L)],
                         indexes=[("quest", {"page": "16"})], name=name)
    return info, k, v


def _load(address: str, cid: str) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """A stored context's K, V [L, NKV, n, D] bf16 through the native library."""
    with native.NativeClient(address, timeout=60) as nc:
        shape = nc.context(cid)
        k = torch.empty(shape.kv_shape(), dtype=torch.bfloat16)
        v = torch.empty_like(k)
        nc.load_kv(cid, k, v, streams=2)
        return k, v, shape.n_tokens


def _extension(k: torch.Tensor, v: torch.Tensor, t: int, seed: int) -> DenseExtendAttention:
    """An extension of t tokens prefilled over the stored K/V in two chunks."""
    pad = (T0 + 15) // 16 * 16
    kp = torch.zeros(L, NKV, pad, D, dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    kp[:, :, :T0], vp[:, :, :T0] = k, v
    att = DenseExtendAttention(kp, vp, T0, max_tokens=64)
    g = torch.Generator().manual_seed(seed)
    for c0, c1 in ((0, t // 2), (t // 2, t)):
        for layer in range(L):
            q = torch.randn(c1 - c0, NQ, D, generator=g).to(torch.bfloat16)
            kn = torch.randn(c1 - c0, NKV, D, generator=g).to(torch.bfloat16)
            vn = torch.randn(c1 - c0, NKV, D, generator=g).to(torch.bfloat16)
            att.attend(layer, q, kn, vn)
    return att


def _decode(own: OwnTokens, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b = own.k.shape[1]
    for _ in range(steps):
        own.begin_step()
        for layer in range(L):
            kv = torch.randn(2, b, NKV, D, generator=g).to(torch.bfloat16)
            own.put(layer, kv[0], kv[1])
        own.end_step()


@pytest.mark.parametrize("via", ["grpc", "native"])
def test_extension_and_decoded_tokens_are_stored_as_a_chain_of_children(server, client,
                                                                        via) -> None:
    """Through the gRPC client, or the native library's ingest (the C ABI)."""
    parent, pk, pv = _store(client, 1 if via == "grpc" else 11, f"wb-parent-{via}")
    att = _extension(pk, pv, 24, seed=2)
    own = OwnTokens(L, 2, NKV, 32, D, torch.bfloat16, "cpu")
    _decode(own, 10, seed=3)
    ext_ids, own_ids = list(range(500, 524)), list(range(600, 610))
    writer = client if via == "grpc" else native.NativeClient(server.address, timeout=60)
    wb = WriteBack(writer, parent, WriteBackOptions(flush_tokens=0, timeout_s=60))
    wb.append_extension(att, ext_ids)                 # the turn's extension
    first = wb.flush()
    wb.append_own(own, 1, torch.tensor(own_ids[:6]), 0)   # sequence 1's decoded tokens
    wb.append_own(own, 1, own_ids[6:], 6)
    last = wb.close(timeout=120)
    c1 = first.result(timeout=0)
    assert c1.parent_id == parent.context_id and c1.n_tokens == T0 + 24
    assert last.parent_id == c1.context_id and last.n_tokens == T0 + 34
    assert wb.head.context_id == last.context_id and wb.pending_bytes == 0
    assert last.provenance == ctxcache.storage_pb.PROVENANCE_INGESTED
    assert [i.method for i in last.indexes] == ["quest"]  # the parent's, by default
    # The child holds the parent's KV, then the extension's, then sequence 1's.
    k, v, n = _load(server.address, last.context_id)
    assert n == T0 + 34
    want_k = torch.cat([pk, att.k_new[:, :, :24], own.k[:, 1, :, :10]], dim=2)
    want_v = torch.cat([pv, att.v_new[:, :, :24], own.v[:, 1, :, :10]], dim=2)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # The token ids are the parent's, then those appended, in order: the same
    # appended ids and KV ingested directly give the same child.
    again = client.ingest(None, own_ids, [(own.k[i, 1, :, :10], own.v[i, 1, :, :10])
                                          for i in range(L)], parent_id=c1.context_id)
    assert again.context_id == last.context_id
    # A decode session (the C++ session core through the native library) on
    # it selects among the appended tokens and reads their stored K/V.
    with native.NativeClient(server.address, timeout=60) as nc:
        with nc.open_session(last.context_id, "quest", {"budget": 32}) as s:
            assert s.n_tokens == T0 + 34
            appended = 0
            for layer in range(L):
                heads = s.step(layer, torch.randn(NQ, D).numpy())
                assert len(heads) == NKV
                for h, hs in enumerate(heads):
                    ids = hs.ids.tolist()
                    appended += sum(i >= T0 for i in ids)
                    assert torch.equal(torch.from_numpy(hs.k.copy()),
                                       want_k[layer, h, ids].float())
            assert appended > 0


def test_flushes_every_n_tokens_and_a_full_queue_joins_the_last_batch(client) -> None:
    parent, _, _ = _store(client, 11, "wb-queue")
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(gate.wait, 60)  # holds the executor: no batch starts yet
        wb = WriteBack(client, parent, WriteBackOptions(flush_tokens=4, max_queued=2,
                                                        timeout_s=60), executor=pool)
        k, v = _kv(12, 20)
        futures = []
        for i in range(5):  # 4 tokens each: every append flushes by itself
            wb.append(range(700 + 4 * i, 704 + 4 * i), k[:, :, 4 * i:4 * i + 4],
                      v[:, :, 4 * i:4 * i + 4])
            futures.append(wb.flush())  # nothing open: the batch that took them
        # One batch in flight (not started), two waiting; the last flushes joined
        # the last waiting batch.
        assert len({id(f) for f in futures}) == 3
        assert not any(f.done() for f in futures)
        gate.set()
        infos = [f.result(timeout=120) for f in futures]
        assert [i.n_tokens for i in infos] == [T0 + 4, T0 + 8, T0 + 20, T0 + 20, T0 + 20]
        assert infos[1].parent_id == infos[0].context_id
        assert infos[2].parent_id == infos[1].context_id
        kk, vv, _ = _load_client_pages(client, infos[2].context_id, T0 + 20)
        assert torch.equal(kk[:, :, T0:], k.float()) and torch.equal(vv[:, :, T0:], v.float())
    finally:
        gate.set()
        pool.shutdown(wait=True)


def _load_client_pages(client, cid: str, n: int):
    """K, V [L, NKV, n, D] float32 from Client.fetch_pages."""
    k = torch.zeros(L, NKV, n, D)
    v = torch.zeros_like(k)
    blocks = list(range((n + 15) // 16))
    for p in client.fetch_pages(cid, [(la, h, blocks) for la in range(L) for h in range(NKV)]):
        lo = p.block * 16
        k[p.layer, p.kv_head, lo:lo + p.n_tokens] = torch.from_numpy(p.k.copy())
        v[p.layer, p.kv_head, lo:lo + p.n_tokens] = torch.from_numpy(p.v.copy())
    return k, v, n


def test_an_evicted_link_fails_the_next_flush_with_not_found(client) -> None:
    parent, _, _ = _store(client, 21, "wb-evicted")
    wb = WriteBack(client, parent, WriteBackOptions(flush_tokens=0, timeout_s=30))
    k, v = _kv(22, 6)
    wb.append([1, 2, 3], k[:, :, :3], v[:, :, :3])
    c1 = wb.flush().result(timeout=60)
    assert client.evict(c1.context_id).evicted  # the chain's head goes away mid-writeback
    wb.append([4, 5, 6], k[:, :, 3:], v[:, :, 3:])
    f = wb.flush()
    with pytest.raises(ctxcache.NotFound):
        f.result(timeout=60)
    assert isinstance(wb.error, ctxcache.NotFound)
    with pytest.raises(ctxcache.NotFound):  # later flushes and appends report it too
        wb.flush().result(timeout=0)
    with pytest.raises(ctxcache.NotFound):
        wb.append([7], k[:, :, :1], v[:, :, :1])
    assert wb.pending_bytes == 0


def test_a_killed_ctxcached_fails_the_flush_within_its_timeout(make_server) -> None:
    srv = make_server()
    with ctxcache.Client(srv.address, timeout=10, max_attempts=1) as c:
        parent, _, _ = _store(c, 31, "wb-killed")
        wb = WriteBack(c, parent, WriteBackOptions(flush_tokens=0, timeout_s=10))
        srv.proc.kill()
        srv.proc.wait(10)
        k, v = _kv(32, 5)
        t0 = time.monotonic()
        wb.append(range(5), k, v)  # returns at once: the ingest runs in the background
        f = wb.flush()
        with pytest.raises((ctxcache.Unavailable, ctxcache.DeadlineExceeded)):
            f.result(timeout=60)
        assert time.monotonic() - t0 < 60


def test_bad_appends_are_refused_before_anything_is_queued(client) -> None:
    parent, _, _ = _store(client, 41, "wb-bad")
    wb = WriteBack(client, parent, WriteBackOptions(flush_tokens=0, max_pending_bytes=4096))
    k, v = _kv(42, 8)
    with pytest.raises(ValueError, match="expected"):
        wb.append(range(8), k[:1], v[:1])
    with pytest.raises(ValueError, match="8 integer ids"):
        wb.append(range(7), k, v)
    with pytest.raises(BufferError, match="max_pending_bytes"):
        wb.append(range(8), k, v)  # 2 * 2 * 2 * 8 * 32 * 2 bytes > 4096
    assert wb.pending_bytes == 0 and wb.flush().result(timeout=0) is parent
    with pytest.raises(ValueError, match="timeout_s"):
        WriteBack(client, parent, WriteBackOptions(timeout_s=0))


def test_a_child_of_a_csa_context_needs_the_appended_tokens_queries(client) -> None:
    """A child inherits its parent's indexes; csa is built from the tokens'
    queries, so appends without q fail the flush with INVALID_ARGUMENT naming
    chunk.q (nothing stored), and the same appends with q store a child with
    csa."""
    k, v = _kv(51, T0)
    q = torch.randn(L, NQ, T0, D, generator=torch.Generator().manual_seed(52))
    parent = client.ingest(SPEC, list(range(51, 51 + T0)),
                           [(k[i], v[i], q[i]) for i in range(L)], indexes=["csa"],
                           name="wb-csa")
    before = {c.context_id for c in client.list()}
    ak, av = _kv(53, 6)
    wb = WriteBack(client, parent)
    wb.append(range(6), ak, av)
    with pytest.raises(ctxcache.InvalidArgument, match=r"n_queries=0.*chunk\.q"):
        wb.close(timeout=60)
    assert {c.context_id for c in client.list()} == before
    aq = torch.randn(L, NQ, 6, D, generator=torch.Generator().manual_seed(54))
    wb = WriteBack(client, parent)
    wb.append(range(6), ak, av, aq.to(torch.bfloat16))
    child = wb.close(timeout=60)
    assert child.n_tokens == T0 + 6 and [i.method for i in child.indexes] == ["csa"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_writeback_copies_cuda_tensors_on_a_side_stream(client) -> None:
    parent, _, _ = _store(client, 51, "wb-cuda")
    k, v = (x.cuda() for x in _kv(52, 40))
    wb = WriteBack(client, parent, WriteBackOptions(flush_tokens=0, timeout_s=60))
    ids = torch.arange(800, 840, device="cuda")
    wb.append(ids, k, v)
    wb.wait_copies()
    k.zero_()  # after wait_copies the caller's stream may overwrite the rows
    info = wb.close(timeout=120)
    kk, _, _ = _load_client_pages(client, info.context_id, T0 + 40)
    assert torch.equal(kk[:, :, T0:], _kv(52, 40)[0].float())
