"""ctxcache.torch.hf: the decode attention (torch, CPU) always; the HF
transformers path only where transformers is installed (the GPU machine:
scripts/gpu-suite.sh), against the real ctxcached."""
from __future__ import annotations

import math
import os
import types
from typing import List

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
    from ctxcache.engine import EngineOptions
    from transformers import AutoModelForCausalLM

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(repo, "models", "ctxcache-ref"),
                                                 dtype=torch.bfloat16).to(dev).eval()
    server = make_server(["--default-indexes", "csa"])
    ids = list(np.random.default_rng(0).integers(3, 1000, size=1200))
    with ctxcache.Client(server.address, timeout=120) as c:
        info, pre = hf.prefill_and_ingest(c, model, ids[:-1], indexes=["csa", "quest"])
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
        # The GPU engine (generate_engine: the KV bulk-loaded into a host
        # tier, the model's step as CUDA graph replays on a GPU): dense and
        # the sparse engine at full budget decode the same tokens as the
        # model's own forward over the same KV (generate_dense).
        eng_dense = hf.generate_engine(c, model, info, [ids[-1]], 16, attention="dense")
        assert eng_dense.tokens[0] == dense_out.tokens
        eng_full = hf.generate_engine(c, model, info, [ids[-1]], 16, options=EngineOptions(
            rho=1.0, pool_fraction=1.0))
        assert eng_full.tokens[0] == dense_out.tokens
        # Quest pages at 10% with the budget floor of the task suite's
        # setting, teacher forced on dense's tokens: most steps agree.
        eng = hf.generate_engine(c, model, info, [ids[-1]], 16, forced=[dense_out.tokens],
                                 options=EngineOptions(rho=0.1, rank="max", min_budget=256))
        assert sum(a == b for a, b in zip(eng.tokens[0], dense_out.tokens)) >= 12, eng.tokens
        assert 0 < eng.pool["copies"] and eng.ttft_s > 0
        # On demand (the stored Quest index; each step fetches its pages until
        # the bulk load started after the first step completes, then the
        # step's CUDA graphs are captured): the loaded tier's tokens.
        lazy = hf.generate_engine(c, model, info, [ids[-1]], 16, forced=[dense_out.tokens],
                                  on_demand=True, options=EngineOptions(
                                      rho=0.1, rank="max", min_budget=256))
        assert lazy.tokens == eng.tokens
        assert 0 < lazy.first_step_units <= lazy.units_fetched
        with pytest.raises(ValueError, match="generate_engine"):
            hf.generate_client(c, model, info, ids[-1], 4, selection="torch")


@pytest.mark.skipif(transformers is None, reason="set CTXCACHE_HF_TESTS=1 with transformers")
def test_overlapped_prefill_and_ingest_stores_the_prefills_kv(make_server) -> None:
    """prefill_and_ingest(overlap=True): the ingest runs beside the forward,
    layer by layer, and stores exactly the KV a plain prefill computes; a
    forward that fails part-way stores nothing."""
    import ctxcache
    from ctxcache import native
    from ctxcache.engine import HostTier
    from transformers import AutoModelForCausalLM

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(repo, "models", "ctxcache-ref"),
                                                 dtype=torch.bfloat16).to(dev).eval()
    server = make_server([])
    ids = [int(x) for x in np.random.default_rng(3).integers(3, 1000, size=1500)]
    want = hf.prefill(model, ids)
    with ctxcache.Client(server.address, timeout=120) as c, \
            native.NativeClient(server.address, timeout=120) as nc:
        before = len(list(c.list()))
        # The forward fails at layer 3: the ingest's generator ends with an
        # error, the stream is not committed.
        def fail(*_: object) -> None:
            raise RuntimeError("layer 3 failed")

        boom = hf._layers(model)[3].self_attn.register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="layer 3 failed"):
                hf.prefill_and_ingest(nc, model, ids, indexes=["quest"], overlap=True,
                                      send_q=False)
        finally:
            boom.remove()
        assert len(list(c.list())) == before
        info, pre = hf.prefill_and_ingest(nc, model, ids, indexes=["quest"], overlap=True,
                                          send_q=False)
        assert info.n_tokens == len(ids) and pre.q == []
        assert 0 <= pre.ready_after_prefill_s <= pre.ingest_s
        tier = HostTier.from_server(nc, info.context_id, pin=False)
        tier.load.wait()
        tk, tv = tier.token_view()
        for layer in range(len(want.k)):
            assert torch.equal(pre.k[layer], want.k[layer])
            assert torch.equal(tk[layer], want.k[layer]) and torch.equal(tv[layer], want.v[layer])
        # With Q (query-centric indexes read it): the prefill's Q as well.
        info_q, pre_q = hf.prefill_and_ingest(nc, model, ids[:-1], indexes=["csa"], overlap=True)
        assert info_q.n_tokens == len(ids) - 1
        want_q = hf.prefill(model, ids[:-1])
        assert all(torch.equal(a, b) for a, b in zip(pre_q.q, want_q.q))


