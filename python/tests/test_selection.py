"""Client-side csa selection (ctxcache.torch) against the C++ session core:
the artifact parsers (CSAP, CSAC) and the session params; the C++ core in
this process through the native library (a client-mode
ctxcache.native.DecodeSession) selecting what a real ctxcached's session
selects; and the torch session core (ctxcache.torch.gpu_session) against
the C++ core through the library: its raw selections (stage 1), final
per-q-head tokens and pages.

Contexts: the tiny llama3 (2 layers, 4 q / 2 kv heads, head_dim 32: G = 2,
one subgroup) built from tokens, and an ingested synthetic model (2 layers,
16 q / 2 kv heads, head_dim 128: G = 8, two subgroups of 4) stored twice
from the same K/V/Q under two fingerprints, once per artifact format.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import struct
from typing import Dict, List

import numpy as np
import pytest

import ctxcache
from ctxcache import native
from ctxcache.torch.artifacts import CSA_HEADER_BYTES, fma_f32, parse_csa_artifact
from ctxcache.torch.tables import SKETCH_QUERY_MAX_CODE, ContextTables, SessionParams
from conftest import assert_library_steps_match_server, random_tokens, session_queries

B = 16
SYN_LAYERS, SYN_NQ, SYN_NKV, SYN_D, SYN_T = 2, 16, 2, 128, 1100


# ------------------------------------------------------------------ contexts --


@pytest.fixture(scope="module")
def nc(server):
    """The native library's client (libctxcache_c.so)."""
    with native.NativeClient(server.address, timeout=60) as c:
        yield c


def library_session(nc, ctx, params: dict) -> native.DecodeSession:
    """The C++ session core in this process through the native library: a
    client-mode csa session on ``ctx``."""
    return nc.open_session(ctx.context_id, "csa", params, client_mode=True)


@pytest.fixture(scope="module")
def llama_plain(client: ctxcache.Client) -> ctxcache.pb.ContextInfo:
    """600 tokens (37.5 pages), csa with default options, plain format."""
    return client.build(tokens=random_tokens(600, 901), name="sel-plain",
                        indexes=[("csa", {"format": "plain"})]).context


@pytest.fixture(scope="module")
def llama_compact(client: ctxcache.Client) -> ctxcache.pb.ContextInfo:
    """777 tokens, compact format, alpha 0.25 (bitmap ids), non-default
    retrieval options (backoff to 3 centroids below cosine 0.5, missing=min, a
    search period of 2)."""
    return client.build(tokens=random_tokens(777, 902), name="sel-compact",
                        indexes=[("csa", {"format": "compact", "alpha": "0.25", "tau": "3",
                                          "backoff_cos": "0.5", "missing": "min",
                                          "period": "2", "R": "20", "sinks": "2"})]).context


def _synthetic_layers(seed: int):
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(SYN_LAYERS):
        offset = rng.standard_normal((1, 1, SYN_D)).astype(np.float32)  # keys share an offset
        k = (rng.standard_normal((SYN_NKV, SYN_T, SYN_D)) + 2 * offset).astype(np.float32)
        v = rng.standard_normal((SYN_NKV, SYN_T, SYN_D)).astype(np.float32)
        q = rng.standard_normal((SYN_NQ, SYN_T, SYN_D)).astype(np.float32)
        layers.append((k, v, q))
    return layers


@pytest.fixture(scope="module")
def synthetic(client: ctxcache.Client) -> Dict[str, ctxcache.pb.ContextInfo]:
    """The same K/V/Q ingested twice (two fingerprints, so two contexts): the
    csa build is deterministic, so both hold the same tables, one per format."""
    layers = _synthetic_layers(7)
    out = {}
    for fmt in ("plain", "compact"):
        spec = {"name": "sel-synthetic", "n_layers": SYN_LAYERS, "n_q_heads": SYN_NQ,
                "n_kv_heads": SYN_NKV, "head_dim": SYN_D, "rope": {"theta": 10000.0},
                "kv_dtype": "bf16", "fingerprint": f"ctxcache-pytest-selection-{fmt}".encode()}
        out[fmt] = client.ingest(spec, list(range(5, 5 + SYN_T)), layers,
                                 indexes=[("csa", {"format": fmt, "weights": "norm"})],
                                 name=f"sel-synthetic-{fmt}")
    return out


# ------------------------------------------------------------------- parsers --


