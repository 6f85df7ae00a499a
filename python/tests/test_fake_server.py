"""The client against a scripted in-process gRPC server (the generated servicers).

Covers what a healthy ctxcached never does on purpose: exact retry counts on
UNAVAILABLE, index artifacts with a bad crc32c, multi-batch steps, in-band
errors of any code, a build stream without DONE. Needs no ctxcached, so it also
checks a wheel on a host with other grpcio/protobuf versions (e.g. a GPU
machine): ``python -m pytest python/tests/test_unit.py python/tests/test_fake_server.py``.
"""
from __future__ import annotations

from concurrent import futures
from typing import Iterator, List

import grpc
import numpy as np
import pytest

import ctxcache
from ctxcache import tensors
from ctxcache.crc32c import crc32c

pb, st = ctxcache.pb, ctxcache.storage_pb
CID = "0123456789abcdef0123456789abcdef"
BAD = "ffffffffffffffffffffffffffffffff"
L, NQ, NKV, D, B, T = 2, 4, 2, 8, 16, 40


def model() -> st.ModelSpec:
    return st.ModelSpec(name="fake", n_layers=L, n_q_heads=NQ, n_kv_heads=NKV, head_dim=D,
                        kv_dtype=st.DTYPE_BF16, fingerprint=b"f")


def kv_rows(layer: int, head: int, block: int, n: int) -> np.ndarray:
    base = layer * 1000 + head * 100 + block * B
    return (np.arange(base, base + n, dtype=np.float32)[:, None]
            + np.arange(D, dtype=np.float32)[None, :] / 8)


def make_page(layer: int, head: int, block: int, dtype: int = st.DTYPE_BF16) -> pb.Page:
    n = min(B, T - block * B)
    k, v = kv_rows(layer, head, block, n), -kv_rows(layer, head, block, n)
    if dtype == st.DTYPE_BF16:
        kb, vb = tensors.float32_to_bf16(k).tobytes(), tensors.float32_to_bf16(v).tobytes()
    elif dtype == st.DTYPE_F16:
        kb, vb = k.astype("<f2").tobytes(), v.astype("<f2").tobytes()
    else:
        kb, vb = k.astype("<f4").tobytes(), v.astype("<f4").tobytes()
    return pb.Page(layer=layer, kv_head=head, block=block, n_tokens=n, dtype=dtype, k=kb, v=vb,
                   crc32c=crc32c(kb + vb))


class Admin:
    def __init__(self) -> None:
        self.unavailable_left = 0
        self.stats_calls = 0
        self.evict_calls = 0

    def GetStats(self, request, context):
        self.stats_calls += 1
        if self.unavailable_left > 0:
            self.unavailable_left -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb.ServerStats(version="fake", n_contexts=3)

    def EvictContext(self, request, context):
        self.evict_calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

    def GetContext(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"tenant may not read {request.context_id}")

    def BuildContext(self, request, context):
        n = len(request.tokens.ids)
        yield pb.BuildProgress(phase=pb.BuildProgress.PREFILL, tokens_total=n)
        if request.name == "no-done":
            return
        yield pb.BuildProgress(phase=pb.BuildProgress.DONE, tokens_total=n, tokens_prefilled=n,
                               context=pb.ContextInfo(context_id=CID, n_tokens=n))


