"""The native client library (python/ctxcache/native.py over libctxcache_c.so)
against the real ctxcached: bulk loads into numpy arrays and torch tensors
equal the pages FetchPages serves, in any layout and layer order; bad
buffers are refused naming the field with nothing written; a corrupted page
is DataLoss; index fetches equal the gRPC client's."""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ctxcache
from ctxcache import native

from conftest import random_tokens


@pytest.fixture(scope="module")
def nc(server):
    with native.NativeClient(server.address, timeout=60) as c:
        yield c


def reference_kv(client, info, layers):
    """[len(layers), n_kv, n, d] K and V (uint16 bf16 bits) through FetchPages."""
    m, n = info.model, int(info.n_tokens)
    n_pages = (n + 15) // 16
    k = np.zeros((len(layers), m.n_kv_heads, n, m.head_dim), np.uint16)
    v = np.zeros_like(k)
    for slot, layer in enumerate(layers):
        pages = client.fetch_pages(info.context_id,
                                   [(layer, h, list(range(n_pages))) for h in range(m.n_kv_heads)],
                                   dtype="raw")
        for p in pages:
            t = int(p.n_tokens)
            k[slot, p.kv_head, p.block * 16:p.block * 16 + t] = p.k.reshape(t, -1)
            v[slot, p.kv_head, p.block * 16:p.block * 16 + t] = p.v.reshape(t, -1)
    return k, v


def test_shape(nc, built):
    s = nc.context(built.context_id)
    assert (s.n_tokens, s.n_layers, s.n_kv_heads, s.head_dim) == (300, 2, 2, 32)
    assert s.kv_dtype == "bf16" and s.state == 2


def test_dense_load_equals_fetch_pages(nc, client, built):
    s = nc.context(built.context_id)
    k = np.full(s.kv_shape(), 0xABAB, np.uint16)
    v = np.full(s.kv_shape(), 0xABAB, np.uint16)
    got = nc.load_kv(built.context_id, k, v, frame_bytes=2048, streams=2)
    assert got["layers_done"] == 2 and got["bytes_done"] == got["bytes_total"] == 2 * k.nbytes
    assert got["frames"] > 4
    want_k, want_v = reference_kv(client, built, [0, 1])
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_fetch_kv_frame_defaults(nc, client):
    """Without frame_bytes, a page table's frames carry about 1 MiB (reading,
    sending and placing overlap within a call) and a whole layer's 4 MiB:
    600 pages of 2 KiB (head_dim 32, bf16) are 2 frames for a table (512 +
    88 pages) and 1 frame for each kv head of a layer."""
    from ctxcache.v1 import ctxcache_service_pb2 as pb
    t, d = 600 * 16, 32
    rng = np.random.default_rng(7)
    layers = [(rng.standard_normal((1, t, d)).astype(np.float32),
               rng.standard_normal((1, t, d)).astype(np.float32))]
    spec = {"name": "frames", "n_layers": 1, "n_q_heads": 2, "n_kv_heads": 1, "head_dim": d,
            "rope": {"theta": 10000.0}, "kv_dtype": "bf16",
            "fingerprint": b"ctxcache-python-tests-frames-000"}
    cid = nc.ingest(spec, list(range(9, 9 + t)), layers, indexes=["streaming"]).context_id
    table = pb.PageTable(layer=0, kv_head=0, blocks=list(range(600)))
    frames = list(client._decode.FetchKV(pb.FetchKVRequest(context_id=cid, tables=[table])))
    assert [f.n_blocks for f in frames] == [512, 88]
    frames = list(client._decode.FetchKV(pb.FetchKVRequest(context_id=cid, layers=[0])))
    assert [f.n_blocks for f in frames] == [600]
    frames = list(client._decode.FetchKV(pb.FetchKVRequest(context_id=cid, tables=[table],
                                                           frame_bytes=4 << 20)))
    assert [f.n_blocks for f in frames] == [600]
    client.evict(cid)