def _check_common(a, ctx: ctxcache.pb.ContextInfo) -> None:
    o = a.options
    m, C, d = o.m, o.C, ctx.model.head_dim
    assert a.version == (4 if a.compact else 2) and a.head_dim == d
    assert a.n_tokens == a.n_built == ctx.n_tokens
    assert a.L == math.ceil(o.alpha * ctx.n_tokens)
    assert a.centroids.shape == (m, C, d // m) and a.centroids.dtype == np.float32
    assert a.key_mean.shape == (d,) and a.tail_mean.shape == (m, C)
    assert a.ids.shape == a.scores.shape == (m, C, a.L)
    assert a.ids.dtype == np.int32 and a.scores.dtype == np.float16
    np.testing.assert_allclose(np.linalg.norm(a.centroids, axis=2), 1.0, atol=1e-4)
    assert a.ids.min() >= 0 and a.ids.max() < a.n_tokens
    s = np.sort(a.ids, axis=2)
    assert (np.diff(s, axis=2) > 0).all()  # unique ids per list
    assert np.isfinite(a.scores).all()
    if o.center:
        assert np.abs(a.key_mean).sum() > 0


def test_parse_plain_artifact(client: ctxcache.Client, llama_plain) -> None:
    arts = client.fetch_index(llama_plain.context_id, "csa")
    assert sorted(arts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for raw in arts.values():
        a = parse_csa_artifact(raw)
        o = a.options
        assert a.magic == "CSAP" and not a.compact and not o.compact
        # The defaults of a served context (index/csa.h CsaOptions; m by head_dim 32).
        assert (o.m, o.C, o.alpha, o.fixed_L, o.iters, o.seed, o.rho, o.recent, o.sinks,
                o.tau, o.backoff_cos, o.weights, o.missing, o.period, o.center, o.rerank) == \
            (8, 128, 0.125, 0, 8, 42, 0.05, 32, 4, 2, 0.3, "norm", "zero", 1, True, 6.0)
        _check_common(a, llama_plain)
        m, C, d, L = o.m, o.C, a.head_dim, a.L
        assert len(raw) == (CSA_HEADER_BYTES + 4 * C * d + 4 * d + 4 * m * C + 6 * m * C * L +
                            9 + (d + 2) * a.n_tokens)  # the key sketch section
        # Lists are binary min-heaps under "worse": no child beats its parent.
        sc = a.scores.astype(np.float32).reshape(m * C, L)
        ids = a.ids.reshape(m * C, L)
        child = np.arange(1, L)
        parent = (child - 1) // 2
        beats = (sc[:, parent] > sc[:, child]) | (
            (sc[:, parent] == sc[:, child]) & (ids[:, parent] < ids[:, child]))
        assert not beats.any()


def test_parse_compact_artifact(client: ctxcache.Client, llama_compact) -> None:
    arts = client.fetch_index(llama_compact.context_id, "csa")
    for raw in arts.values():
        a = parse_csa_artifact(raw)
        o = a.options
        assert a.magic == "CSAC" and a.compact and o.compact
        assert (o.tau, o.backoff_cos, o.missing, o.period, o.recent, o.sinks) == \
            (3, 0.5, "min", 2, 20, 2)
        _check_common(a, llama_compact)
        assert (np.diff(a.ids, axis=2) > 0).all()  # ascending ids
        assert a.version == 4 and a.lo is None and a.hi is None
        levels = min(16, a.L)
        assert a.q.shape == a.ids.shape and a.book.shape == (o.m, o.C, levels)
        assert a.id_coding.shape == (o.m, o.C) and set(np.unique(a.id_coding)) <= {0, 1, 2}
        assert (a.q < levels).all() and (np.diff(a.book.astype(np.float32), axis=2) >= 0).all()
        # Scores are the codebook entries of their 4-bit codes.
        want = np.take_along_axis(a.book, a.q.astype(np.int64), axis=2)
        assert np.array_equal(a.scores.view(np.uint16), want.view(np.uint16))


def test_plain_and_compact_hold_the_same_tables(client: ctxcache.Client, synthetic) -> None:
    plain = client.fetch_index(synthetic["plain"].context_id, "csa")
    compact = client.fetch_index(synthetic["compact"].context_id, "csa")
    assert sorted(plain) == sorted(compact) == [(l, h) for l in range(SYN_LAYERS)
                                                for h in range(SYN_NKV)]
    for key in plain:
        p, c = parse_csa_artifact(plain[key]), parse_csa_artifact(compact[key])
        assert (p.magic, c.magic) == ("CSAP", "CSAC")
        _check_common(p, synthetic["plain"])
        _check_common(c, synthetic["compact"])
        # Default options: m 16 (d 128), alpha 0.125: Elias-Fano ids (coding 2).
        assert (c.options.m, c.options.alpha) == (16, 0.125)
        assert (c.id_coding == 2).all()
        assert len(compact[key]) < len(plain[key]) / 3
        assert np.array_equal(p.centroids, c.centroids)
        assert np.array_equal(p.key_mean, c.key_mean)
        assert np.array_equal(p.tail_mean, c.tail_mean)
        # Same lists: sort the plain (heap-ordered) entries by id.
        order = np.argsort(p.ids, axis=2)
        p_ids = np.take_along_axis(p.ids, order, axis=2)
        p_sc = np.take_along_axis(p.scores, order, axis=2).astype(np.float32)
        assert np.array_equal(p_ids, c.ids)
        # 4-bit codebook quantization (SerializeCompact, in fp32): each code is
        # the nearest codebook entry to the plain score (the first on a tie).
        book = c.book.astype(np.float32)
        dist = np.abs(p_sc[..., None] - book[:, :, None, :])
        assert np.array_equal(c.q, np.argmin(dist, axis=3))
        err = np.abs(c.scores.astype(np.float32) - p_sc)
        assert np.array_equal(err, dist.min(axis=3))


def test_parse_rejects_bad_artifacts(client: ctxcache.Client, llama_plain, llama_compact) -> None:
    plain = client.fetch_index(llama_plain.context_id, "csa", layers=[0], kv_heads=[0])[(0, 0)]
    compact = client.fetch_index(llama_compact.context_id, "csa", layers=[0],
                                 kv_heads=[0])[(0, 0)]
    with pytest.raises(ValueError, match="bad magic"):
        parse_csa_artifact(b"TAC1" + plain[4:])
    with pytest.raises(ValueError, match="bad magic"):
        parse_csa_artifact(plain[:6])
    for v in (0, 3):
        with pytest.raises(ValueError, match=f"unsupported format version {v}"):
            parse_csa_artifact(plain[:4] + struct.pack("<I", v) + plain[8:])
    for raw in (plain, compact):
        for cut in (60, CSA_HEADER_BYTES + 100, len(raw) - 1):
            with pytest.raises(ValueError, match="truncated|bad list"):
                parse_csa_artifact(raw[:cut])
        with pytest.raises(ValueError, match="trailing bytes"):
            parse_csa_artifact(raw + b"\0")
    with pytest.raises(ValueError, match="corrupt options"):
        parse_csa_artifact(plain[:8] + struct.pack("<i", 0) + plain[12:])  # m = 0
    with pytest.raises(ValueError, match="corrupt shape"):
        parse_csa_artifact(plain[:90] + struct.pack("<i", 31) + plain[94:])  # d % m != 0
    a = parse_csa_artifact(plain)
    sketch_at = len(plain) - 9 - (a.head_dim + 2) * a.n_tokens
    ids_at = sketch_at - 6 * a.m * a.C * a.L
    bad_id = plain[:ids_at] + struct.pack("<i", a.n_tokens) + plain[ids_at + 4:]
    with pytest.raises(ValueError, match="out of range"):
        parse_csa_artifact(bad_id)
    lists_at = CSA_HEADER_BYTES + 4 * a.C * a.head_dim + 4 * a.head_dim + 4 * a.m * a.C
    # CSAC version 2: the score-bits byte, then list 0's id coding byte (a
    # bitmap here: 195 of 777 ids), its first bitmap byte.
    assert compact[lists_at] == 4 and compact[lists_at + 1] == 1
    with pytest.raises(ValueError, match="bad score bits"):
        parse_csa_artifact(compact[:lists_at] + b"\x08" + compact[lists_at + 1:])
    with pytest.raises(ValueError, match="bad list id coding"):
        parse_csa_artifact(compact[:lists_at + 1] + b"\x07" + compact[lists_at + 2:])
    flipped = bytes([compact[lists_at + 2] ^ 1])
    with pytest.raises(ValueError, match="bad list bitmap"):  # one id more or less
        parse_csa_artifact(compact[:lists_at + 2] + flipped + compact[lists_at + 3:])
    # The key sketch section (CSAP 2 / CSAC 4): rerank f64, bits u8, codes, scales.
    for raw in (plain, compact):
        r = parse_csa_artifact(raw)
        at = len(raw) - 9 - (r.head_dim + 2) * r.n_tokens
        assert struct.unpack_from("<dB", raw, at) == (6.0, 8)
        with pytest.raises(ValueError, match="disagree"):
            parse_csa_artifact(raw[:at] + struct.pack("<d", 0.0) + raw[at + 8:])
        with pytest.raises(ValueError, match="bad rerank"):
            parse_csa_artifact(raw[:at] + struct.pack("<d", 0.5) + raw[at + 8:])
        with pytest.raises(ValueError, match="bad key sketch bits"):
            parse_csa_artifact(raw[:at + 8] + b"\x04" + raw[at + 9:])
        with pytest.raises(ValueError, match="bad key sketch code"):
            parse_csa_artifact(raw[:at + 9] + b"\x80" + raw[at + 10:])
        with pytest.raises(ValueError, match="truncated key sketch"):
            parse_csa_artifact(raw[:at + 4])
        # Version 1 (CSAP) and 3 (CSAC) artifacts had no sketch: rerank 0.
        old = raw[:4] + struct.pack("<I", 3 if raw[:4] == b"CSAC" else 1) + raw[8:at]
        o = parse_csa_artifact(old)
        assert o.options.rerank == 0 and o.sketch is None


def test_key_sketch_reproduces_the_stored_keys(client: ctxcache.Client, synthetic) -> None:
    # k - key_mean ~ scale * code within scale / 2 per dimension, against the
    # ingested keys (plus bf16 rounding, should the build see stored keys).
    ctx = synthetic["compact"]
    a = parse_csa_artifact(client.fetch_index(ctx.context_id, "csa", layers=[0],
                                              kv_heads=[1])[(0, 1)])
    assert a.sketch.shape == (a.n_tokens, a.head_dim) and a.sketch.dtype == np.int8
    keys = _synthetic_layers(7)[0][0][1]  # what the fixture ingested: layer 0, kv head 1
    x = keys - a.key_mean
    scale = a.sketch_scale.astype(np.float32)[:, None]
    err = np.abs(scale * a.sketch.astype(np.float32) - x)
    assert (err <= 0.5 * scale + np.abs(keys) * 2.0 ** -8 + 1e-6).all()
    # The codes use the whole int8 range: each token's largest |x| maps to ~127.
    assert np.abs(a.sketch).max(axis=1).min() >= 120


def test_parse_rejects_bad_elias_fano_ids(client: ctxcache.Client, synthetic) -> None:
    raw = client.fetch_index(synthetic["compact"].context_id, "csa", layers=[0],
                             kv_heads=[0])[(0, 0)]
    a = parse_csa_artifact(raw)
    lists_at = CSA_HEADER_BYTES + 4 * a.C * a.head_dim + 4 * a.head_dim + 4 * a.m * a.C
    assert raw[lists_at] == 4 and raw[lists_at + 1] == 2  # bits, then list 0: Elias-Fano
    k_at = lists_at + 2
    k = raw[k_at]
    upper_at = k_at + 1 + (a.L * k + 7) // 8
    upper_bits = a.L + ((a.n_tokens - 1) >> k) + 1
    with pytest.raises(ValueError, match="bad Elias-Fano low bits"):
        parse_csa_artifact(raw[:k_at] + bytes([32]) + raw[k_at + 1:])
    bits = np.unpackbits(np.frombuffer(raw, np.uint8, (upper_bits + 7) // 8, upper_at),
                         bitorder="little")
    clear = int(np.flatnonzero(bits[:upper_bits] == 0)[0])  # one id more than L
    extra = bytearray(raw)
    extra[upper_at + clear // 8] |= 1 << (clear % 8)
    with pytest.raises(ValueError, match="bad Elias-Fano ids"):
        parse_csa_artifact(bytes(extra))
    with pytest.raises(ValueError, match="truncated"):
        parse_csa_artifact(raw[:upper_at + 1])
    # A version 2 artifact cannot hold coding 2.
    with pytest.raises(ValueError, match="bad list id coding"):
        parse_csa_artifact(raw[:4] + struct.pack("<I", 2) + raw[8:])


# ------------------------------------------------- float32 emulation helpers --


def test_fma_f32_is_correctly_rounded() -> None:
    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no libm to compare with")
    fmaf = ctypes.CDLL(name).fmaf
    fmaf.restype = ctypes.c_float
    fmaf.argtypes = [ctypes.c_float] * 3
    rng = np.random.default_rng(3)
    n = 20000
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)).astype(np.float32)
    c = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
    c[::2] = (-(a[::2].astype(np.float64) * b[::2])).astype(np.float32)  # cancellation
    want = np.array([fmaf(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)],
                    dtype=np.float32)
    assert np.array_equal(fma_f32(a, b, c).view(np.uint32), want.view(np.uint32))


def test_session_params_parse_like_the_server() -> None:
    p = SessionParams.parse({})
    assert (p.rho, p.budget, p.page_fraction, p.whole_pages, p.subgroup, p.recent_blocks) == \
        (0.05, 0, 0.05, True, 4, 1)
    p = SessionParams.parse({"budget": 24})
    assert (p.budget, p.page_fraction, p.whole_pages) == (24, 0.0, False)
    p = SessionParams.parse({"rho": "0.2", "page_fraction": "1"})
    assert (p.page_fraction, p.whole_pages) == (0.0, False)
    assert p.token_budget(1000) == 200 and SessionParams.parse({"budget": 5000}).token_budget(
        300) == 300
    for bad in ({"rho": "0"}, {"budget": "0.5"}, {"whole_pages": "2"}, {"nope": "1"},
                {"rho": "x"}, {"subgroup": "0"}, {"recent_blocks": "-1"},
                {"estimate_mass": "2"}):
        with pytest.raises(ValueError, match="session param"):
            SessionParams.parse(bad)
    # The server's estimate_mass param: 0 is accepted; 1 asks for what only a
    # server-side session computes, and says so.
    assert SessionParams.parse({"estimate_mass": "0"}) == SessionParams.parse({})
    with pytest.raises(ValueError, match="estimate_mass=1.*server-side session"):
        SessionParams.parse({"estimate_mass": 1})
    # csa's per-session rerank: 0 or [1, 64], csa only.
    assert SessionParams.parse({"rerank": "8"}).rerank == 8.0
    assert SessionParams.parse({}).rerank is None
    for bad in ("0.5", "65", "-1"):
        with pytest.raises(ValueError, match=r"rerank must be 0 or in \[1, 64\]"):
            SessionParams.parse({"rerank": bad})
    with pytest.raises(ValueError, match="rerank applies to method csa only"):
        SessionParams.parse({"rerank": 4}, method="quest")


def test_session_rerank_changes_the_selection_and_is_checked_by_the_server(
        client: ctxcache.Client, nc, llama_plain) -> None:
    """The per-session rerank reaches the selection on both sides (the
    PARAMS cases compare them step by step); here: it changes what csa picks
    on this context, and bad values are INVALID_ARGUMENT from the server
    with the same wording as the client-side parser."""
    m = llama_plain.model
    arts = client.fetch_index(llama_plain.context_id, "csa")
    q = session_queries(np.random.default_rng(5), m.n_q_heads, m.head_dim, 0)
    picks = {}
    for r in (None, 0, 2):
        with library_session(nc, llama_plain,
                             {"budget": 40} if r is None else {"budget": 40, "rerank": r}) as s:
            picks[r] = [h.per_q_head[0].tolist() for h in s.step(1, q)]
    assert picks[0] != picks[None] and picks[2] != picks[0]
    # The torch core's tables: the build value when the session names none.
    assert all(a.options.rerank == 6.0 for a in ContextTables(arts, n_q_heads=m.n_q_heads)
               .artifacts.values())
    assert all(a.options.rerank == 2.0 for a in ContextTables(arts, m.n_q_heads, {"rerank": 2})
               .artifacts.values())
    for params, match in (({"rerank": "0.5"}, r"rerank must be 0 or in \[1, 64\]"),
                          ({"rerank": "x"}, "is not a number")):
        with pytest.raises(ctxcache.errors.InvalidArgument, match=match):
            client.open_session(llama_plain.context_id, "csa", params).close()
    with pytest.raises(ctxcache.errors.InvalidArgument, match="rerank applies to method csa only"):
        client.open_session(llama_plain.context_id, "quest", {"rerank": 4}).close()


# ------------------------------------------------ sessions against the server --


PARAMS = [
    {},  # rho 0.05, page cap 5% ranked by mass, whole pages
    {"rho": 0.12},
    {"budget": 24},  # token-level: no page cap, no widening
    {"rho": 0.03, "subgroup": 1, "recent_blocks": 2},
    {"rho": 0.08, "page_fraction": 0.25, "whole_pages": 0, "subgroup": 3},
    {"rerank": 0},  # a per-session stage-2 factor: the lists alone
    {"rho": 0.08, "rerank": 12},
]


def _compare_session(client: ctxcache.Client, nc, ctx: ctxcache.pb.ContextInfo, params: dict,
                     n_steps: int, seed: int) -> int:
    """Runs n_steps steps of every layer through a server session and through
    the C++ core in this process (the library's client-mode session) on the
    same queries; asserts identical selections and fetched pages. Returns
    the number of layer-steps compared."""
    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    rng = np.random.default_rng(seed)
    compared = 0
    with client.open_session(ctx.context_id, "csa", params) as s, \
            library_session(nc, ctx, params) as lib:
        assert lib.shape[:5] == (ctx.n_tokens, m.n_layers, m.n_q_heads, m.n_kv_heads,
                                 m.head_dim)
        for i in range(n_steps):
            for layer in range(m.n_layers):
                q = session_queries(rng, m.n_q_heads, m.head_dim, i)
                r = s.step(layer, q)
                assert_library_steps_match_server(lib.step(layer, q), r, g,
                                                  f"{params} step {i} layer {layer}")
                compared += 1
    return compared


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in
                                                                  p.items()) or "defaults")
