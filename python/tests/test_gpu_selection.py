"""Client-side selection for quest, streaming and oracle against a real
ctxcached: the torch session core (ctxcache.torch.gpu_session, on every
available device) gives the selections and pages of the C++ session core,
run in this process through the native library (a client-mode
ctxcache.native.DecodeSession), and the server session's page tables; the
library's selections equal the server session's.

Contexts: two demo documents (tests/data/demo) built as text by a real
ctxcached with the golden llama3 (2 layers, 4 q / 2 kv heads, head_dim 32),
their token counts not a multiple of the page size (a partial last page); the
second with a Quest page of 12 tokens (not the store's 16). Plus the
synthetic model of test_selection.py (16 q / 2 kv heads, d 128: two
subgroups of 4 q heads).
"""
from __future__ import annotations

import contextlib
import struct
from typing import List

import numpy as np
import pytest

import ctxcache
from ctxcache import native
from ctxcache.torch.artifacts import (parse_oracle_artifact, parse_quest_artifact,
                                      parse_streaming_artifact)
from conftest import REPO, assert_library_steps_match_server, session_queries

B = 16
DEMO = REPO + "/tests/data/demo/"
SYN_LAYERS, SYN_NQ, SYN_NKV, SYN_D, SYN_T = 2, 16, 2, 128, 1001

PARAMS = [
    {},  # rho 0.05, page cap 5% ranked by count (mass for oracle), whole pages
    {"rho": 0.12},
    {"budget": 37},  # token-level: no page cap, no widening
    {"rho": 0.03, "subgroup": 1, "recent_blocks": 2},
    {"rho": 0.2, "page_fraction": 0.1, "whole_pages": 0, "subgroup": 3},
]
# (document, tokens, Quest page): partial last pages (601, 777 tokens), a
# Quest page that is not the store's (12), and whole pages only (640).
DEMO_SPECS = [("document.txt", 601, 16), ("vim_help.txt", 777, 12), ("r_admin.txt", 640, 16)]
PARAM_IDS = [",".join(f"{k}={v}" for k, v in p.items()) or "defaults" for p in PARAMS]


def _demo_tokens(name: str, n: int) -> List[int]:
    """The first n bytes of a demo document as token ids (byte + 1: the
    golden llama3 ships no tokenizer; its vocabulary has 512 ids)."""
    with open(DEMO + name, "rb") as f:
        return [b + 1 for b in f.read()[:n]]


@pytest.fixture(scope="module")
def demo_contexts(client: ctxcache.Client) -> List[ctxcache.pb.ContextInfo]:
    out = []
    for name, n, page in DEMO_SPECS:
        info = client.build(tokens=_demo_tokens(name, n), name=f"gpusel-{name}",
                            indexes=[("quest", {"page": str(page)})]).context
        assert info.n_tokens == n
        out.append(info)
    return out


@pytest.fixture(scope="module")
def synthetic(client: ctxcache.Client) -> ctxcache.pb.ContextInfo:
    rng = np.random.default_rng(17)
    layers = []
    for _ in range(SYN_LAYERS):
        offset = rng.standard_normal((1, 1, SYN_D)).astype(np.float32)
        k = (rng.standard_normal((SYN_NKV, SYN_T, SYN_D)) + 2 * offset).astype(np.float32)
        v = rng.standard_normal((SYN_NKV, SYN_T, SYN_D)).astype(np.float32)
        q = rng.standard_normal((SYN_NQ, SYN_T, SYN_D)).astype(np.float32)
        layers.append((k, v, q))
    spec = {"name": "gpusel-synthetic", "n_layers": SYN_LAYERS, "n_q_heads": SYN_NQ,
            "n_kv_heads": SYN_NKV, "head_dim": SYN_D, "rope": {"theta": 10000.0},
            "kv_dtype": "bf16", "fingerprint": b"ctxcache-pytest-gpusel"}
    return client.ingest(spec, list(range(5, 5 + SYN_T)), layers,
                         indexes=[("quest", {"page": "16"})], name="gpusel-synthetic")


def _contexts(demo_contexts, synthetic) -> List[ctxcache.pb.ContextInfo]:
    return [*demo_contexts, synthetic]