def test_fetch_kv_page_tables(nc, client, built):
    """FetchKV with page tables (what fetch_pages_into sends): frames list
    their scattered pages in `blocks`, several per frame, with each page's
    crc32c; the server refuses tables beside layers and bad tables, naming
    the field. fetch_pages_into puts those pages where a load puts them."""
    import grpc

    from ctxcache.v1 import ctxcache_service_pb2 as pb
    cid = built.context_id
    table = pb.PageTable(layer=1, kv_head=0, blocks=[0, 3, 7, 18])
    frames = list(client._decode.FetchKV(pb.FetchKVRequest(context_id=cid, tables=[table],
                                                           frame_bytes=2 * 2048)))
    assert [list(f.blocks) for f in frames] == [[0, 3], [7, 18]]
    assert all(len(f.page_crc32c) == f.n_blocks == 2 for f in frames)
    for bad, field in ((pb.FetchKVRequest(context_id=cid, layers=[0], tables=[table]), "tables"),
                       (pb.FetchKVRequest(context_id=cid, tables=[
                           table, pb.PageTable(layer=0, kv_head=1, blocks=[4, 4])]),
                        "tables[1].blocks[1]"),
                       (pb.FetchKVRequest(context_id=cid, tables=[
                           pb.PageTable(layer=2, kv_head=0, blocks=[1])]), "tables[0].layer")):
        with pytest.raises(grpc.RpcError) as e:
            list(client._decode.FetchKV(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    s = nc.context(cid)
    k = np.full(s.kv_shape(), 0xABAB, np.uint16)
    v = np.full(s.kv_shape(), 0xABAB, np.uint16)
    nc.fetch_pages_into(cid, [(1, 0, table.blocks), (0, 1, [2])], k, v)
    want_k, want_v = reference_kv(client, built, [0, 1])
    for layer, head, blocks in ((1, 0, table.blocks), (0, 1, [2])):
        for b in blocks:
            rows = slice(16 * b, min(16 * b + 16, s.n_tokens))
            np.testing.assert_array_equal(k[layer, head, rows], want_k[layer, head, rows])
            np.testing.assert_array_equal(v[layer, head, rows], want_v[layer, head, rows])
    # Nothing else was written (no stored bf16 equals the 0xABAB filler).
    written = sum(min(16, s.n_tokens - 16 * b) for b in [*table.blocks, 2]) * s.head_dim
    assert int((k != 0xABAB).sum()) == int((v != 0xABAB).sum()) == written


def test_permuted_view_reversed_layers_and_priority(nc, client, built):
    # Memory as [token][slot][head][dim]; passed as a (slot, head, token, dim) view.
    s = nc.context(built.context_id)
    base_k = np.zeros((s.n_tokens, 2, s.n_kv_heads, s.head_dim), np.uint16)
    base_v = np.zeros_like(base_k)
    k, v = base_k.transpose(1, 2, 0, 3), base_v.transpose(1, 2, 0, 3)
    with nc.start_load_kv(built.context_id, k, v, layers=[1, 0], streams=1) as load:
        load.wait_layer(0)
        assert load.progress()["layers_done"] >= 1
        with pytest.raises(ctxcache.InvalidArgument, match="layer: 5"):
            load.prioritize(5)
        load.wait()
        assert load.done
    want_k, want_v = reference_kv(client, built, [1, 0])
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_torch_bf16_tensor(nc, client, built):
    torch = pytest.importorskip("torch")
    s = nc.context(built.context_id)
    k = torch.zeros(s.kv_shape(1), dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    nc.load_kv(built.context_id, k, v, layers=[1])
    want_k, want_v = reference_kv(client, built, [1])
    np.testing.assert_array_equal(k.view(torch.int16).numpy().view(np.uint16), want_k)
    np.testing.assert_array_equal(v.view(torch.int16).numpy().view(np.uint16), want_v)
    with pytest.raises(ctxcache.InvalidArgument, match="k: dtype float32"):
        nc.load_kv(built.context_id, k.float(), v.float(), layers=[1])


def test_bad_buffers_are_refused_and_nothing_is_written(nc, built):
    s = nc.context(built.context_id)
    k = np.full(s.kv_shape(), 0xABAB, np.uint16)
    v = np.full(s.kv_shape(), 0xABAB, np.uint16)
    cases = [
        ("k: shape", k[:, :, :-1], v[:, :, :-1], None),
        ("k: dtype float32", k.astype(np.float32), v.astype(np.float32), None),
        ("v: strides", k, np.full(s.kv_shape()[::-1], 1, np.uint16).transpose(3, 2, 1, 0), None),
        ("k: strides", k[..., ::-1], v[..., ::-1], None),
        ("options.layers: 2 out of range", k, v, [0, 2]),
        ("options.layers: 1 given twice", k, v, [1, 1]),
        ("k: a list", k.tolist(), v, None),
    ]
    for what, kk, vv, layers in cases:
        with pytest.raises(ctxcache.InvalidArgument, match=what.replace("[", r"\[")):
            nc.load_kv(built.context_id, kk, vv, layers=layers)
    assert (k == 0xABAB).all() and (v == 0xABAB).all()
    with pytest.raises(ctxcache.NotFound) as e:
        nc.load_kv("00112233445566778899aabbccddeeff", k, v)
    # The RPC's name once, in front of the library's message.
    assert str(e.value).count(f"{e.value.rpc}:") == 1 and e.value.rpc, str(e.value)
    with pytest.raises(ctxcache.InvalidArgument, match="context_id"):
        nc.context("nope")


def test_loads_run_without_the_gil(nc, built):
    # Another Python thread keeps running while loads block in the library.
    s = nc.context(built.context_id)
    ticks, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=spin)
    t.start()
    try:
        k = np.zeros(s.kv_shape(), np.uint16)
        v = np.zeros_like(k)
        for _ in range(5):
            nc.load_kv(built.context_id, k, v, frame_bytes=1024)
    finally:
        stop.set()
        t.join()
    assert ticks


def test_fetch_index_equals_grpc_client(nc, client, built):
    got = nc.fetch_index(built.context_id, "csa")
    want = client.fetch_index(built.context_id, "csa")
    assert set(got) == {(l, h) for l in range(2) for h in range(2)}
    assert got == want


def test_corrupted_page_is_data_loss(make_server):
    srv = make_server(["--fault-corrupt-pages-for-testing"])
    with native.NativeClient(srv.address, max_attempts=1) as c:
        cid = c.build_tokens(random_tokens(100, 9))
        s = c.context(cid)
        k = np.zeros(s.kv_shape(), np.uint16)
        with pytest.raises(ctxcache.DataLoss, match="crc32c mismatch.*block 0"):
            c.load_kv(cid, k, k.copy())


def segment_fds(pid: int) -> int:
    """Open fds of process ``pid`` that are MapKV segments."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "memfd:ctxcache-kv" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def test_map_kv_equals_load(nc, built):
    s = nc.context(built.context_id)
    k = np.zeros(s.kv_shape(), np.uint16)
    v = np.zeros_like(k)
    nc.load_kv(built.context_id, k, v)
    with nc.map_kv(built.context_id) as m:
        m.wait()
        a = m.array()
        assert a.shape == (2, 2) + s.kv_shape()[1:] and not a.flags.writeable
        np.testing.assert_array_equal(a[:, 0], k)
        np.testing.assert_array_equal(a[:, 1], v)
    with nc.map_kv(built.context_id, layers=[1]) as m:
        m.wait_layer(1)
        np.testing.assert_array_equal(m.array()[0, 0], k[1])
        with pytest.raises(ctxcache.InvalidArgument, match="layer: 0"):
            m.wait_layer(0)


def mapping_inode(address: int) -> int:
    """The inode of this process's mapping that starts at ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if int(fields[0].split("-")[0], 16) == address:
                return int(fields[4])
    raise AssertionError(f"no mapping at {address:#x}")


def test_shm_cache_hands_out_one_sealed_segment(make_server):
    """With --shm-cache-mb, a second MapKV of the same context and layers
    maps the segment the first one filled (same memory, same bytes); nobody
    can write it, not even through the server's own descriptor; other layers
    get a segment of their own; evicting the context frees its segments."""
    srv = make_server(["--shm-cache-mb", "64"])
    pid = srv.proc.pid
    with native.NativeClient(srv.address, timeout=60) as c, \
            ctxcache.Client(srv.address, timeout=60) as admin:
        cid = c.build_tokens(random_tokens(300, 11))
        s = c.context(cid)
        k = np.zeros(s.kv_shape(), np.uint16)
        v = np.zeros_like(k)
        c.load_kv(cid, k, v)
        with c.map_kv(cid) as m1:
            m1.wait()
            first = mapping_inode(m1.address)
        assert segment_fds(pid) == 1  # kept by the cache
        with c.map_kv(cid) as m2:
            m2.wait()
            assert mapping_inode(m2.address) == first
            np.testing.assert_array_equal(m2.array()[:, 0], k)
            np.testing.assert_array_equal(m2.array()[:, 1], v)
        with c.map_kv(cid, layers=[1]) as m3:
            m3.wait()
            assert mapping_inode(m3.address) != first
            np.testing.assert_array_equal(m3.array()[0, 0], k[1])
        assert segment_fds(pid) == 2
        # The cache's own descriptor, reopened read-write, still cannot write.
        fd_dir = f"/proc/{pid}/fd"
        kept = [f for f in os.listdir(fd_dir)
                if "memfd:ctxcache-kv" in os.readlink(os.path.join(fd_dir, f))]
        fd = os.open(os.path.join(fd_dir, kept[0]), os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
        finally:
            os.close(fd)
        admin.evict(cid)
        assert segment_fds(pid) == 0
        with pytest.raises(ctxcache.NotFound):
            c.map_kv(cid)


WORKER = r"""
import sys, grpc
from ctxcache import client as cl
from ctxcache.v1 import ctxcache_service_pb2 as pb
ch = grpc.insecure_channel(sys.argv[1])
stub = cl._make_stub(ch, "DecodeService")
call = stub.MapKV(pb.MapKVRequest(context_id=sys.argv[2]))
first = next(call)
print(first.segment.token, flush=True)
sys.stdin.read()  # never redeems; killed here
"""


def test_killed_worker_leaves_no_segment_behind(server, built):
    """A worker that asked for a segment and died before taking it: the
    server drops the segment when the call breaks; an unknown token gets
    nothing."""
    pid = server.proc.pid
    before = segment_fds(pid)
    w = subprocess.Popen([sys.executable, "-c", WORKER, server.address, built.context_id],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    token = w.stdout.readline().strip()
    assert len(token) == 32
    assert segment_fds(pid) == before + 1  # offered, waiting to be taken
    w.kill()
    w.wait()
    for _ in range(1000):  # bounded: the server notices the broken call
        if segment_fds(pid) == before:
            break
        time.sleep(0.01)
    assert segment_fds(pid) == before
    # The token died with the call.
    path = os.path.join(server.data_dir, "shm.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(token.encode())
        msg, anc, _, _ = s.recvmsg(1, socket.CMSG_SPACE(4))
        assert msg == b"E" and not anc


def test_closed_handles_raise_instead_of_reaching_the_library(server, built):
    c = native.NativeClient(server.address, timeout=60)
    s = c.context(built.context_id)
    k = np.zeros(s.kv_shape(), np.uint16)
    v = np.zeros_like(k)
    load = c.start_load_kv(built.context_id, k, v)
    load.wait()
    load.close()
    load.wait_layer(0)  # finished before close: nothing to wait for
    assert load.wait()["layers_done"] == s.n_layers
    c.close()
    with pytest.raises(ValueError, match="NativeClient is closed"):
        c.context(built.context_id)


METHODS = ("csa", "tactic", "lfps", "quest", "streaming", "oracle", "full")


@pytest.fixture(scope="module")
def all_methods(client):
    """A 700-token context with every method's index (a short last page)."""
    indexes = [m for m in METHODS if m != "full"]
    return client.build(tokens=random_tokens(700, 21), indexes=indexes).context


@pytest.mark.parametrize("method", METHODS)
def test_session_core_through_the_library_equals_the_server_with_appends(
        server, all_methods, method):
    """The C++ session core in this process (client mode, through the C ABI)
    selects what ctxcached's does, step after step, across appends; both
    return the stored pages' K/V."""
    cid = all_methods.context_id
    rng = np.random.default_rng(22)
    params = {"rho": "0.1"} if method not in ("full", "streaming") else {}
    with native.NativeClient(server.address, timeout=60) as c:
        s = c.context(cid)
        with c.open_session(cid, method, params, client_mode=True) as here, \
                c.open_session(cid, method, params, client_mode=False) as there:
            for step in range(3):
                for layer in range(s.n_layers):
                    q = rng.standard_normal((s.n_q_heads, s.head_dim)).astype(np.float32)
                    a, b = here.step(layer, q), there.step(layer, q)
                    assert len(a) == len(b) == s.n_kv_heads
                    for h, (x, y) in enumerate(zip(a, b)):
                        where = f"{method} step {step} layer {layer} kv head {h}"
                        assert len(x.per_q_head) == s.n_q_heads // s.n_kv_heads, where
                        for g, (qa, qb) in enumerate(zip(x.per_q_head, y.per_q_head)):
                            assert np.array_equal(qa, qb), f"{where} q head {g}"
                        assert np.array_equal(x.ids, y.ids), where
                        assert np.array_equal(x.pages, y.pages), where
                        assert x.k.shape == (len(x.ids), s.head_dim)
                        # Stored rows are the same bytes; the server keeps the
                        # appended rows in the kv dtype (bf16), client mode in fp32.
                        old = x.ids < s.n_tokens
                        assert np.array_equal(x.k[old], y.k[old]), where
                        assert np.array_equal(x.v[old], y.v[old]), where
                        np.testing.assert_allclose(x.k[~old], y.k[~old], rtol=1e-2, atol=1e-2)
                        np.testing.assert_allclose(x.v[~old], y.v[~old], rtol=1e-2, atol=1e-2)
                k = rng.standard_normal((s.n_layers, s.n_kv_heads, s.head_dim))
                v = rng.standard_normal((s.n_layers, s.n_kv_heads, s.head_dim))
                q = rng.standard_normal((s.n_layers, s.n_q_heads, s.head_dim))
                here.append(k, v, q)
                there.append(k, v, q)
                assert here.n_tokens == there.n_tokens == s.n_tokens + step + 1
        with pytest.raises(ctxcache.InvalidArgument, match="queries: shape"):
            with c.open_session(cid, method, params) as bad:
                bad.step(0, np.zeros((1, 1), np.float32))


def test_session_steps_count_bytes_and_cache_hits(nc, all_methods):
    """The library reports what each step moved: client mode fetches a
    query's pages once and then finds them in its page cache; server mode
    receives them every step. Totals are the sums of the steps."""
    cid = all_methods.context_id
    s = nc.context(cid)
    q = np.random.default_rng(5).standard_normal((s.n_q_heads, s.head_dim)).astype(np.float32)
    with nc.open_session(cid, "quest", {"rho": "0.1"}, client_mode=True) as here, \
            nc.open_session(cid, "quest", {"rho": "0.1"}, client_mode=False) as there:
        pages = sum(len(h.pages) for h in here.step(0, q))
        first = dict(here.last_step)
        here.step(0, q)
        again = dict(here.last_step)
        there.step(0, q)
        assert pages > 0
        assert first["pages_fetched"] == pages and first["cache_hits"] == 0
        assert first["bytes_received"] > 0
        assert again == {"bytes_received": 0, "pages_fetched": 0, "cache_hits": pages}
        assert there.last_step == dict(first)   # the server sends the same pages
        assert here.totals == {k: first[k] + again[k] for k in first}
        cache = here.page_cache_stats()
        assert cache["misses"] == pages and cache["hits"] >= pages and cache["bytes"] > 0
        assert there.page_cache_stats()["hits"] == 0


def test_session_params_are_checked(nc, all_methods):
    # The separator inside a value would split it: refused, naming the pair
    # (the library's own check of the string is in c_api_test).
    with pytest.raises(ctxcache.InvalidArgument, match="params: 'rho'='0.1;x'"):
        nc.open_session(all_methods.context_id, "quest", {"rho": "0.1;x"})
    with pytest.raises(ctxcache.InvalidArgument, match="rho"):
        nc.open_session(all_methods.context_id, "quest", {"rho": "2.5"})
