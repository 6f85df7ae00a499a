"""The GPU engine (ctxcache.engine) on the CPU: the page pool's bookkeeping,
the Quest planner against the session core, batch assembly and attention
against dense. On CUDA the same classes run Triton kernels
(python/bench/gpu_engine.py --check compares them with dense on the GPU).

Contexts of the real-server tests: the golden llama3's demo documents built
by a real ctxcached with a Quest index (test_gpu_selection.py's fixture).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ctxcache import native
from ctxcache.engine import (BatchDecoder, ContextDecoder, DenseDecoder, EngineOptions, HostTier,
                             MappedKV, PagePool, PoolOptions, QuestPlanner, quest_bounds)
from ctxcache.torch.artifacts import parse_quest_artifact
from test_gpu_selection import context_keys, demo_contexts  # noqa: F401 (fixture)


def _tier(layers=2, heads=2, n=1000, d=32, seed=0) -> HostTier:
    g = torch.Generator().manual_seed(seed)
    t = HostTier(layers, heads, n, d, pin=False)
    k, v = t.token_view()
    k.copy_(torch.randn(k.shape, generator=g))
    v.copy_(torch.randn(v.shape, generator=g))
    return t


def test_pool_resolves_shared_misses_once_and_keeps_its_tables_consistent() -> None:
    t = _tier()
    pool = PagePool(t, "cpu", PoolOptions(n_slots=40), max_requests=3 * 2 * 6)
    rng = np.random.default_rng(1)
    copies = 0
    for step in range(30):
        layer = step % t.n_layers
        base = rng.choice(t.n_pages, size=(2, 6), replace=False)
        pages = np.stack([base, base, rng.permutation(base, axis=1)])  # 3 seqs, same pages
        pages = torch.as_tensor(pages, dtype=torch.int32)
        units = pool.units(layer, pages).reshape(-1)
        absent = int((pool.slot_of[units.unique()] < 0).sum())
        pool.resolve(layer, pages)
        pool.check()
        slots = pool.slot_of[units].long()
        assert bool((slots >= 0).all()), "a requested page is not resident"
        # Distinct units, distinct slots; contents are the tier's pages.
        assert len(set(zip(units.tolist(), slots.tolist()))) == len(set(units.tolist()))
        assert len(set(slots.tolist())) == len(set(units.tolist()))
        kf, vf = t.k.view(-1, t.head_dim), t.v.view(-1, t.head_dim)
        for u, s in zip(units.tolist(), slots.tolist()):
            assert torch.equal(pool.k[s * 16:(s + 1) * 16], kf[u * 16:(u + 1) * 16])
            assert torch.equal(pool.v[s * 16:(s + 1) * 16], vf[u * 16:(u + 1) * 16])
        copies += absent
    st = pool.stats()
    assert st["copies"] == copies  # each absent unit copied once, however many ask
    assert st["hit_requests"] + st["miss_requests"] == 30 * 36
    assert st["unplaced"] == 0 and st["bytes_h2d"] == copies * t.unit_bytes


def test_pool_clock_keeps_pages_in_use_and_prefers_unreferenced() -> None:
    t = _tier(layers=1, heads=1, n=16 * 8)
    pool = PagePool(t, "cpu", PoolOptions(n_slots=4), max_requests=4)
    one = lambda *p: torch.tensor([[list(p)]], dtype=torch.int32)  # noqa: E731
    pool.resolve(0, one(0, 1, 2, 3))   # fills the 4 slots
    pool.resolve(0, one(0, 1, 2, 4))   # 0-2 hit (referenced); 4 evicts 3, the one not in use
    assert int(pool.slot_of[3]) == -1 and all(int(pool.slot_of[u]) >= 0 for u in (0, 1, 2, 4))
    pool.check()


def test_pool_rejects_a_pool_smaller_than_one_resolve() -> None:
    t = _tier()
    with pytest.raises(ValueError, match="max_requests"):
        PagePool(t, "cpu", PoolOptions(n_slots=10), max_requests=2 * 2 * 6)
    pool = PagePool(t, "cpu", PoolOptions(n_slots=10))
    with pytest.raises(ValueError, match="expected \\[B, 2, kp\\]"):
        pool.resolve(0, torch.zeros(1, 3, 4, dtype=torch.int32))


def test_pool_hold_keeps_a_whole_window_resident() -> None:
    """Without a hold the next layer may evict the last one's pages; within a
    hold every page resolved since stays, until the next hold."""
    t = _tier(layers=2, heads=1, n=16 * 8)
    per_layer = lambda p: torch.tensor([[p]], dtype=torch.int32)  # noqa: E731
    pool = PagePool(t, "cpu", PoolOptions(n_slots=6), max_requests=3)
    for layer, pages in ((0, [0, 1, 2]), (1, [0, 1, 2]), (0, [3, 4, 5]), (0, [0, 1, 2])):
        pool.resolve(layer, per_layer(pages))
    assert all(int(pool.slot_of[t.n_pages + u]) < 0 for u in range(3)), \
        "expected the unheld pool to evict layer 1's pages"
    pool = PagePool(t, "cpu", PoolOptions(n_slots=6), max_requests=3)
    pool.hold()
    pool.resolve(0, per_layer([0, 1, 2]))
    pool.resolve(1, per_layer([0, 1, 2]))
    assert all(int(pool.slot_of[layer * t.n_pages + u]) >= 0 for layer in (0, 1)
               for u in range(3))
    with pytest.raises(RuntimeError, match="no free slot"):
        pool.resolve(0, per_layer([3, 4, 5]))  # 9 held units > 6 slots: the contract
    pool = PagePool(t, "cpu", PoolOptions(n_slots=6), max_requests=3)
    pool.hold()
    pool.resolve(0, per_layer([0, 1, 2]))
    pool.resolve(1, per_layer([0, 1, 2]))
    pool.hold()  # a new window: the last one's pages may go
    pool.resolve(0, per_layer([5, 6, 7]))
    pool.resolve(1, per_layer([5, 6, 7]))
    assert all(int(pool.slot_of[layer * t.n_pages + u]) >= 0 for layer in (0, 1)
               for u in (5, 6, 7))
    pool.check()


def test_pool_hold_next_keeps_the_last_window_and_the_new_one() -> None:
    """hold_next: the window before stays resident beside the new one (a
    lookahead decoder reads the current plan while it resolves the next);
    the window before that may go."""
    t = _tier(layers=2, heads=1, n=16 * 12)
    per_layer = lambda p: torch.tensor([[p]], dtype=torch.int32)  # noqa: E731
    pool = PagePool(t, "cpu", PoolOptions(n_slots=12), max_requests=3)

    def window(pages) -> None:
        for layer in (0, 1):
            pool.resolve(layer, per_layer(pages))

    def resident(pages) -> bool:
        return all(int(pool.slot_of[layer * t.n_pages + u]) >= 0 for layer in (0, 1)
                   for u in pages)

    pool.hold()
    window([0, 1, 2])
    pool.hold_next()
    window([5, 6, 7])
    assert resident([0, 1, 2]) and resident([5, 6, 7])
    pool.hold_next()
    window([8, 9, 10])   # 18 units held by three windows would not fit in 12
    assert resident([5, 6, 7]) and resident([8, 9, 10])
    assert not resident([0, 1, 2])
    pool.hold()          # hold ends the earlier windows: 12 new units fit
    window([3, 4, 11])
    window([0, 1, 2])
    assert resident([3, 4, 11]) and resident([0, 1, 2])
    with pytest.raises(RuntimeError, match="no free slot"):
        window([5, 6, 7])  # 18 units in one window > 12 slots: the contract


def test_a_search_period_reuses_the_plan_without_pool_traffic() -> None:
    """period 2: odd steps attend the pages planned at the step before (with
    their own tokens, which grow), and make no pool requests."""
    t = _tier(layers=2, heads=2, n=16 * 30, d=32, seed=6)
    b, hq = 2, 8
    opts = EngineOptions(rho=0.1, period=2, pool_fraction=0.01, lookahead=False)
    eng = ContextDecoder(t, "cpu", hq, b, 6, opts)
    assert eng.pool.n_slots >= eng.planner.step_units()  # sized to hold a step's pages
    g = torch.Generator().manual_seed(7)
    kept = {}
    for step in range(4):
        eng.planning = step % 2 == 0
        eng.begin_step()
        before = eng.pool.stats()
        for layer in range(2):
            q = torch.randint(-4, 5, (b, hq, 32), generator=g).to(torch.bfloat16)
            k = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            v = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            out = eng.attend(layer, q, k, v)
            pages = eng.planner.pages[layer].clone()
            if eng.planning:
                kept[layer] = pages
            else:
                assert torch.equal(pages, kept[layer])
                want = eng.attention(layer, q, kept[layer], eng.own.k[layer],
                                     eng.own.v[layer], eng.own.now)
                assert torch.equal(out, want)
                # A fresh plan for these queries would differ: reuse is not a no-op.
                fresh = QuestPlanner(eng.planner.kmin, eng.planner.kmax, t.n_tokens, hq, b,
                                     rho=0.1).plan(layer, q)
                assert any(set(fresh[i, h].tolist()) != set(pages[i, h].tolist())
                           for i in range(b) for h in range(2))
        after = eng.pool.stats()
        moved = (after["hit_requests"] + after["miss_requests"]
                 - before["hit_requests"] - before["miss_requests"])
        assert moved == (2 * b * 2 * eng.planner.kp if eng.planning else 0)
        eng.end_step()
    eng.pool.check()
    with pytest.raises(ValueError, match="EngineOptions.period"):
        ContextDecoder(t, "cpu", hq, b, 6, EngineOptions(period=0))
    with pytest.raises(ValueError, match="EngineOptions.pool_slots"):
        ContextDecoder(t, "cpu", hq, b, 6, EngineOptions(rho=0.1, period=2, pool_slots=10))


def _reference_plan(kmin, kmax, q, layer, k_head, kp, n_recent) -> list:
    """The planner's documented semantics, one row at a time in numpy."""
    b, hq, d = q.shape
    h = kmin.shape[1]
    g = hq // h
    p = kmin.shape[2]
    out = []
    for bi in range(b):
        rows = []
        for hi in range(h):
            mn, mx = kmin[layer, hi].double().numpy(), kmax[layer, hi].double().numpy()
            counts = np.zeros(p)
            for gi in range(g):
                qq = q[bi, hi * g + gi].double().numpy()
                u = np.maximum(qq * mn, qq * mx).sum(axis=1)
                counts[np.argsort(-u, kind="stable")[:k_head]] += 1
            key = [(-math.inf if (x == 0 or x >= p - n_recent) else -counts[x], -x)
                   for x in range(p)]
            rows.append(set(sorted(range(p), key=lambda x: key[x])[:kp]))
        out.append(rows)
    return out