# ------------------------------------------------- generate_engine on the CPU --
# A LLaMA-shaped model of plain torch modules (the parts LlamaStepper reads:
# embed, RoPE, RMSNorm, q/k/v/o projections, gated MLP, lm_head), so the
# engine adapter runs in CI without transformers.

class _RMSNorm(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * \
            self.weight


class _Rotary(torch.nn.Module):
    def __init__(self, d: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv", 1.0 / theta ** (torch.arange(0, d, 2).float() / d))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        f = position_ids[..., None].float() * self.inv
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class _MLP(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(n, 2 * n, bias=False)
        self.up_proj = torch.nn.Linear(n, 2 * n, bias=False)
        self.down_proj = torch.nn.Linear(2 * n, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self, hidden: int, hq: int, h: int, d: int) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        for name, out in (("q_proj", hq * d), ("k_proj", h * d), ("v_proj", h * d)):
            setattr(self.self_attn, name, torch.nn.Linear(hidden, out, bias=False))
        self.self_attn.o_proj = torch.nn.Linear(hq * d, hidden, bias=False)
        self.input_layernorm = _RMSNorm(hidden)
        self.post_attention_layernorm = _RMSNorm(hidden)
        self.mlp = _MLP(hidden)


class _TinyLlama(torch.nn.Module):
    def __init__(self, layers: int, hq: int, h: int, d: int, vocab: int = 96,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        hidden = hq * d
        self.config = types.SimpleNamespace(
            num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=h,
            head_dim=d, hidden_size=hidden, vocab_size=vocab)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.model.layers = torch.nn.ModuleList(_Layer(hidden, hq, h, d) for _ in range(layers))
        self.model.norm = _RMSNorm(hidden)
        self.model.rotary_emb = _Rotary(d)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.to(torch.bfloat16).eval()


@torch.no_grad()
def _reference_decode(model: _TinyLlama, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                      firsts: List[int], feeds: List[List[int]]) -> tuple:
    """Dense decoding written out: every step's logits [B, steps, vocab] and
    the fed tokens' K [L, B, H, steps, d], attention in float64 over the
    whole stored context plus the tokens so far."""
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    cfg = model.config
    hq, h, d, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, k_ctx.shape[2]
    g = hq // h
    b, steps = len(firsts), len(feeds[0]) + 1
    own_k = torch.zeros(cfg.num_hidden_layers, b, h, steps, d, dtype=torch.bfloat16)
    own_v = torch.zeros_like(own_k)
    logits = torch.zeros(b, steps, cfg.vocab_size)
    tokens = torch.tensor(firsts)
    for t in range(steps):
        x = model.model.embed_tokens(tokens)
        pos = torch.full((b,), n + t)
        cos, sin = model.model.rotary_emb(x.unsqueeze(1), pos.unsqueeze(1))
        cos, sin = cos.view(b, 1, d), sin.view(b, 1, d)
        for li, layer in enumerate(model.model.layers):
            a = layer.self_attn
            hs = layer.input_layernorm(x)
            q = a.q_proj(hs).view(b, hq, d)
            k = a.k_proj(hs).view(b, h, d)
            v = a.v_proj(hs).view(b, h, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            own_k[li, :, :, t], own_v[li, :, :, t] = k, v
            o = torch.zeros(b, hq, d, dtype=torch.float64)
            for s in range(b):
                for j in range(hq):
                    keys = torch.cat([k_ctx[li, j // g], own_k[li, s, j // g, :t + 1]]).double()
                    vals = torch.cat([v_ctx[li, j // g], own_v[li, s, j // g, :t + 1]]).double()
                    w = torch.softmax(keys @ q[s, j].double() / math.sqrt(d), dim=0)
                    o[s, j] = w @ vals
            x = x + a.o_proj(o.to(torch.bfloat16).reshape(b, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits[:, t] = model.lm_head(model.model.norm(x)).float()
        if t + 1 < steps:
            tokens = torch.tensor([f[t] for f in feeds])
    return logits, own_k


def test_generate_engine_decodes_a_stored_context_like_dense_attention(make_server) -> None:
    """hf.generate_engine on the CPU against a real ctxcached: dense and
    sparse at full budget give the written-out dense decoding's logits
    (teacher forced, two sequences), a sparse budget reads part of the
    pool, and write-back stores each sequence's fed tokens as a child
    context holding their K."""
    import ctxcache
    from conftest import random_tokens
    from ctxcache import native
    from ctxcache.engine import EngineOptions, WriteBackOptions

    srv = make_server()
    with native.NativeClient(srv.address, timeout=60) as nc, \
            ctxcache.Client(srv.address, timeout=60) as c:
        cid = nc.build_tokens(random_tokens(700, 21))
        info = c.get(cid)
        m = info.model
        n = int(info.n_tokens)
        k_ctx = torch.zeros(nc.context(cid).kv_shape(), dtype=torch.bfloat16)
        v_ctx = torch.zeros_like(k_ctx)
        nc.load_kv(cid, k_ctx, v_ctx)
        model = _TinyLlama(m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim)
        firsts, steps = [5, 17], 5
        feeds = [[(7 * s + 3 * i) % 90 + 1 for i in range(steps)] for s in range(2)]
        want, want_k = _reference_decode(model, k_ctx, v_ctx, firsts,
                                         [f[:steps - 1] for f in feeds])
        runs = {"dense": hf.generate_engine(c, model, info, firsts, steps, attention="dense",
                                            forced=feeds, keep_logits=True,
                                            write_back=WriteBackOptions()),
                "full": hf.generate_engine(c, model, info, firsts, steps, forced=feeds,
                                           keep_logits=True,
                                           options=EngineOptions(rho=1.0, pool_fraction=1.0))}
        for name, r in runs.items():
            assert r.logits.shape == want.shape, name
            torch.testing.assert_close(r.logits, want, atol=0.03, rtol=0.03, msg=name)
            assert r.tokens == want.argmax(-1).tolist(), name
            assert r.load_s > 0 and r.ttft_s >= r.load_s and r.decode_s > 0
        # a pool of every page is loaded when the decoder is made: this
        # call's steps all hit it
        full_pool = runs["full"].pool
        assert full_pool["copies"] == 0 and full_pool["hit_requests"] > 0, full_pool
        assert "pool" in runs["full"].memory
        assert runs["dense"].memory["context"] == 2 * k_ctx.numel() * 2
        # Write-back: a child per sequence, the context plus its fed tokens,
        # whose appended rows hold the K the decode computed, with the
        # parent's indexes (csa needs the appended tokens' queries).
        parent_methods = sorted(i.method for i in info.indexes)
        assert "csa" in parent_methods
        for s, child in enumerate(runs["dense"].children):
            assert child.n_tokens == n + steps
            assert sorted(i.method for i in child.indexes) == parent_methods
            ck = torch.zeros(nc.context(child.context_id).kv_shape(), dtype=torch.bfloat16)
            nc.load_kv(child.context_id, ck, torch.zeros_like(ck))
            assert torch.equal(ck[:, :, :n], k_ctx)
            torch.testing.assert_close(ck[:, :, n:].float(), want_k[:, s].float(),
                                       atol=0.02, rtol=0.02)
        # A 20% budget with a pool of a tenth of the pages: fewer units
        # copied than the whole context, and every step's tokens.
        sparse = hf.generate_engine(c, model, info, firsts, steps, forced=feeds,
                                    options=EngineOptions(rho=0.2, pool_fraction=0.1))
        assert [len(t) for t in sparse.tokens] == [steps, steps]
        units = m.n_layers * m.n_kv_heads * -(-n // 16)
        assert 0 < sparse.pool["copies"] and sparse.pool["n_slots"] < units
        # Clear errors, nothing decoded.
        with pytest.raises(ValueError, match="attention 'paged'"):
            hf.generate_engine(c, model, info, firsts, steps, attention="paged")
        with pytest.raises(ValueError, match="forced: expected 2 sequences of 5"):
            hf.generate_engine(c, model, info, firsts, steps, forced=[feeds[0]])
        with pytest.raises(ValueError, match="first_tokens: no sequences"):
            hf.generate_engine(c, model, info, [], steps)
        with pytest.raises(ValueError, match="n_new: 0, expected >= 1"):
            hf.generate_engine(c, model, info, firsts, 0)
        other = _TinyLlama(m.n_layers + 1, m.n_q_heads, m.n_kv_heads, m.head_dim)
        with pytest.raises(ValueError, match="the model expects"):
            hf.generate_engine(c, model=other, info=info, first_tokens=firsts, n_new=steps)


def test_on_demand_decoding_equals_a_loaded_tier_and_fetches_only_the_first_steps_pages(
        make_server) -> None:
    """generate_engine(on_demand=True) on the CPU against a real ctxcached:
    the planner's index read from the stored Quest artifacts and a tier
    filled by each step's pages, then by a bulk load after the first step,
    give the same logits and tokens as the tier loaded first; the first
    step fetched only what it attends. Without a stored Quest index it
    fails naming it, nothing decoded."""
    import ctxcache
    from conftest import random_tokens
    from ctxcache.engine import EngineOptions

    srv = make_server()
    with ctxcache.Client(srv.address, timeout=60) as c:
        info = c.build(tokens=random_tokens(900, 23), indexes=["quest"]).context
        m = info.model
        model = _TinyLlama(m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim)
        firsts, steps = [5, 17], 6
        feeds = [[(7 * s + 3 * i) % 90 + 1 for i in range(steps)] for s in range(2)]
        # Periods above 1 plan ahead (EngineOptions.lookahead, the default);
        # period 3 has reuse steps between the planning-ahead ones.
        for period in (1, 2, 3):
            opts = EngineOptions(rho=0.1, pool_fraction=0.2, period=period)
            loaded = hf.generate_engine(c, model, info, firsts, steps, forced=feeds,
                                        keep_logits=True, options=opts)
            lazy = hf.generate_engine(c, model, info, firsts, steps, forced=feeds,
                                      keep_logits=True, options=opts, on_demand=True)
            assert torch.equal(lazy.logits, loaded.logits), period
            assert lazy.tokens == loaded.tokens
            units = m.n_layers * m.n_kv_heads * -(-int(info.n_tokens) // 16)
            # Two sequences' pages of every layer: at most 2 x kp per kv head.
            assert 0 < lazy.first_step_units < units // 2, (lazy.first_step_units, units)
            assert lazy.first_step_units <= lazy.units_fetched <= units
        with pytest.raises(ValueError, match="on_demand: for attention 'sparse'"):
            hf.generate_engine(c, model, info, firsts, steps, attention="dense", on_demand=True)
        plain = c.build(tokens=random_tokens(900, 24), indexes=["streaming"]).context
        with pytest.raises(ctxcache.errors.FailedPrecondition, match="no .quest. index"):
            hf.generate_engine(c, model, plain, firsts, steps, on_demand=True)


def test_engine_decoding_is_kept_between_calls(make_server) -> None:
    """hf.EngineDecoding: one decoder for many calls; a later call decodes
    exactly like the first (the pool keeps its pages: fewer copies), and a
    call of another batch size or past max_new_tokens is a ValueError."""
    from conftest import random_tokens
    from ctxcache import native
    from ctxcache.engine import EngineOptions, HostTier

    srv = make_server()
    with native.NativeClient(srv.address, timeout=60) as nc:
        cid = nc.build_tokens(random_tokens(900, 23))
        shape = nc.context(cid)
        tier = HostTier.from_server(nc, cid, streams=2, pin=False)
        with tier.load:
            tier.load.wait()
        model = _TinyLlama(shape.n_layers, shape.n_q_heads, shape.n_kv_heads, shape.head_dim)
        eng = hf.EngineDecoding(model, tier, 2, 6, keep_logits=True,
                                options=EngineOptions(rho=0.2, pool_fraction=0.5))
        first = eng.generate([4, 9], 6)
        again = eng.generate([4, 9], 6)
        assert again.tokens == first.tokens and torch.equal(again.logits, first.logits)
        assert 0 < again.pool["copies"] < first.pool["copies"], (first.pool, again.pool)
        shorter = eng.generate([4, 9], 3)
        assert [t[:3] for t in first.tokens] == shorter.tokens
        with pytest.raises(ValueError, match="first_tokens: 1 sequences, expected the batch's 2"):
            eng.generate([4], 2)
        with pytest.raises(ValueError, match="n_new: 7, expected 1..6"):
            eng.generate([4, 9], 7)