def context_keys(client: ctxcache.Client, ctx: ctxcache.pb.ContextInfo) -> np.ndarray:
    """[n_layers, n_kv_heads, n, d] float32: the stored keys (bf16 widened),
    what a server session's oracle scores."""
    m = ctx.model
    n_pages = (ctx.n_tokens + B - 1) // B
    out = np.zeros((m.n_layers, m.n_kv_heads, ctx.n_tokens, m.head_dim), dtype=np.float32)
    for layer in range(m.n_layers):
        pages = client.fetch_pages(ctx.context_id, [(layer, h, list(range(n_pages)))
                                                    for h in range(m.n_kv_heads)])
        for p in pages:
            out[layer, p.kv_head, p.block * B:p.block * B + p.n_tokens] = p.k
    return out


@pytest.fixture(scope="module")
def nc(server):
    """The native library's client (libctxcache_c.so)."""
    with native.NativeClient(server.address, timeout=60) as c:
        yield c


def library_session(nc, ctx, method: str, params: dict) -> native.DecodeSession:
    """The C++ session core in this process through the native library: a
    client-mode decode session of ``method`` on ``ctx``."""
    return nc.open_session(ctx.context_id, method, params, client_mode=True)


def _compare_with_server(client, nc, ctx, method: str, params: dict, n_steps: int, seed: int,
                         keys=None, devices=()) -> int:
    """n_steps steps of every layer through a server session, the C++ core
    through the library and a torch session per device; asserts that the
    library selects what the server does, and that each torch session gives
    the library's per-q-head tokens and pages and the server's page tables.
    Returns layer-steps compared."""
    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    torch_sessions = {}
    if devices:
        import torch
        from ctxcache.torch.gpu_session import torch_session

        arts = client.fetch_index(ctx.context_id, method)
        for dev in devices:
            # bf16 keys (as stored; exact) stay bf16 on the device.
            tkeys = None if keys is None else torch.as_tensor(keys).to(dev, torch.bfloat16)
            torch_sessions[dev] = torch_session(method, arts, n_q_heads=m.n_q_heads,
                                                params=params, device=dev, keys=tkeys)
    rng = np.random.default_rng(seed)
    compared = 0
    # Streaming and Quest are exact on every device (no arithmetic, or
    # float32 elementwise ops in the C++ order); oracle's q.k is a matmul
    # whose summation order depends on the device and its BLAS: near-ties at
    # the budget's edge may differ (identical on Debian's torch 1.13 CPU).
    exact_torch = method != "oracle"
    identical = {dev: 0 for dev in torch_sessions}
    worst = {dev: 1.0 for dev in torch_sessions}
    with client.open_session(ctx.context_id, method, params) as s, \
            library_session(nc, ctx, method, params) as lib:
        for i in range(n_steps):
            for layer in range(m.n_layers):
                q = session_queries(rng, m.n_q_heads, m.head_dim, i)
                r = s.step(layer, q)
                heads = lib.step(layer, q)
                where = f"{ctx.name} {method} {params} step {i} layer {layer}"
                assert_library_steps_match_server(heads, r, g, where)
                want_tables = sorted(r.page_tables)
                for dev, ts in torch_sessions.items():
                    import torch

                    plan = ts.step(layer, torch.from_numpy(q).to(dev))
                    same = True
                    for qh in range(m.n_q_heads):
                        got = torch.nonzero(plan.token_mask[qh // g, qh % g])[:, 0].cpu()
                        want = heads[qh // g].per_q_head[qh % g].tolist()
                        a, b = set(got.tolist()), set(want)
                        worst[dev] = min(worst[dev], len(a & b) / max(1, len(a | b)))
                        same &= got.tolist() == want
                    tables = sorted(
                        (h, sgi, torch.nonzero(plan.table_pages[h, sgi])[:, 0].cpu().tolist())
                        for h in range(m.n_kv_heads) for sgi in range(plan.table_pages.shape[1]))
                    same &= tables == want_tables
                    same &= all(plan.page_ids(h).cpu().tolist() == head.pages.tolist()
                                for h, head in enumerate(heads))
                    if exact_torch:
                        assert same, f"{where} {dev}"
                    identical[dev] += same
                compared += 1
    for dev in torch_sessions:
        assert identical[dev] >= compared - 1 and worst[dev] >= 0.9, \
            (ctx.name, method, params, dev, identical[dev], compared, worst[dev])
    return compared


def _torch_devices() -> List[str]:
    try:
        import torch
    except ImportError:
        return []
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


# ------------------------------------------------------------------ parsers --


def test_parse_quest_streaming_oracle_artifacts(client, demo_contexts) -> None:
    for ctx, (_, _, page) in zip(demo_contexts, DEMO_SPECS):
        n, d = ctx.n_tokens, ctx.model.head_dim
        arts = client.fetch_index(ctx.context_id, "quest")
        assert sorted(arts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        keys = context_keys(client, ctx)
        for (layer, h), raw in arts.items():
            a = parse_quest_artifact(raw)
            p = (n + page - 1) // page
            # The store's keys are bf16, so their bounds are too: version 2,
            # bf16 bounds (half version 1's float32 ones).
            assert (a.magic, a.version, a.n_tokens, a.head_dim, a.page_size, a.rho) == \
                ("QST1", 2, n, d, page, 0.05)
            assert len(raw) == 32 + 4 * p * d
            # The bounds are the min/max of each page's stored keys (built
            # from the same bf16-rounded keys the store holds).
            k = keys[layer, h]
            want_min = np.stack([k[i * page:(i + 1) * page].min(0) for i in range(p)])
            want_max = np.stack([k[i * page:(i + 1) * page].max(0) for i in range(p)])
            np.testing.assert_array_equal(a.page_min, want_min)
            np.testing.assert_array_equal(a.page_max, want_max)
        for (layer, h), raw in client.fetch_index(ctx.context_id, "streaming").items():
            a = parse_streaming_artifact(raw)
            assert (a.magic, a.n_tokens, a.head_dim, a.n_sink, a.rho) == ("STR1", n, d, 4, 0.05)
        for (layer, h), raw in client.fetch_index(ctx.context_id, "oracle").items():
            a = parse_oracle_artifact(raw)
            assert (a.magic, a.n_tokens, a.head_dim, a.rho) == ("ORCL", n, d, 0.05)


def test_parse_rejects_bad_quest_streaming_oracle(client, demo_contexts) -> None:
    ctx = demo_contexts[1]
    q = client.fetch_index(ctx.context_id, "quest", layers=[0], kv_heads=[0])[(0, 0)]
    s = client.fetch_index(ctx.context_id, "streaming", layers=[0], kv_heads=[0])[(0, 0)]
    o = client.fetch_index(ctx.context_id, "oracle", layers=[0], kv_heads=[0])[(0, 0)]
    with pytest.raises(ValueError, match="quest: bad magic"):
        parse_quest_artifact(s)
    with pytest.raises(ValueError, match="quest: bad magic"):
        parse_quest_artifact(q[:3])
    with pytest.raises(ValueError, match="unsupported format version 3"):
        parse_quest_artifact(q[:4] + struct.pack("<I", 3) + q[8:])
    # Version 1 (float32 bounds) of the same bounds parses to the same arrays.
    a2 = parse_quest_artifact(q)
    v1 = (q[:4] + struct.pack("<I", 1) + q[8:32] + a2.page_min.astype("<f4").tobytes()
          + a2.page_max.astype("<f4").tobytes())
    a1 = parse_quest_artifact(v1)
    assert a1.version == 1 and np.array_equal(a1.page_min, a2.page_min) \
        and np.array_equal(a1.page_max, a2.page_max)
    with pytest.raises(ValueError, match="quest artifact: truncated"):
        parse_quest_artifact(v1[:-2])
    with pytest.raises(ValueError, match="truncated header"):
        parse_quest_artifact(q[:31])
    for cut in (32, len(q) - 4):
        with pytest.raises(ValueError, match="quest artifact: truncated"):
            parse_quest_artifact(q[:cut])
    with pytest.raises(ValueError, match="trailing bytes"):
        parse_quest_artifact(q + b"\0\0\0\0")
    with pytest.raises(ValueError, match="corrupt page size 0"):
        parse_quest_artifact(q[:20] + struct.pack("<i", 0) + q[24:])
    with pytest.raises(ValueError, match="corrupt rho"):
        parse_quest_artifact(q[:24] + struct.pack("<d", 1.5) + q[32:])
    with pytest.raises(ValueError, match="corrupt header"):
        parse_quest_artifact(q[:16] + struct.pack("<i", 4097) + q[20:])
    # One page bound of a different page count: the size no longer matches.
    with pytest.raises(ValueError, match="quest artifact: truncated"):
        parse_quest_artifact(q[:8] + struct.pack("<q", ctx.n_tokens + 12) + q[16:])
    with pytest.raises(ValueError, match="not finite"):
        parse_quest_artifact(q[:32] + struct.pack("<f", float("nan")) + q[36:])
    with pytest.raises(ValueError, match="truncated or oversized"):
        parse_streaming_artifact(s + b"\0")
    with pytest.raises(ValueError, match="streaming artifact: corrupt fields"):
        parse_streaming_artifact(s[:20] + struct.pack("<i", -1) + s[24:])
    with pytest.raises(ValueError, match="oracle artifact: truncated"):
        parse_oracle_artifact(o[:27])
    with pytest.raises(ValueError, match="corrupt n_tokens/head_dim"):
        parse_oracle_artifact(o[:8] + struct.pack("<q", 0) + o[16:])
    with pytest.raises(ValueError, match="oracle artifact: corrupt rho"):
        parse_oracle_artifact(o[:20] + struct.pack("<d", 0.0))
    parse_oracle_artifact(o + b"\0")  # like the loader: trailing bytes are not checked


# ------------------------------------------- budgets, ties and the exact top k --


def test_streaming_and_quest_budgets_match_the_library(client, nc, demo_contexts) -> None:
    # Token-level budgets (no page cap, no widening) around a Quest page of
    # 12 tokens (not the store's 16) and the partial last page: the torch
    # core selects what the C++ core does, per q head; streaming keeps the 4
    # sinks and the most recent tokens; Quest's bounds hold for every key of
    # their page.
    torch = pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import quest_page_scores_torch, torch_session

    ctx = demo_contexts[1]  # Quest page 12
    m = ctx.model
    n, g, layer = ctx.n_tokens, m.n_q_heads // m.n_kv_heads, 1
    q = np.random.default_rng(3).standard_normal((m.n_q_heads, m.head_dim)).astype(np.float32)
    for method in ("streaming", "quest"):
        arts = client.fetch_index(ctx.context_id, method)
        for budget in (1, 3, 12, 13, 30, 50, 100, n, n + 5):
            with library_session(nc, ctx, method, {"budget": budget}) as lib:
                heads = lib.step(layer, q)
            if method == "streaming":
                k = min(budget, n)
                sinks = min(4, k)
                want = list(range(sinks)) + list(range(max(sinks, n - (k - sinks)), n))
                assert all(h.per_q_head[j].tolist() == want for h in heads for j in range(g))
            for dev in _torch_devices():
                ts = torch_session(method, arts, n_q_heads=m.n_q_heads,
                                   params={"budget": budget}, device=dev)
                plan = ts.step(layer, torch.from_numpy(q).to(dev))
                for qh in range(m.n_q_heads):
                    got = torch.nonzero(plan.token_mask[qh // g, qh % g])[:, 0].cpu().tolist()
                    assert got == heads[qh // g].per_q_head[qh % g].tolist(), \
                        (method, budget, dev, qh)
    ts = torch_session("quest", client.fetch_index(ctx.context_id, "quest"),
                       n_q_heads=m.n_q_heads)
    page, mn, mx = ts.bounds[layer]
    assert page == 12
    scores = quest_page_scores_torch(torch.from_numpy(q).view(m.n_kv_heads, g, -1), mn, mx)
    keys = context_keys(client, ctx)[layer]
    for h in range(m.n_kv_heads):
        dots = keys[h].astype(np.float64) @ q[h * g:(h + 1) * g].T.astype(np.float64)  # [n, G]
        for p in range(scores.shape[-1]):
            assert (dots[p * 12:(p + 1) * 12].max(0) <= scores[h, :, p].numpy() + 1e-3).all()


def test_ties_go_to_the_lower_page_and_id(client, nc, demo_contexts) -> None:
    # Zero queries bound every Quest page by 0 and score every key 0: the
    # lowest pages (quest) and ids (oracle) win the ties, in the C++ core and
    # in the torch core.
    torch = pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import torch_session

    ctx = demo_contexts[0]
    m = ctx.model
    n, g = ctx.n_tokens, m.n_q_heads // m.n_kv_heads
    r = n % 16  # the partial last page
    cases = [
        # Pages 0 and 1 (32 tokens); page 2 would overflow 40 and is skipped,
        # so is every later full page, and the partial page too (32 + r > 40).
        ("quest", 40, list(range(32))),
        # With 32 + r the partial last page fits after the skipped full pages.
        ("quest", 32 + r, list(range(32)) + list(range(n - r, n))),
        ("quest", 48, list(range(48))),
        ("oracle", 40, list(range(40))),
    ]
    keys = torch.as_tensor(context_keys(client, ctx))
    zq = np.zeros((m.n_q_heads, m.head_dim), np.float32)
    for method, budget, want in cases:
        with library_session(nc, ctx, method, {"budget": budget}) as lib:
            heads = lib.step(0, zq)
        assert all(h.per_q_head[j].tolist() == want for h in heads for j in range(g)), \
            (method, budget)
        for dev in _torch_devices():
            ts = torch_session(method, client.fetch_index(ctx.context_id, method),
                               n_q_heads=m.n_q_heads, params={"budget": budget},
                               device=dev, keys=keys.to(dev) if method == "oracle" else None)
            plan = ts.step(0, torch.from_numpy(zq).to(dev))
            for qh in range(m.n_q_heads):
                got = torch.nonzero(plan.token_mask[qh // g, qh % g])[:, 0].cpu().tolist()
                assert got == want, (method, budget, dev, qh)


def test_oracle_selects_the_exact_top_k(client, nc, demo_contexts) -> None:
    torch = pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import torch_session
    from ctxcache.torch.tables import ContextTables

    ctx = demo_contexts[0]
    m = ctx.model
    keys = context_keys(client, ctx)
    q = np.random.default_rng(4).standard_normal((m.n_q_heads, m.head_dim)).astype(np.float32)
    with library_session(nc, ctx, "oracle", {"budget": 60}) as lib:
        heads = lib.step(1, q)
    g = m.n_q_heads // m.n_kv_heads
    for j in range(g):  # kv head 0's group
        s = keys[1, 0].astype(np.float64) @ q[j].astype(np.float64)
        assert heads[0].per_q_head[j].tolist() == sorted(
            np.argsort(-s, kind="stable")[:60].tolist())
    arts = client.fetch_index(ctx.context_id, "oracle")
    with pytest.raises(ValueError, match="oracle: keys have shape"):
        torch_session("oracle", arts, m.n_q_heads, keys=torch.as_tensor(keys[:, :, :-1]))
    bad = keys.copy()
    bad[1, 0, 5, 3] = np.inf
    with pytest.raises(ValueError, match="oracle: keys have NaN/Inf"):
        torch_session("oracle", arts, m.n_q_heads, keys=torch.as_tensor(bad))
    with pytest.raises(ValueError, match="oracle: needs the context's keys"):
        torch_session("oracle", arts, m.n_q_heads)
    with pytest.raises(ValueError, match="method 'tactic' has no client-side selection"):
        ContextTables(client.fetch_index(ctx.context_id, "streaming"), n_q_heads=4,
                      method="tactic")


# --------------------------------------------- sessions against the server --


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@pytest.mark.parametrize("method", ["streaming", "quest", "oracle"])
def test_client_sessions_match_server(client, nc, demo_contexts, synthetic, method: str,
                                      params: dict) -> None:
    devices = _torch_devices()
    for i, ctx in enumerate(_contexts(demo_contexts, synthetic)):
        keys = context_keys(client, ctx) if method == "oracle" else None
        steps = 2 if ctx is synthetic else 4
        assert _compare_with_server(client, nc, ctx, method, params, n_steps=steps, seed=50 + i,
                                    keys=keys, devices=devices) == steps * ctx.model.n_layers


def _quest_walk(scores: np.ndarray, n: int, page: int, budget: int) -> List[int]:
    """The page walk of QuestSelector::Select (index/quest.cc) for one q
    head, as its loop is written: pages by descending bound (ties: the
    lower page, std::stable_sort), each that fits the budget taken (the
    first always) until the taken tokens reach it; ascending."""
    k = min(budget, n)
    pages: List[int] = []
    taken = 0
    for p in np.argsort(-scores, kind="stable").tolist():
        length = min(page, n - p * page)
        if pages and taken + length > k:
            continue
        pages.append(p)
        taken += length
        if taken >= k:
            break
    return sorted(pages)


def test_torch_quest_page_walk_equals_the_loop() -> None:
    # quest_take_pages (closed form, tensor ops) against the C++ loop
    # (_quest_walk) for every budget, with the partial last page anywhere in
    # the order, ties included.
    torch = pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import quest_take_pages

    rng = np.random.default_rng(12)
    cases = 0
    for n, page in ((601, 16), (777, 12), (64, 16), (65, 16), (7, 16), (100, 1), (50, 7)):
        p = (n + page - 1) // page
        scores = rng.standard_normal((12, p)).astype(np.float32)
        scores[1] = 0  # all tied: the lowest pages
        scores[2] = np.round(scores[2])  # many ties
        for i in range(3, 12):  # the last page at position i - 3 of the order
            scores[i, -1] = np.sort(scores[i, :-1])[::-1][min(i - 3, p - 2)] + 1e-3 \
                if p > 1 else 0
        budgets = sorted(set(list(range(1, min(n, 3 * page + 3) + 1)) +
                             list(range(1, n + 1, max(1, n // 23))) + [n, n + 5]))
        for k in budgets:
            got = quest_take_pages(torch.from_numpy(scores), n, page, k)
            for h in range(scores.shape[0]):
                want = _quest_walk(scores[h], n, page, k)
                assert torch.nonzero(got[h])[:, 0].tolist() == want, (n, page, k, h)
                cases += 1
    assert cases > 3000


@pytest.mark.parametrize("method", ["streaming", "quest", "oracle"])
def test_client_side_decode_steps_for_each_method(client, nc, demo_contexts, synthetic,
                                                  method: str) -> None:
    # Per layer-step: the torch session's plan (its token mask over the
    # context's K/V) and the C++ core through the library
    # (hf.LibrarySession: its selections and their K/V, hf.gather_selected),
    # attention over them plus two decoded tokens; both equal attention over
    # the rows the server's session selects, taken from the context's full KV.
    torch = pytest.importorskip("torch")
    from ctxcache.torch import hf
    from ctxcache.torch.gpu_session import torch_session

    ctx = synthetic
    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    keys = torch.as_tensor(context_keys(client, ctx))
    arts = client.fetch_index(ctx.context_id, method)
    n_pages = (ctx.n_tokens + B - 1) // B
    full = {}
    for layer in range(m.n_layers):
        pages = client.fetch_pages(ctx.context_id, [(layer, h, list(range(n_pages)))
                                                    for h in range(m.n_kv_heads)])
        for h in range(m.n_kv_heads):
            rows = sorted((p for p in pages if p.kv_head == h), key=lambda p: p.block)
            full[(layer, h)] = (torch.as_tensor(np.concatenate([p.k for p in rows])),
                                torch.as_tensor(np.concatenate([p.v for p in rows])))
    okeys = keys if method == "oracle" else None
    exact = hf.LibrarySession(library_session(nc, ctx, method, {}))
    planner = torch_session(method, arts, n_q_heads=m.n_q_heads, keys=okeys)
    rng = np.random.default_rng(43)
    exact_bytes = 0
    with client.open_session(ctx.context_id, method, {}) as s:
        for step in range(3):
            for layer in range(m.n_layers):
                q = torch.as_tensor(session_queries(rng, m.n_q_heads, m.head_dim, step))
                # Appended K/V from the step's seeded numpy stream (a global
                # torch RNG made the data, and so the rounding, depend on
                # which tests ran before).
                dk = torch.as_tensor(rng.standard_normal((m.n_kv_heads, 2, m.head_dim))).float()
                dv = torch.as_tensor(rng.standard_normal((m.n_kv_heads, 2, m.head_dim))).float()
                r = s.step(layer, q.numpy())
                want = torch.zeros(m.n_q_heads, m.head_dim)
                for qh in range(m.n_q_heads):
                    fk, fv = full[(layer, qh // g)]
                    ids = torch.as_tensor(np.asarray(r.selections[qh], dtype=np.int64))
                    k = torch.cat([fk[ids], dk[qh // g]])
                    v = torch.cat([fv[ids], dv[qh // g]])
                    w = torch.softmax(k @ q[qh] * 0.125, dim=0)
                    want[qh] = w @ v
                st = exact.step(layer, q)
                # the library's page payload for this step (0 when its page
                # cache held every page)
                assert st.bytes_received == exact.session.last_step["bytes_received"]
                exact_bytes += st.bytes_received
                k, v, mask = hf.gather_selected(st, m.n_q_heads, "cpu", torch.float32,
                                                ctx.n_tokens)
                got = {"exact": hf.attend(q, k, v, mask, dk, dv, 0.125),
                       "torch": hf.attend(q, *_context_rows(full, layer, m.n_kv_heads),
                                          planner.plan_queries(layer, q).token_mask, dk, dv,
                                          0.125)}
                for name, x in got.items():
                    # float32 attention summed in another order differs by up
                    # to ~2e-5 here; a different page or mask differs by ~1e-1.
                    torch.testing.assert_close(x, want, rtol=1e-4, atol=1e-4,
                                               msg=f"{method} {name}")
    assert 0 < exact_bytes == exact.session.totals["bytes_received"]
    exact.close()


def _context_rows(full, layer: int, n_kv_heads: int) -> tuple:
    """The context's K and V of one layer, [H, n, d] each, from full[(layer, h)]."""
    import torch
    return (torch.stack([full[(layer, h)][0] for h in range(n_kv_heads)]),
            torch.stack([full[(layer, h)][1] for h in range(n_kv_heads)]))


@pytest.mark.parametrize("method", ["csa", "quest", "oracle"])
def test_library_session_appends_like_the_server(client, nc, synthetic, method: str) -> None:
    # generate_client(selection="exact", append=True): the library session
    # takes each generated token's K/V/Q as tensors (bf16 here, as a model's
    # cache holds them) and selects what a server session that got the same
    # Appends selects, appended tokens included.
    torch = pytest.importorskip("torch")
    from ctxcache.torch import hf

    ctx = client.build(tokens=_demo_tokens("r_admin.txt", 700), name="gpusel-append",
                       indexes=["csa", ("quest", {"page": "16"})]).context
    m = ctx.model
    g = m.n_q_heads // m.n_kv_heads
    rng = np.random.default_rng(47)
    lib = hf.LibrarySession(library_session(nc, ctx, method, {"rho": 0.1}))
    with client.open_session(ctx.context_id, method, {"rho": 0.1}) as s, \
            contextlib.closing(lib):
        for step in range(4):
            for layer in range(m.n_layers):
                q = session_queries(rng, m.n_q_heads, m.head_dim, step)
                r = s.step(layer, q)
                where = f"{method} step {step} layer {layer}"
                assert_library_steps_match_server(lib.step(layer, torch.from_numpy(q)).heads,
                                                  r, g, where)
            k, v, qa = (torch.as_tensor(rng.standard_normal((m.n_layers, h, m.head_dim)),
                                        dtype=torch.bfloat16)
                        for h in (m.n_kv_heads, m.n_kv_heads, m.n_q_heads))
            assert lib.append(k, v, qa, token_id=7) == ctx.n_tokens + step + 1
            s.append(k.float().numpy(), v.float().numpy(), qa.float().numpy(), token_id=7)


def test_generate_client_rejects_unknown_methods_and_selections(client, synthetic) -> None:
    pytest.importorskip("torch")
    from ctxcache.torch import hf

    # The C++ core through the library runs every method; the GPU path is
    # hf.generate_engine, named by the error for selection="torch".
    with pytest.raises(ValueError, match="method 'nope' has no client-side selection"):
        hf.generate_client(client, None, synthetic, 1, 1, method="nope")
    for selection in ("torch", "gpu"):
        with pytest.raises(ValueError, match=f"selection '{selection}', expected 'exact' "
                                             r"\(GPU decoding: hf.generate_engine\)"):
            hf.generate_client(client, None, synthetic, 1, 1, selection=selection,
                               method="quest")


def test_oracle_over_more_than_one_key_chunk_matches_server(client, nc) -> None:
    # 4097 keys: a server session scores them in chunks of 4096
    # (ScoreAllKeys over the page fetcher), the last chunk a single key,
    # which Eigen computes as a dot product (another order than its GEMV).
    n, n_q, n_kv, d = 4097, 4, 2, 128
    rng = np.random.default_rng(23)
    layers = []
    for _ in range(1):
        k = rng.standard_normal((n_kv, n, d)).astype(np.float32)
        k[:, n - 2:] = 4 * k[:, :1]  # keys 4095 and 4096: equal, the largest for q ~ k[0]
        v = rng.standard_normal((n_kv, n, d)).astype(np.float32)
        q = rng.standard_normal((n_q, n, d)).astype(np.float32)
        layers.append((k, v, q))
    spec = {"name": "gpusel-chunks", "n_layers": 1, "n_q_heads": n_q, "n_kv_heads": n_kv,
            "head_dim": d, "rope": {"theta": 10000.0}, "kv_dtype": "bf16",
            "fingerprint": b"ctxcache-pytest-gpusel-chunks"}
    ctx = client.ingest(spec, list(range(3, 3 + n)), layers, indexes=[("quest", {})],
                        name="gpusel-chunks")
    keys = context_keys(client, ctx)
    assert np.array_equal(keys[0, :, n - 1], keys[0, :, n - 2])
    for params in ({"budget": 50}, {"rho": 0.02}):
        assert _compare_with_server(client, nc, ctx, "oracle", params, n_steps=3, seed=61,
                                    keys=keys, devices=_torch_devices()) == 3
    # Budget 1 picks key 4095 or 4096, whichever q.k rounds higher (4095 on
    # a tie): the two equal keys are scored in different chunks, in
    # different orders, so only the server's chunking reproduces the choice
    # (the C++ core through the library chunks like the server).
    picks = set()
    with client.open_session(ctx.context_id, "oracle", {"budget": 1}) as s, \
            library_session(nc, ctx, "oracle", {"budget": 1}) as lib:
        for i in range(12):
            q = (keys[0, np.arange(n_q) // 2, 0] +
                 0.3 * rng.standard_normal((n_q, d))).astype(np.float32)
            r = s.step(0, q)
            heads = lib.step(0, q)
            for qh in range(n_q):
                want = r.selections[qh].tolist()
                assert heads[qh // 2].per_q_head[qh % 2].tolist() == want, (i, qh)
                picks.add(want[0])
    assert picks == {n - 2, n - 1}, picks  # both happen: the order matters


def test_cuda_graphs_need_a_cuda_session(client, synthetic) -> None:
    pytest.importorskip("torch")
    from ctxcache.torch.gpu_session import torch_session

    arts = client.fetch_index(synthetic.context_id, "streaming")
    with pytest.raises(ValueError, match="not CUDA"):
        torch_session("streaming", arts, n_q_heads=SYN_NQ, device="cpu", cuda_graphs=True)


def test_cuda_graph_sessions_equal_eager(client) -> None:
    # One CUDA graph per layer (what generate_client uses on a GPU) gives the
    # eager session's plans, step after step, for every method; csa with a
    # search period stays eager (its selection keeps host state).
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ctxcache.torch.gpu_session import torch_session

    info = client.build(tokens=_demo_tokens("document.txt", 611), name="gpusel-graphs",
                        indexes=["csa", ("quest", {"page": "16"})]).context
    periodic = client.build(tokens=_demo_tokens("document.txt", 599), name="gpusel-graphs-p2",
                            indexes=[("csa", {"period": "2"})]).context
    keys = torch.as_tensor(context_keys(client, info))
    m = info.model
    rng = np.random.default_rng(5)
    for method, ctx in (("csa", info), ("quest", info), ("streaming", info),
                        ("oracle", info), ("csa", periodic)):
        arts = client.fetch_index(ctx.context_id, method)
        k = keys if method == "oracle" else None
        eager = torch_session(method, arts, m.n_q_heads, device="cuda", keys=k)
        graphed = torch_session(method, arts, m.n_q_heads, device="cuda", keys=k,
                                cuda_graphs=True)
        for step in range(4):
            for layer in range(m.n_layers):
                q = torch.as_tensor(session_queries(rng, m.n_q_heads, m.head_dim, step))
                a, b = eager.step(layer, q), graphed.step(layer, q)
                for f in ("selected", "token_mask", "table_pages", "pages"):
                    x, y = getattr(a, f), getattr(b, f)
                    if method == "csa":
                        # scatter-add's float atomics sum in any order on a
                        # GPU (eager or graphed): a near-tie at the budget's
                        # edge may flip a few tokens, never a whole selection.
                        assert (x != y).float().mean() <= 0.01, (method, step, layer, f)
                    else:
                        assert torch.equal(x, y), (method, step, layer, f)
        want = 0 if ctx is periodic else m.n_layers
        assert len(graphed._graphs) == want, (method, ctx.name)