def test_lookahead_plans_the_next_pages_in_the_step_before_and_keeps_them_resident(
) -> None:
    """EngineOptions.lookahead with period 3 through the model adapter: step 0
    plans in line, steps 2, 5, ... attend the current plan and then plan the
    next from their own queries (the pool resolves those pages then), every
    other step attends the last plan with no pool traffic; the plan attended
    is always resident, and the pool is sized for two plans."""
    from ctxcache.engine import LlamaStepper
    from test_hf import _TinyLlama
    model = _TinyLlama(layers=2, hq=4, h=2, d=16)
    t = _tier(layers=2, heads=2, n=16 * 40, d=16, seed=9)
    b = 2
    eng = ContextDecoder(t, "cpu", 4, b, 10, EngineOptions(rho=0.1, period=3,
                                                           pool_fraction=0.01))
    assert eng.lookahead and eng.pool.n_slots >= 2 * eng.planner.step_units()
    st = LlamaStepper(model, eng, b)
    assert st.modes() == ["plan", "reuse", "preplan"]
    seen = []
    attend = eng.attend

    def spy(layer, q, k, v):
        before = eng.planner.pages[layer].clone()
        units = eng.pool.units(layer, before).reshape(-1)
        if not eng.planning:  # the pages it attends are resident
            assert bool((eng.pool.slot_of[units] >= 0).all())
        out = attend(layer, q, k, v)
        seen.append((layer, q.clone(), before, eng.planner.pages[layer].clone()))
        return out

    eng.attend = spy
    st.tokens.copy_(torch.tensor([3, 17]))
    st.position.fill_(t.n_tokens)
    modes, plans = [], {}
    for step in range(8):
        mode = st._mode_of()
        modes.append(mode)
        seen.clear()
        s0 = eng.pool.stats()
        st.step()
        s1 = eng.pool.stats()
        moved = s1["hit_requests"] + s1["miss_requests"] - s0["hit_requests"] - s0["miss_requests"]
        assert moved == (0 if mode == "reuse" else 2 * b * 2 * eng.planner.kp), (step, mode)
        for layer, q, before, after in seen:
            if mode == "reuse":
                assert torch.equal(after, before) and torch.equal(before, plans[layer])
            elif mode == "preplan":
                assert torch.equal(before, plans[layer])  # attended the current plan
                fresh = QuestPlanner(eng.planner.kmin, eng.planner.kmax, t.n_tokens, 4, b,
                                     rho=0.1).plan(layer, q)
                assert torch.equal(after, fresh)           # then planned from its queries
            plans[layer] = after
        eng.pool.check()
    assert modes == ["plan", "reuse", "preplan", "reuse", "reuse", "preplan", "reuse", "reuse"]