def test_session_steps_match_server_llama(client: ctxcache.Client, nc, llama_plain,
                                          llama_compact, params: dict) -> None:
    assert _compare_session(client, nc, llama_plain, params, n_steps=4, seed=11) == 8
    assert _compare_session(client, nc, llama_compact, params, n_steps=4, seed=12) == 8


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in
                                                                  p.items()) or "defaults")
def test_session_steps_match_server_synthetic(client: ctxcache.Client, nc, synthetic,
                                              params: dict) -> None:
    for fmt, seed in (("plain", 21), ("compact", 22)):
        assert _compare_session(client, nc, synthetic[fmt], params, n_steps=3, seed=seed) == 6


def _compare_torch_session(client: ctxcache.Client, nc, ctx: ctxcache.pb.ContextInfo,
                           params: dict, n_steps: int, seed: int,
                           device: str = "cpu") -> Dict[str, float]:
    """The torch session core (ctxcache.torch.gpu_session) against the C++
    core through the library on the same queries: per layer-step and kv
    head, the raw selections (stage 1: a second library session with the
    same params but no page cap and no widening, ``page_fraction=1``,
    ``whole_pages=0``), the final per-q-head tokens and the pages. Returns
    the share of identical ones and the lowest Jaccard overlap of a raw
    selection."""
    torch = pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import TorchCsaSession

    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    arts = client.fetch_index(ctx.context_id, "csa")
    mine = TorchCsaSession(arts, n_q_heads=m.n_q_heads, params=params, device=device)
    rng = np.random.default_rng(seed)
    same_sel = same_final = same_pages = total = 0
    worst = 1.0
    with library_session(nc, ctx, params) as lib, \
            library_session(nc, ctx, {**params, "page_fraction": 1, "whole_pages": 0}) as raw:
        for i in range(n_steps):
            for layer in range(m.n_layers):
                q = session_queries(rng, m.n_q_heads, m.head_dim, i)
                want, want_raw = lib.step(layer, q), raw.step(layer, q)
                plan = mine.step(layer, torch.from_numpy(q).to(device))
                for h, (st, sel) in enumerate(zip(want, want_raw)):
                    total += 1
                    sel_ok = final_ok = True
                    for j in range(g):
                        a = set(sel.per_q_head[j].tolist())
                        b = set(torch.nonzero(plan.selected[h, j])[:, 0].cpu().tolist())
                        worst = min(worst, len(a & b) / max(1, len(a | b)))
                        sel_ok &= a == b
                        final_ok &= (st.per_q_head[j].tolist() ==
                                     torch.nonzero(plan.token_mask[h, j])[:, 0].cpu().tolist())
                    same_sel += sel_ok
                    same_final += final_ok
                    same_pages += st.pages.tolist() == plan.page_ids(h).cpu().tolist()
    return {"selections": same_sel / total, "final": same_final / total,
            "pages": same_pages / total, "worst_jaccard": worst}