class Decode:
    ARTIFACT = np.random.default_rng(0).integers(0, 256, (5 << 20) // 2, dtype=np.uint8).tobytes()

    def FetchIndex(self, request, context):
        data = self.ARTIFACT
        chunks = [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
        for head in range(NKV):
            crc = crc32c(data) ^ (1 if request.context_id == BAD and head == 1 else 0)
            for i, c in enumerate(chunks):
                yield pb.IndexChunk(layer=0, kv_head=head, method="csa", chunk_index=i,
                                    n_chunks=len(chunks), data=c, crc32c=crc,
                                    total_bytes=len(data))

    def FetchPages(self, request, context):
        dtypes = [st.DTYPE_BF16, st.DTYPE_F16, st.DTYPE_F32]
        pages = [make_page(t.layer, t.kv_head, b, dtypes[b % 3])
                 for t in request.tables for b in t.blocks]
        yield pb.PageBatch(pages=pages[:1])
        yield pb.PageBatch(pages=pages[1:], last=True)

    def Decode(self, request_iterator, context):
        n_tokens = T
        for req in request_iterator:
            rid = req.request_id
            which = req.WhichOneof("msg")
            if which == "open":
                info = pb.ContextInfo(context_id=req.open.context_id, n_tokens=T, block_tokens=B)
                info.model.CopyFrom(model())
                yield pb.DecodeResponse(request_id=rid, opened=pb.SessionOpened(
                    session_id="s1", context=info))
            elif which == "step":
                layer = req.step.layer
                if layer == 1 and req.step.queries.shape[0] == NQ and \
                        np.frombuffer(req.step.queries.data, "<f4")[0] == 99:
                    yield pb.DecodeResponse(request_id=rid, error=pb.RequestError(
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="busy"))
                    continue
                # q heads 0,1 -> kv 0; 2,3 -> kv 1. Head 3 selects token 39 (block 2).
                sel = {0: [0, 5, 17], 1: [1, 20], 2: [3], 3: [3, 39]}
                blocks = {0: [0, 1], 1: [0, 2]}
                missing = req.step.queries.shape[0] == NQ and \
                    np.frombuffer(req.step.queries.data, "<f4")[0] == 42
                step = pb.StepResult(layer=layer, n_page_batches=2,
                                     stats=pb.SelectStats(keys_scored=7))
                for q, ids in sel.items():
                    step.selections.add(q_head=q, token_ids=ids)
                for h, bl in blocks.items():
                    step.page_tables.add(layer=layer, kv_head=h, blocks=bl)
                yield pb.DecodeResponse(request_id=rid, step=step)
                pages = [make_page(layer, h, b) for h, bl in blocks.items() for b in bl
                         if not (missing and (h, b) == (1, 2))]
                yield pb.DecodeResponse(request_id=rid, pages=pb.PageBatch(pages=pages[:2]))
                yield pb.DecodeResponse(request_id=rid,
                                        pages=pb.PageBatch(pages=pages[2:], last=True))
            elif which == "append":
                n_tokens += 1
                yield pb.DecodeResponse(request_id=rid,
                                        appended=pb.AppendResult(n_tokens=n_tokens))
            elif which == "close":
                yield pb.DecodeResponse(request_id=rid, closed=pb.SessionClosed())
                return


def add_service(server: grpc.Server, impl: object, service: str) -> None:
    """Serves impl's methods named like the RPCs of ctxcache.v1.<service>
    (generic handlers: no dependency on the optional *_pb2_grpc modules)."""
    svc = pb.DESCRIPTOR.services_by_name[service]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            getattr(impl, m.name),
            request_deserializer=getattr(pb, m.input_type.name).FromString,
            response_serializer=getattr(pb, m.output_type.name).SerializeToString)
        for m in svc.methods if hasattr(impl, m.name)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(svc.full_name,
                                                                          handlers),))


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    admin, decode = Admin(), Decode()
    add_service(server, admin, "ContextAdmin")
    add_service(server, decode, "DecodeService")
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with ctxcache.Client(f"127.0.0.1:{port}", timeout=10, initial_backoff=0.01) as c:
        yield c, admin
    server.stop(None)


def test_generated_grpc_stubs_when_built_with_a_grpc_plugin(fake) -> None:
    # Optional modules: present when the build had grpc_python_plugin or grpcio-tools.
    pb_grpc = pytest.importorskip("ctxcache.v1.ctxcache_service_pb2_grpc")
    client, _ = fake
    assert hasattr(pb_grpc, "add_ContextAdminServicer_to_server")
    stub = pb_grpc.ContextAdminStub(client._channel)
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).n_contexts == 3


def test_unavailable_is_retried_exactly_max_attempts_times(fake) -> None:
    client, admin = fake
    admin.unavailable_left, admin.stats_calls = 2, 0
    assert client.stats().version == "fake"  # 2 failures, then success
    assert admin.stats_calls == 3
    admin.unavailable_left, admin.stats_calls = 10, 0
    with pytest.raises(ctxcache.Unavailable, match="warming up"):
        client.stats()
    assert admin.stats_calls == client.max_attempts == 5
    admin.unavailable_left = 0