def test_quest_planner_follows_the_documented_ranking() -> None:
    t = _tier(layers=2, heads=2, n=16 * 40 - 5, d=32)
    planner = QuestPlanner.from_tier(t, "cpu", n_q_heads=8, batch=3, rho=0.1)
    assert planner.kp == 4 + 3 and planner.k_head == 4  # ceil(0.1 * 635) // 16
    g = torch.Generator().manual_seed(3)
    for layer in range(2):
        # Integer-valued queries: every bound is exact, no near-ties by rounding.
        q = torch.randint(-4, 5, (3, 8, 32), generator=g).to(torch.bfloat16)
        pages = planner.plan(layer, q)
        want = _reference_plan(planner.kmin, planner.kmax, q, layer, planner.k_head,
                               planner.kp, planner.n_recent)
        for bi in range(3):
            for hi in range(2):
                assert set(pages[bi, hi].tolist()) == want[bi][hi], (layer, bi, hi)


def test_quest_planner_max_rank_takes_the_largest_bound_of_the_group() -> None:
    """"max" (the core's page_rank=max): among the pages some q head of the
    group took (its k_head best), those with the best bound any head gives
    them; page 0 and the recent pages first."""
    t = _tier(layers=1, heads=2, n=16 * 40, d=32, seed=15)
    planner = QuestPlanner.from_tier(t, "cpu", n_q_heads=8, batch=2, rho=0.1, rank="max")
    g = torch.Generator().manual_seed(16)
    q = torch.randint(-4, 5, (2, 8, 32), generator=g).to(torch.bfloat16)
    pages = planner.plan(0, q)
    mn, mx = planner.kmin[0].double(), planner.kmax[0].double()
    for bi in range(2):
        for hh in range(2):
            qs = q[bi, hh * 4:(hh + 1) * 4].double()
            u = torch.maximum(qs[:, None] * mn[hh][None], qs[:, None] * mx[hh][None]).sum(-1)
            taken = set()
            for row in u:  # each head's k_head best, ties to the lower page
                taken |= set(sorted(range(40), key=lambda p: (-row[p].item(), p))
                             [:planner.k_head])
            best = u.amax(dim=0)
            forced = {0} | set(range(40 - planner.n_recent, 40))
            free = [p for p in taken if p not in forced]
            ranked = sorted(free, key=lambda p: (-best[p].item(), p))[:planner.kp - len(forced)]
            have = set(pages[bi, hh].tolist())
            assert len(have) == planner.kp and forced | set(ranked) <= have
            if len(forced) + len(free) >= planner.kp:
                assert have == forced | set(ranked)
    with pytest.raises(ValueError, match="rank"):
        QuestPlanner.from_tier(t, "cpu", n_q_heads=8, batch=2, rank="sum")


def test_quest_planner_min_budget_floors_the_budgets_as_the_core() -> None:
    t = _tier(layers=1, heads=2, n=16 * 40, d=32)
    planner = QuestPlanner.from_tier(t, "cpu", n_q_heads=8, batch=1, rho=0.05,
                                     min_budget=160)
    assert planner.k_head == 10 and planner.page_budget == 10 and planner.kp == 10 + 3
    assert QuestPlanner.from_tier(t, "cpu", 8, 1, rho=0.05).k_head == 2  # ceil(32) // 16
    assert QuestPlanner.from_tier(t, "cpu", 8, 1, rho=0.05, min_budget=10**6).kp == 40
    with pytest.raises(ValueError, match="min_budget"):
        QuestPlanner.from_tier(t, "cpu", 8, 1, min_budget=-1)