def _torch_devices() -> List[str]:
    try:
        import torch
    except ImportError:
        return ["cpu"]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", _torch_devices())
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in
                                                                  p.items()) or "defaults")
def test_torch_session_core_agrees_with_the_cpp_core(client: ctxcache.Client, nc, llama_plain,
                                                     llama_compact, synthetic,
                                                     params: dict, device: str) -> None:
    # Backoff, missing=min, period 2 (llama_compact); G = 8 with two
    # subgroups (synthetic); zero sub-queries and fp16-coarse queries with
    # many tied sums (session_queries). Ties at the budget's edge may resolve
    # differently (float sums in another order), nothing else.
    for ctx, seed in ((llama_plain, 31), (llama_compact, 32), (synthetic["plain"], 33),
                      (synthetic["compact"], 34)):
        r = _compare_torch_session(client, nc, ctx, params, n_steps=6, seed=seed,
                                   device=device)
        # Identical everywhere on Debian's torch 1.13 CPU build.
        assert r["selections"] >= 0.95 and r["pages"] >= 0.95, (ctx.name, r)
        assert r["worst_jaccard"] >= 0.95, (ctx.name, r)


def test_torch_csa_tables_int16_and_int32_ids_plan_alike(client: ctxcache.Client, llama_compact,
                                                         monkeypatch) -> None:
    # The device tables hold list ids as int16 (offset) up to
    # INT16_ID_TOKENS tokens, int32 beyond, and scores as the artifacts'
    # float16: both id widths give the same plans.
    torch = pytest.importorskip("torch")
    from ctxcache.torch import gpu_session

    ctx = llama_compact
    m = ctx.model
    arts = client.fetch_index(ctx.context_id, "csa")
    narrow = gpu_session.TorchCsaSession(arts, n_q_heads=m.n_q_heads)
    monkeypatch.setattr(gpu_session, "INT16_ID_TOKENS", 0)
    wide = gpu_session.TorchCsaSession(arts, n_q_heads=m.n_q_heads)
    assert narrow.layers[0].ids.dtype == torch.int16 and narrow.layers[0].id_offset == 32768
    assert wide.layers[0].ids.dtype == torch.int32 and wide.layers[0].id_offset == 0
    assert narrow.layers[0].scores.dtype == torch.float16
    rng = np.random.default_rng(5)
    for step in range(3):
        for layer in range(m.n_layers):
            q = torch.as_tensor(session_queries(rng, m.n_q_heads, m.head_dim, step))
            a, b = narrow.step(layer, q), wide.step(layer, q)
            for f in ("selected", "token_mask", "pages"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (step, layer, f)


def test_client_side_decode_steps_attend_the_selected_rows(client: ctxcache.Client, nc,
                                                           synthetic) -> None:
    # The HF client-side steps (ctxcache.torch.hf): the C++ core's selections
    # through the library (hf.LibrarySession, with their K/V) and the torch
    # core's plan (its token mask over the context's K/V), attention over
    # them plus two decoded tokens; both equal attention over the C++ core's
    # rows taken from the context's full KV.
    torch = pytest.importorskip("torch")
    from ctxcache.torch import hf
    from ctxcache.torch.gpu_session import TorchCsaSession

    ctx = synthetic["compact"]
    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    arts = client.fetch_index(ctx.context_id, "csa")
    n_pages = (ctx.n_tokens + B - 1) // B
    full = {}
    for layer in range(m.n_layers):
        pages = client.fetch_pages(ctx.context_id, [(layer, h, list(range(n_pages)))
                                                    for h in range(m.n_kv_heads)])
        for h in range(m.n_kv_heads):
            rows = [p for p in pages if p.kv_head == h]
            full[(layer, h)] = (torch.as_tensor(np.concatenate([p.k for p in rows])),
                                torch.as_tensor(np.concatenate([p.v for p in rows])))
    exact = hf.LibrarySession(library_session(nc, ctx, {}))
    planner = TorchCsaSession(arts, n_q_heads=m.n_q_heads)
    rng = np.random.default_rng(41)
    reference = library_session(nc, ctx, {})
    for step in range(3):
        for layer in range(m.n_layers):
            q = torch.as_tensor(session_queries(rng, m.n_q_heads, m.head_dim, step))
            # Seeded (a global torch RNG made the rounding depend on test order).
            dk = torch.as_tensor(rng.standard_normal((m.n_kv_heads, 2, m.head_dim))).float()
            dv = torch.as_tensor(rng.standard_normal((m.n_kv_heads, 2, m.head_dim))).float()
            want = torch.zeros(m.n_q_heads, m.head_dim)
            for h, st in enumerate(reference.step(layer, q.numpy())):
                fk, fv = full[(layer, h)]
                for j in range(g):
                    ids = torch.as_tensor(np.asarray(st.per_q_head[j], dtype=np.int64))
                    k = torch.cat([fk[ids], dk[h]])
                    v = torch.cat([fv[ids], dv[h]])
                    w = torch.softmax(k @ q[h * g + j] * 0.125, dim=0)
                    want[h * g + j] = w @ v
            k, v, mask = hf.gather_selected(exact.step(layer, q), m.n_q_heads, "cpu",
                                            torch.float32, ctx.n_tokens)
            got = {"exact": hf.attend(q, k, v, mask, dk, dv, 0.125),
                   "torch": hf.attend(q, *_context_rows(full, layer, m.n_kv_heads),
                                      planner.plan_queries(layer, q).token_mask, dk, dv,
                                      0.125)}
            for name, x in got.items():
                # float32 attention summed in another order differs by up to
                # ~2e-5; a different page or mask differs by ~1e-1.
                torch.testing.assert_close(x, want, rtol=1e-4, atol=1e-4, msg=name)
    exact.close()
    reference.close()


def _context_rows(full, layer: int, n_kv_heads: int) -> tuple:
    """The context's K and V of one layer, [H, n, d] each, from full[(layer, h)]."""
    import torch
    return (torch.stack([full[(layer, h)][0] for h in range(n_kv_heads)]),
            torch.stack([full[(layer, h)][1] for h in range(n_kv_heads)]))


def _sketch_query(q: np.ndarray):
    """The query side of a csa sketch score (SketchQuery, index/csa.cc): qs =
    max|q| / 2047 in float32 and qi = round(q / qs), ties to even."""
    qs = np.float32(np.max(np.abs(q)) / np.float32(SKETCH_QUERY_MAX_CODE))
    return qs, np.rint(q / qs).astype(np.int64)


def _sketch_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """CsaSelector::SketchScores (index/csa.cc) for one query over int8 codes
    [k, d] and fp16 scales [k]: float32(double(the exact integer dot) *
    (double(qs) * double(scale)))."""
    qs, qi = _sketch_query(q)
    dots = codes.astype(np.int64) @ qi
    return (dots.astype(np.float64) *
            (np.float64(qs) * scales.astype(np.float64))).astype(np.float32)


@pytest.mark.parametrize("device", _torch_devices())
def test_torch_sketch_scores_are_the_cpp_ones(device: str) -> None:
    # csa stage 2 on torch (the Triton kernel on CUDA, gather + bmm on the CPU)
    # gives the C++ core's float32 scores bit for bit (its formula:
    # _sketch_scores), with queries up to the largest codes (|qi| = 2047) and
    # scales across the fp16 range.
    torch = pytest.importorskip("torch")
    import types
    from ctxcache.torch import gpu_session
    rng = np.random.default_rng(5)
    h, g, n, d, r = 2, 4, 300, 64, 77
    codes = rng.integers(-127, 128, (h, n, d)).astype(np.int8)
    scales = (rng.random((h, n)) * 10.0 ** rng.integers(-6, 2, (h, n))).astype(np.float16)
    q = (rng.standard_normal((h * g, d)) * 10.0 ** rng.integers(-3, 3, (h * g, 1))).astype(
        np.float32)
    rows = np.stack([np.sort(rng.choice(n, r, replace=False)) for _ in range(h * g)])
    lay = types.SimpleNamespace(
        sketch=torch.as_tensor(codes, device=device),
        sketch_scale=torch.as_tensor(scales.astype(np.float64), device=device))
    qi = np.stack([_sketch_query(q[i])[1] for i in range(h * g)])
    qs = np.array([[_sketch_query(q[i])[0]] for i in range(h * g)], dtype=np.float32)
    assert np.abs(qi).max() == 2047
    got = gpu_session._sketch_scores(lay, torch.as_tensor(rows, device=device),
                                     torch.as_tensor(qi.astype(np.float32), device=device),
                                     torch.as_tensor(qs, device=device), g).cpu().numpy()
    for i in range(h * g):
        want = _sketch_scores(q[i], codes[i // g][rows[i]], scales[i // g][rows[i]])
        assert np.array_equal(got[i].view(np.uint32), want.view(np.uint32)), i
    # The candidates' column indices from a mask, ascending.
    mask = torch.as_tensor(rng.random((3, 50)) < 0.3)
    mask[:, :20] = False
    mask[:, 20:26] = True
    count = int(mask.sum(1).min())
    mask = mask & (torch.cumsum(mask.int(), 1) <= count)
    idx = gpu_session._mask_indices(mask, count)
    assert idx.tolist() == [torch.nonzero(m)[:, 0].tolist() for m in mask]