# Regression: evict was retried on UNAVAILABLE, so an eviction that reached the
# server before the connection dropped came back as NOT_FOUND.
def test_evict_is_not_retried(fake) -> None:
    client, admin = fake
    with pytest.raises(ctxcache.Unavailable, match="draining"):
        client.evict(CID)
    assert admin.evict_calls == 1


def test_retry_sleeps_are_jittered_within_the_backoff(fake, monkeypatch) -> None:
    client, admin = fake
    slept: List[float] = []
    import importlib
    monkeypatch.setattr(importlib.import_module("ctxcache.client").time, "sleep", slept.append)
    admin.unavailable_left, admin.stats_calls = 4, 0
    client.stats()
    bounds = [client.initial_backoff * 2 ** i for i in range(4)]
    assert len(slept) == 4 and all(b / 2 <= s <= b for s, b in zip(slept, bounds)), slept
    assert slept != bounds  # jittered, not the bounds themselves
    admin.unavailable_left = 0


def test_other_codes_map_without_retry(fake) -> None:
    client, _ = fake
    with pytest.raises(ctxcache.PermissionDenied, match="tenant may not read") as info:
        client.get(CID)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and info.value.rpc == "GetContext"


def test_build_without_done_is_internal(fake) -> None:
    client, _ = fake
    seen: List[pb.BuildProgress] = []
    done = client.build(tokens=[1, 2, 3], on_progress=seen.append)
    assert done.context.context_id == CID and done.context.n_tokens == 3 and len(seen) == 2
    with pytest.raises(ctxcache.Internal, match="without a final message"):
        client.build(tokens=[1], name="no-done")


def test_fetch_index_reassembles_chunks_and_checks_crc(fake) -> None:
    client, _ = fake
    arts = client.fetch_index(CID, "csa")
    assert sorted(arts) == [(0, 0), (0, 1)]
    assert arts[(0, 0)] == Decode.ARTIFACT and arts[(0, 1)] == Decode.ARTIFACT
    with pytest.raises(ctxcache.DataLoss, match="kv head 1"):
        client.fetch_index(BAD, "csa")


def test_fetch_pages_decodes_every_dtype(fake) -> None:
    client, _ = fake
    pages = client.fetch_pages(CID, [(1, 0, [0, 1, 2])])
    assert [p.dtype for p in pages] == ["bf16", "f16", "f32"]
    for p in pages:
        want = kv_rows(1, 0, p.block, p.n_tokens)
        assert p.k.dtype == np.float32 and p.k.shape == (p.n_tokens, D)
        assert np.allclose(p.k, want, rtol=1e-2) and np.allclose(p.v, -want, rtol=1e-2)
    assert pages[2].n_tokens == T - 2 * B
    raw = client.fetch_pages(CID, [(1, 0, [0, 1, 2])], dtype="raw")
    assert [r.k.dtype for r in raw] == [np.uint16, np.float16, np.float32]


def test_session_assembles_batches_and_maps_in_band_errors(fake) -> None:
    client, _ = fake
    with client.open_session(CID, "csa", {"rho": 0.5}) as s:
        assert s.session_id == "s1" and s.n_tokens == T and s.model.name == "fake"
        r = s.step(0, np.ones((NQ, D), np.float32))
        assert r.stats.keys_scored == 7 and r.n_pages == 4
        h0, h1 = r.heads
        assert h0.blocks == [0, 1] and h1.blocks == [0, 2]
        assert [x.tolist() for x in h0.per_q_head] == [[0, 5, 17], [1, 20]]
        assert h1.ids.tolist() == [3, 39]
        assert r.selections[3].tolist() == [3, 39]
        assert np.allclose(h1.k[1], kv_rows(0, 1, 2, 8)[39 - 32], rtol=1e-2)
        assert np.array_equal(h1.k[1], h1.page(2).k[39 - 32])
        bad = np.ones((NQ, D), np.float32)
        bad[0, 0] = 99
        with pytest.raises(ctxcache.ResourceExhausted, match="busy"):
            s.step(1, bad)
        assert not s.closed
        assert s.append(np.zeros((L, NKV, D)), np.zeros((L, NKV, D))) == T + 1
        missing = np.ones((NQ, D), np.float32)
        missing[0, 0] = 42  # the server leaves out the page of a selected token
        with pytest.raises(ctxcache.DataLoss, match="no page"):
            s.step(0, missing)
    assert s.closed