def test_a_pool_with_a_slot_for_every_page_preloads_the_context() -> None:
    t = _tier(layers=2, heads=2, n=16 * 12 - 5, d=32, seed=21)
    dec = ContextDecoder(t, "cpu", 8, 2, 4, EngineOptions(rho=0.2, pool_fraction=1.0))
    pool = dec.pool
    assert pool.stats()["copies"] == t.n_units
    pool.check()
    assert torch.equal(pool.k.view(t.n_layers, t.n_kv_heads, -1, 32), t.k)
    g = torch.Generator().manual_seed(22)
    dec.begin_step()
    for layer in range(2):
        dec.attend(layer, torch.randn(2, 8, 32, generator=g).to(torch.bfloat16),
                   torch.randn(2, 2, 32, generator=g).to(torch.bfloat16),
                   torch.randn(2, 2, 32, generator=g).to(torch.bfloat16))
    dec.end_step()
    st = pool.stats()
    assert st["miss_requests"] == 0 and st["hit_requests"] > 0 and st["copies"] == t.n_units
    # Smaller than the context: nothing preloaded, the first step misses.
    small = ContextDecoder(t, "cpu", 8, 1, 4, EngineOptions(rho=0.2, pool_fraction=0.5))
    assert small.pool.stats()["copies"] == 0 and not small.pool.preload()
    off = ContextDecoder(t, "cpu", 8, 1, 4, EngineOptions(pool_fraction=1.0, preload=False))
    assert off.pool.stats()["copies"] == 0


def test_union_tables_kept_between_planning_steps_equal_a_fresh_gather() -> None:
    from ctxcache.engine.attention import UnionAttention
    t = _tier(layers=2, heads=2, n=16 * 20 - 7, d=32, seed=23)
    dec = ContextDecoder(t, "cpu", 8, 3, 4, EngineOptions(union_rho=0.3, period=2))
    assert dec.attention is None and not dec.planner.per_sequence
    with pytest.raises(ValueError, match="union"):
        dec.planner.plan(0, torch.zeros(3, 8, 32, dtype=torch.bfloat16))
    kept, fresh = dec.union_attention, UnionAttention(dec.pool)
    assert kept.hbm_bytes > 0 and dec.memory()["union_tables"] == kept.hbm_bytes
    g = torch.Generator().manual_seed(24)
    dec.begin_step()  # step 0 plans
    qs = []
    for layer in range(2):
        q = torch.randint(-4, 5, (3, 8, 32), generator=g).to(torch.bfloat16)
        dec.attend(layer, q, torch.randn(3, 2, 32, generator=g).to(torch.bfloat16),
                   torch.randn(3, 2, 32, generator=g).to(torch.bfloat16))
        qs.append(q)
    dec.end_step()
    for layer in range(2):
        q = torch.randn(3, 8, 32, generator=g).to(torch.bfloat16)
        pages = dec.planner.union_pages[layer]
        own = (dec.own.k[layer], dec.own.v[layer], dec.own.length)
        a = kept(layer, q, pages, *own, refresh=False)
        b = fresh(layer, q, pages, *own)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="keep"):
        fresh(0, q, dec.planner.union_pages[0], *own, refresh=False)


def test_quest_bounds_mask_the_partial_last_page() -> None:
    k = torch.zeros(1, 32, 2, dtype=torch.bfloat16)
    k[0, :20, 0] = torch.arange(20, dtype=torch.bfloat16) - 5
    mn, mx = quest_bounds(k, 20, 16)
    assert mn[0, 1, 0] == 11 and mx[0, 1, 0] == 14 and mn[0, 0, 0] == -5


def test_engine_at_full_budget_equals_dense_for_a_batch() -> None:
    t = _tier(layers=2, heads=2, n=333, d=32, seed=4)
    b, hq = 3, 8
    eng = ContextDecoder(t, "cpu", hq, b, 6, EngineOptions(rho=1.0, pool_fraction=1.0))
    den = DenseDecoder(t.k[:, :, :t.n_tokens].contiguous(), t.v[:, :, :t.n_tokens].contiguous(),
                       b, 6)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        eng.begin_step()
        den.begin_step()
        for layer in range(2):
            q = torch.randn(b, hq, 32, generator=g).to(torch.bfloat16)
            k = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            v = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            a, d = eng.attend(layer, q, k, v), den.attend(layer, q, k, v)
            assert (a.float() - d.float()).abs().max().item() < 2e-2
        eng.end_step()
        den.end_step()
    assert eng.own.length.tolist() == [4, 4, 4]
    # Each sequence attends its own tokens only: another's differ.
    assert not torch.equal(eng.own.k[0, 0], eng.own.k[0, 1])


def test_batch_union_reads_one_table_per_kv_head_for_the_whole_batch() -> None:
    from ctxcache.engine import chunk_pages
    t = _tier(layers=2, heads=2, n=16 * 30 - 3, d=32, seed=17)
    b, hq = 3, 8
    dense = DenseDecoder(t.k[:, :, :t.n_tokens].contiguous(),
                         t.v[:, :, :t.n_tokens].contiguous(), b, 4)
    full = ContextDecoder(t, "cpu", hq, b, 4, EngineOptions(union_rho=1.0))
    part = ContextDecoder(t, "cpu", hq, b, 4, EngineOptions(union_rho=0.2))
    assert part.union_kp == 6 + 3 and part.pool.n_slots >= 2 * 2 * part.union_kp
    g = torch.Generator().manual_seed(18)
    for _ in range(2):
        for d in (dense, full, part):
            d.begin_step()
        for layer in range(2):
            q = torch.randint(-4, 5, (b, hq, 32), generator=g).to(torch.bfloat16)
            k = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            v = torch.randn(b, 2, 32, generator=g).to(torch.bfloat16)
            want = dense.attend(layer, q, k, v)
            assert (full.attend(layer, q, k, v).float() - want.float()).abs().max() < 2e-2
            got = part.attend(layer, q, k, v)
            pages = part.planner.union_pages[layer]
            table = chunk_pages(q, part.planner.kmin[layer], part.planner.kmax[layer],
                                part.union_kp, part.planner.n_recent)
            assert torch.equal(pages.long(), torch.sort(table, dim=1).values)
            # Each sequence: attention over the table's tokens plus its own.
            for bi in range(b):
                for j in range(hq):
                    hh = j // 4
                    tok = (pages[hh].long().view(-1, 1) * 16 + torch.arange(16)).view(-1)
                    tok = tok[tok < t.n_tokens]
                    n_own = int(part.own.now[bi])
                    kk = torch.cat([t.k[layer, hh, tok], part.own.k[layer, bi, hh, :n_own]])
                    vv = torch.cat([t.v[layer, hh, tok], part.own.v[layer, bi, hh, :n_own]])
                    w = torch.softmax(q[bi, j].double() @ kk.double().T / math.sqrt(32), 0)
                    ref = w @ vv.double()
                    assert (got[bi, j].double() - ref).abs().max().item() < 2e-2
        for d in (dense, full, part):
            d.end_step()
    st = part.pool.stats()
    assert st["hit_requests"] + st["miss_requests"] == 2 * 2 * 2 * part.union_kp
    with pytest.raises(ValueError, match="union_rho: expected in"):
        ContextDecoder(t, "cpu", hq, b, 4, EngineOptions(union_rho=1.5))


def test_a_batch_over_two_contexts_equals_each_context_alone() -> None:
    t1, t2 = _tier(n=400, seed=8), _tier(n=300, seed=9)

    def make(t, b):
        return ContextDecoder(t, "cpu", 8, b, 4, EngineOptions(rho=0.2))

    both = BatchDecoder([make(t1, 2), make(t2, 1)])
    alone = [make(t1, 2), make(t2, 1)]
    assert both.batch == 3 and both.period == 1
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        for d in [both] + alone:
            d.begin_step()
        for layer in range(2):
            q = torch.randn(3, 8, 32, generator=g).to(torch.bfloat16)
            k = torch.randn(3, 2, 32, generator=g).to(torch.bfloat16)
            v = torch.randn(3, 2, 32, generator=g).to(torch.bfloat16)
            out = both.attend(layer, q, k, v)
            assert torch.equal(out[:2], alone[0].attend(layer, q[:2], k[:2], v[:2]))
            assert torch.equal(out[2:], alone[1].attend(layer, q[2:], k[2:], v[2:]))
        for d in [both] + alone:
            d.end_step()
    # Each context's pool serves its own rows only.
    second = both.decoders[1]
    st = second.pool.stats()
    # 3 steps x 2 layers x 1 row x 2 kv heads x kp pages.
    assert st["hit_requests"] + st["miss_requests"] == 3 * 2 * 1 * 2 * second.planner.kp
    with pytest.raises(ValueError, match="batch 2, expected 3"):
        both.attend(0, q[:2], k[:2], v[:2])
    with pytest.raises(ValueError, match="periods differ"):
        BatchDecoder([make(t1, 1), ContextDecoder(t2, "cpu", 8, 1, 4, EngineOptions(period=2))])


def test_a_lookahead_batch_over_two_contexts_decodes_as_each_context_alone() -> None:
    """Through the model adapter with period 3 and lookahead: a BatchDecoder
    over two contexts gives each sequence the logits its context's decoder
    gives alone (the adapter sets planning and prefetching on every decoder);
    decoders whose lookahead differs cannot share a batch."""
    from ctxcache.engine import LlamaStepper
    from test_hf import _TinyLlama
    model = _TinyLlama(layers=2, hq=4, h=2, d=16, seed=2)
    t1, t2 = _tier(n=16 * 30, d=16, seed=11), _tier(n=16 * 22, d=16, seed=12)
    opts = EngineOptions(rho=0.1, period=3, pool_fraction=0.01)

    def make(t, b):
        return ContextDecoder(t, "cpu", 4, b, 10, opts)

    both = BatchDecoder([make(t1, 2), make(t2, 1)])
    assert both.lookahead
    steppers = [LlamaStepper(model, both, 3, keep_logits=True)]
    alone = [make(t1, 2), make(t2, 1)]
    steppers += [LlamaStepper(model, d, d.batch, keep_logits=True) for d in alone]
    firsts = torch.tensor([5, 9, 21])
    steppers[0].tokens.copy_(firsts)
    steppers[1].tokens.copy_(firsts[:2])
    steppers[2].tokens.copy_(firsts[2:])
    # Both contexts' sequences at their own context's length.
    steppers[0].position.copy_(torch.tensor([t1.n_tokens] * 2 + [t2.n_tokens]))
    steppers[1].position.fill_(t1.n_tokens)
    steppers[2].position.fill_(t2.n_tokens)
    for _ in range(7):
        for st in steppers:
            st.step()
        assert torch.equal(steppers[0].logits[:2], steppers[1].logits)
        assert torch.equal(steppers[0].logits[2:], steppers[2].logits)
    with pytest.raises(ValueError, match="lookahead differs"):
        BatchDecoder([make(t1, 1), ContextDecoder(t2, "cpu", 4, 1, 4, EngineOptions(
            period=3, lookahead=False))])


def test_bounds_equal_the_stored_quest_artifact_and_pages_cover_the_core(
        server, client, demo_contexts) -> None:  # noqa: F811
    """The engine's index is the stored Quest artifact (the C++ build), bit
    for bit; its pages are the C++ session core's (run through the native
    library, in this process) plus fillers when the core takes fewer."""
    nc = native.NativeClient(server.address, timeout=60)
    for ctx in demo_contexts:
        arts = client.fetch_index(ctx.context_id, "quest")
        if parse_quest_artifact(arts[(0, 0)]).page_size != 16:
            continue  # the engine pages by the store's 16 tokens
        m = ctx.model
        keys = context_keys(client, ctx)
        t = HostTier(m.n_layers, m.n_kv_heads, ctx.n_tokens, m.head_dim, pin=False)
        t.token_view()[0].copy_(torch.as_tensor(keys).to(torch.bfloat16))
        for rank, min_budget in (("votes", 0), ("max", 0), ("max", 256)):
            _planner_covers_the_core(nc, ctx, t, arts, rank, min_budget)
    nc.close()


def _planner_covers_the_core(nc, ctx, t, arts, rank: str, min_budget: int) -> None:
    m = ctx.model
    planner = QuestPlanner.from_tier(t, "cpu", m.n_q_heads, batch=1, rank=rank,
                                     min_budget=min_budget)
    params = {"page_rank": rank, "min_budget": min_budget}
    core = nc.open_session(ctx.context_id, "quest", params, client_mode=True)
    try:
        rng = np.random.default_rng(ctx.n_tokens)
        for layer in range(m.n_layers):
            for h in range(m.n_kv_heads):
                a = parse_quest_artifact(arts[(layer, h)])
                assert np.array_equal(planner.kmin[layer, h].float().numpy(), a.page_min)
                assert np.array_equal(planner.kmax[layer, h].float().numpy(), a.page_max)
            for _ in range(3):
                q = torch.as_tensor(rng.integers(-3, 4, (m.n_q_heads, m.head_dim)),
                                    dtype=torch.bfloat16)
                plan = core.step(layer, q.float().numpy())
                got = planner.plan(layer, q.unsqueeze(0))[0]
                for h in range(m.n_kv_heads):
                    want = set(plan[h].pages.tolist())
                    have = set(got[h].tolist())
                    assert want, "the core selected no page"
                    assert len(have) == planner.kp
                    assert want <= have, (ctx.name, rank, layer, h, want - have)
    finally:
        core.close()


def test_host_tier_from_server_holds_the_stored_pages(server, client,
                                                      demo_contexts) -> None:  # noqa: F811
    """HostTier.from_server: the native bulk load fills the tier in the
    background with the stored keys and values; the page padding stays zero."""
    with native.NativeClient(server.address, timeout=60) as nc:
        for ctx in demo_contexts:
            t = HostTier.from_server(nc, ctx.context_id, streams=2, pin=False)
            with t.load:
                t.load.wait()
            n = ctx.n_tokens
            assert (t.n_layers, t.n_kv_heads, t.n_tokens) == (ctx.model.n_layers,
                                                             ctx.model.n_kv_heads, n)
            k, _ = t.token_view()
            assert np.array_equal(k.float().numpy(), context_keys(client, ctx))
            assert not bool(t.k[:, :, n:].any()) and not bool(t.v[:, :, n:].any())
            assert bool(t.v[:, :, :n].any())


def test_an_on_demand_tier_plans_from_the_stored_index_and_fetches_only_planned_pages(
        server, client, demo_contexts) -> None:  # noqa: F811
    """HostTier.on_demand + QuestPlanner.from_index: the bounds read from the
    stored Quest artifacts are the bounds of the loaded keys, bit for bit; a
    decoder over the on-demand tier attends like one over the loaded tier,
    step after step, while the tier holds only the units its steps planned;
    the bulk load started later completes it."""
    with native.NativeClient(server.address, timeout=60) as nc:
        for ctx in demo_contexts:
            m = ctx.model
            loaded = HostTier.from_server(nc, ctx.context_id, streams=2, pin=False)
            with loaded.load:
                loaded.load.wait()
            lazy = HostTier.on_demand(nc, ctx.context_id, pin=False)
            assert lazy.present is not None and not bool(lazy.present.any())
            # Not zero-filled: rows not present must never be read (NaN here
            # would reach the attention outputs); the padding is zero.
            n = ctx.n_tokens
            assert not bool(lazy.k[:, :, n:].any()) and not bool(lazy.v[:, :, n:].any())
            lazy.k[:, :, :n].fill_(float("nan"))
            lazy.v[:, :, :n].fill_(float("nan"))
            if parse_quest_artifact(nc.fetch_index(ctx.context_id, "quest")[(0, 0)]) \
                    .page_size != 16:
                with nc.open_index(ctx.context_id, "quest") as idx, \
                        pytest.raises(ValueError, match="page 12; expected the tier's"):
                    QuestPlanner.from_index(idx, lazy, "cpu", m.n_q_heads, 2)
                continue
            with nc.open_index(ctx.context_id, "quest") as idx:
                planner = QuestPlanner.from_index(idx, lazy, "cpu", m.n_q_heads, 2, rho=0.1)
            ref = QuestPlanner.from_tier(loaded, "cpu", m.n_q_heads, 2, rho=0.1)
            assert torch.equal(planner.kmin, ref.kmin) and torch.equal(planner.kmax, ref.kmax)
            with pytest.raises(ValueError, match="holds no keys to plan from"):
                ContextDecoder(lazy, "cpu", m.n_q_heads, 2, 4)
            opts = EngineOptions(rho=0.1, pool_fraction=0.3)
            a = ContextDecoder(lazy, "cpu", m.n_q_heads, 2, 4, opts, planner=planner)
            b = ContextDecoder(loaded, "cpu", m.n_q_heads, 2, 4, opts)
            g = torch.Generator().manual_seed(ctx.n_tokens)
            planned = set()
            for _ in range(3):
                a.begin_step()
                b.begin_step()
                for layer in range(m.n_layers):
                    q = torch.randn(2, m.n_q_heads, m.head_dim, generator=g).to(torch.bfloat16)
                    k = torch.randn(2, m.n_kv_heads, m.head_dim, generator=g).to(torch.bfloat16)
                    v = torch.randn(2, m.n_kv_heads, m.head_dim, generator=g).to(torch.bfloat16)
                    assert torch.equal(a.attend(layer, q, k, v), b.attend(layer, q, k, v))
                    planned |= set(a.pool.units(layer, planner.pages[layer]).view(-1).tolist())
                a.end_step()
                b.end_step()
            # Exactly the planned units are present, with the stored bytes;
            # the others still hold the NaNs.
            have = set(torch.nonzero(lazy.present).view(-1).tolist())
            assert have == planned and lazy.units_fetched == len(planned) < lazy.n_units
            # The fill's time in parts: waiting for the units, then the fetch calls.
            assert lazy.fill_fetch_s > 0 and lazy.fill_wait_s > 0
            assert lazy.fill_wait_s + lazy.fill_fetch_s <= lazy.fill_s + 1e-9
            rows = lambda t: t.k.view(t.n_units, t.page, -1)  # noqa: E731
            idx_have = torch.tensor(sorted(have))
            assert torch.equal(rows(lazy)[idx_have], rows(loaded)[idx_have])
            assert bool(rows(lazy)[lazy.present.logical_not()].isnan().any())
            assert lazy.fill(idx_have) == 0
            lazy.start_load(streams=2)
            lazy.load.wait()
            assert lazy.complete() and lazy.present is None and lazy.fill(idx_have) == 0
            assert torch.equal(lazy.k, loaded.k) and torch.equal(lazy.v, loaded.v)


def test_mapped_kv_reads_the_stored_layers_in_segment_order(server,
                                                            demo_contexts) -> None:  # noqa: F811
    """MappedKV over MapKV: each slot's K and V equal a bulk load of that
    layer, in the order asked for; closing unmaps (no segment left here)."""
    ctx = demo_contexts[0]
    with native.NativeClient(server.address, timeout=60) as nc:
        shape = nc.context(ctx.context_id)
        k = torch.zeros(shape.kv_shape(), dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        nc.load_kv(ctx.context_id, k, v)
        order = list(range(shape.n_layers))[::-1]
        with MappedKV(nc, ctx.context_id, layers=order, register_threads=2) as m:
            assert (m.n_slots, m.n_kv_heads, m.n_tokens) == (len(order), shape.n_kv_heads,
                                                              shape.n_tokens)
            for slot, layer in enumerate(order):
                mk, mv = m.layer(slot)
                assert torch.equal(mk, k[layer]) and torch.equal(mv, v[layer])
            start = f"{m.address:x}-"
        with open("/proc/self/maps") as f:
            assert not any(line.startswith(start) for line in f)  # unmapped
    with pytest.raises(ValueError, match="register_threads"):
        MappedKV(None, ctx.context_id, register_threads=0)


def test_a_killed_ctxcached_neither_stops_decode_nor_hangs_a_new_load(make_server) -> None:
    """The engine needs the server only to fill its host tier: decoding
    after ctxcached dies gives the same outputs as before, and a load
    started against the dead server fails with a clear error instead of
    waiting."""
    import ctxcache
    from conftest import random_tokens
    srv = make_server()
    with native.NativeClient(srv.address, timeout=5, max_attempts=2) as nc:
        cid = nc.build_tokens(random_tokens(700, 11))
        shape = nc.context(cid)
        tiers = [HostTier.from_server(nc, cid, streams=2, pin=False) for _ in range(2)]
        for t in tiers:
            with t.load:
                t.load.wait()
        hq, b = shape.n_q_heads, 2
        decs = [ContextDecoder(t, "cpu", hq, b, 4, EngineOptions(rho=0.2)) for t in tiers]

        def run(dec):
            g = torch.Generator().manual_seed(12)
            outs = []
            for _ in range(2):
                dec.begin_step()
                for layer in range(shape.n_layers):
                    q = torch.randn(b, hq, shape.head_dim, generator=g).to(torch.bfloat16)
                    kv = torch.randn(2, b, shape.n_kv_heads, shape.head_dim,
                                     generator=g).to(torch.bfloat16)
                    outs.append(dec.attend(layer, q, kv[0], kv[1]))
                dec.end_step()
            return outs

        before = run(decs[0])
        srv.proc.kill()
        srv.proc.wait(10)
        after = run(decs[1])
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        with pytest.raises((ctxcache.Unavailable, ctxcache.DeadlineExceeded)):
            t = HostTier.from_server(nc, cid, streams=2, pin=False)
            with t.load:
                t.load.wait()


def _ext_reference(k, v, n, q_all, k_all, v_all, pages=None, page=16):
    """Attention of every new token (q_all [T, Hq, d]) over the stored tokens
    (all, or those of ``pages`` [H, *] per kv head) and the new tokens up to
    itself, in float64."""
    t, hq, d = q_all.shape
    h = k.shape[0]
    g = hq // h
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for j in range(hq):
        hh = j // g
        if pages is None:
            keep = torch.arange(n)
        else:
            keep = (pages[hh].view(-1, 1) * page + torch.arange(page)).view(-1)
            keep = keep[keep < n]
        ks = torch.cat([k[hh, keep].double(), k_all[:, hh].double()])
        vs = torch.cat([v[hh, keep].double(), v_all[:, hh].double()])
        for i in range(t):
            m = len(keep) + i + 1
            w = torch.softmax(q_all[i, j].double() @ ks[:m].T / math.sqrt(d), dim=0)
            out[i, j] = w @ vs[:m]
    return out


def test_extension_prefill_is_dense_at_full_budget_and_block_union_below() -> None:
    from ctxcache.engine import (DenseExtendAttention, ExtendOptions, SparseExtendAttention,
                                 chunk_pages)
    t = _tier(layers=1, heads=2, n=16 * 12 - 7, d=32, seed=13)   # a partial last page
    k, v, n = t.k, t.v, t.n_tokens
    g = torch.Generator().manual_seed(14)
    q = torch.randint(-3, 4, (7, 8, 32), generator=g).to(torch.bfloat16)
    kn = torch.randn(7, 2, 32, generator=g).to(torch.bfloat16)
    vn = torch.randn(7, 2, 32, generator=g).to(torch.bfloat16)
    want = _ext_reference(k[0], v[0], n, q, kn, vn)
    for make in (lambda: DenseExtendAttention(k, v, n, 8),
                 lambda: SparseExtendAttention(k, v, n, 8, ExtendOptions(rho=1.0))):
        att = make()
        # Two chunks (4 + 3 tokens): the second attends the first in full.
        got = torch.cat([att.attend(0, q[:4], kn[:4], vn[:4]),
                         att.attend(0, q[4:], kn[4:], vn[4:])])
        assert (got.double() - want).abs().max().item() < 2e-2
        assert att.n_new == [7]
    sp = SparseExtendAttention(k, v, n, 8, ExtendOptions(rho=0.25))
    assert sp.kp == 3 + 3      # ceil(0.25 * 12) + page 0 + the last two
    got = torch.cat([sp.attend(0, q[:4], kn[:4], vn[:4])])
    pages = sp.last_pages
    assert {0, 10, 11} <= set(pages[0].tolist()) and pages.shape == (2, 6)
    want = _ext_reference(k[0], v[0], n, q[:4], kn[:4], vn[:4], pages)
    assert (got.double() - want).abs().max().item() < 2e-2
    # The table: per kv head, the pages with the largest bound over the
    # chunk's queries and the group's heads.
    mn, mx = sp.kmin[0].double(), sp.kmax[0].double()
    for hh in range(2):
        qs = q[:4, hh * 4:(hh + 1) * 4].reshape(-1, 32).double()
        u = torch.maximum(qs[:, None] * mn[hh][None], qs[:, None] * mx[hh][None]).sum(-1)
        best = u.amax(dim=0)
        free = [p for p in range(1, 10)]
        ranked = sorted(free, key=lambda p: (-best[p].item(), p))[:3]
        assert set(pages[hh].tolist()) == {0, 10, 11} | set(ranked)
    # The same table from the module function, and a bad budget is refused.
    again = chunk_pages(q[:4], sp.kmin[0], sp.kmax[0], sp.kp, sp.n_recent)
    assert torch.equal(torch.sort(again, dim=1).values, pages)
    with pytest.raises(ValueError, match="ExtendOptions.rho"):
        SparseExtendAttention(k, v, n, 8, ExtendOptions(rho=0.0))
    with pytest.raises(ValueError, match="max_tokens 8"):
        sp.attend(0, torch.cat([q, q])[:5], torch.cat([kn, kn])[:5], torch.cat([vn, vn])[:5])


def test_the_fused_step_runs_only_models_it_matches() -> None:
    """llama.fusable names why a model cannot run the fused step (here: a
    CPU model whose norm is not one of transformers' Llama RMSNorms), and
    fused=True then raises; the default falls back to the modules' step."""
    from ctxcache.engine import LlamaStepper, llama
    from test_hf import _TinyLlama
    model = _TinyLlama(layers=1, hq=4, h=2, d=16)
    assert "CUDA" in llama.fusable(model) or "triton" in llama.fusable(model)
    dec = DenseDecoder(torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16),
                       torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16), 1, 2)
    with pytest.raises(ValueError, match="fused"):
        LlamaStepper(model, dec, 1, fused=True)
    assert LlamaStepper(model, dec, 1).rows is llama._module_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels are Triton (CUDA)")
def test_the_fused_step_equals_the_modules_step_on_a_transformers_llama() -> None:
    """On CUDA, an HF LlamaForCausalLM's fused step (llama._fused_rows: the
    residual add with RMSNorm, RoPE and silu * up as Triton kernels) against
    its modules' step (_module_rows): RoPE and silu * up to the bit, the
    norm within one bf16 rounding, and teacher-forced decode steps over a
    dense context with the same logits and tokens."""
    transformers = pytest.importorskip("transformers")
    from ctxcache.engine import LlamaStepper, _triton, llama
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    assert llama.fusable(model) == ""
    dev, r = "cuda", 37
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(r, 256, device=dev, generator=g).to(torch.bfloat16)
    res = torch.randn(r, 256, device=dev, generator=g).to(torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    xo, y = _triton.add_rmsnorm(x, res, norm.weight, norm.variance_epsilon)
    assert torch.equal(xo, x + res)
    want = norm(x + res)
    close = torch.isclose(y.float(), want.float(), rtol=2 ** -7, atol=0)
    assert close.all() and (y == want).float().mean() > 0.99
    q = torch.randn(r, 4 * 64, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(r, 2 * 64, device=dev, generator=g).to(torch.bfloat16)
    pos = torch.arange(1000, 1000 + r, device=dev)
    cos, sin = model.model.rotary_emb(x.unsqueeze(1), pos.unsqueeze(1))
    qo, ko = _triton.rope(q, k, cos.reshape(r, 64).contiguous(),
                          sin.reshape(r, 64).contiguous(), 4, 2, 64)
    c3, s3 = cos.view(r, 1, 64), sin.view(r, 1, 64)
    for got, src, h in ((qo, q, 4), (ko, k, 2)):
        src = src.view(r, h, 64)
        assert torch.equal(got, src * c3 + llama._rotate_half(src) * s3)
    gate = torch.randn(r, 704, device=dev, generator=g).to(torch.bfloat16) * 4
    up = torch.randn(r, 704, device=dev, generator=g).to(torch.bfloat16)
    assert torch.equal(_triton.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    # Whole steps, teacher-forced on the module step's tokens.
    n, b = 300, 3
    kc = torch.randn(2, 2, n, 64, device=dev, generator=g).to(torch.bfloat16)
    vc = torch.randn(2, 2, n, 64, device=dev, generator=g).to(torch.bfloat16)
    runs = []
    for fused in (False, True):
        st = LlamaStepper(model, DenseDecoder(kc, vc, b, 8), b, keep_logits=True, fused=fused)
        assert st.rows is (llama._fused_rows if fused else llama._module_rows)
        st.position.fill_(n)
        runs.append(st)
    feed = torch.tensor([5, 77, 301], device=dev)
    for _ in range(6):
        outs = []
        for st in runs:
            st.tokens.copy_(feed)
            st.step()
            outs.append((st.logits.clone(), st.tokens.clone()))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-2, rtol=2e-2)
        assert torch.equal(outs[1][1], outs[0][1])
        feed = outs[0][1]
