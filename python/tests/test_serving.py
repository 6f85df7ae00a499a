"""ctxcache.serving against real ctxcached processes: request routing, prefix
matching through the content-addressed id, the host KV cache, and the
fallback policy when a context is missing, ctxcached is down or restarts,
or a context is evicted while its KV loads. The transformers adapter's
tests need transformers (and run on the GPU host's suite); they skip here
when it is not importable.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import List

import numpy as np
import pytest

import ctxcache
from ctxcache.serving import (TOKEN_KEY_LABEL, ModelShape, Resolver, ServingOptions, publish,
                              token_key)
from conftest import REPO, free_port, random_tokens

LLAMA3 = ModelShape(n_layers=2, n_kv_heads=2, head_dim=32)  # tests/data/golden/llama3
# Every wait in these tests is bounded by the options below; this bounds the
# whole fallback path (a bound, not a speed expectation).
BOUND_S = 30.0


def _native_available() -> bool:
    try:
        ctxcache.native.library_path()
        return True
    except FileNotFoundError:
        return False


needs_native = pytest.mark.skipif(not _native_available(),
                                  reason="libctxcache_c.so not found (CTXCACHE_BIN_DIR)")


def _resolver(address: str, fp: bytes, **opts) -> Resolver:
    o = ServingOptions(rpc_timeout_s=2.0, rpc_attempts=2, load_timeout_s=20.0,
                       refresh_interval_s=0.0, min_prefix_tokens=16, **opts)
    return Resolver(address, [fp], LLAMA3, o)


@pytest.fixture(scope="module")
def contexts(client: ctxcache.Client):
    """Two stored contexts on the llama3 model, the second extending the first's tokens."""
    a = random_tokens(160, 71, vocab=256)  # ids every golden model has (mistral: 256)
    ab = a + random_tokens(96, 72, vocab=256)
    ia = client.build(tokens=a).context
    iab = client.build(tokens=ab).context
    return {"a": (ia, a), "ab": (iab, ab), "fp": bytes(ia.model.fingerprint)}


def test_token_key_is_the_id_of_a_default_tenant_build(contexts) -> None:
    info, toks = contexts["a"]
    assert info.provenance == 0 and info.tenant == ""
    assert token_key(contexts["fp"], toks) == info.context_id
    assert token_key(contexts["fp"], toks, namespace=b"Bxyz") != info.context_id
    assert token_key(contexts["fp"], toks[:-1]) != info.context_id
    with pytest.raises(ValueError, match="uint32"):
        token_key(contexts["fp"], [1, -2])


def test_prompt_prefix_matches_the_longest_stored_context(server, contexts) -> None:
    (ia, a), (iab, ab) = contexts["a"], contexts["ab"]
    q = [5, 6, 7, 8]
    with _resolver(server.address, contexts["fp"]) as r:
        longest = r.resolve_prefix(ab + q)
        assert (longest.context_id, longest.prefix_tokens, longest.outcome) == \
            (iab.context_id, len(ab), "hit")
        assert longest.prompt == ab + q
        shorter = r.resolve_prefix(a + q)
        assert (shorter.context_id, shorter.prefix_tokens) == (ia.context_id, len(a))
        # The prompt may be exactly the context (the engine keeps one token to prefill).
        assert r.resolve_prefix(a).context_id == ia.context_id
        # Not a prefix: a token changed inside it, a token in front, or only part of it.
        changed = list(a)
        changed[80] = (changed[80] + 1) % 256
        for prompt in (changed + q, [1] + a + q, a[:100] + q, q):
            res = r.resolve_prefix(prompt)
            assert (res.context_id, res.prefix_tokens, res.outcome) == (None, 0, "no_match")
            assert res.prompt == prompt
        assert r.outcomes["no_match"] == 4
        # Ids of any integer type are routed as Python ints; a bad id is
        # refused by position before any RPC.
        res = r.resolve_prefix([np.int64(t) for t in a] + q)
        assert res.context_id == ia.context_id and type(res.prompt[0]) is int
        for bad, at in (([-1], 160), ([1.5], 160), ([1 << 32], 160)):
            with pytest.raises(ValueError, match=f"tokens: id .* at index {at} is not a uint32"):
                r.resolve_prefix(a + bad)


def test_another_models_context_never_matches(client, server, contexts) -> None:
    toks = contexts["a"][1]
    other = client.build(tokens=toks, model="mistral").context  # 4 q / 1 kv heads
    assert bytes(other.model.fingerprint) != contexts["fp"]
    with _resolver(server.address, contexts["fp"]) as r:
        res = r.resolve_prefix(toks + [9, 9])
        assert res.context_id == contexts["a"][0].context_id  # llama3's, never mistral's
        with pytest.raises(ctxcache.InvalidArgument, match="context_id: .*not one this engine"):
            r.resolve_prefix([9], context_id=other.context_id)
    # An engine of the other model matches only its own context.
    shape = ModelShape(int(other.model.n_layers), int(other.model.n_kv_heads),
                       int(other.model.head_dim))
    with Resolver(server.address, [bytes(other.model.fingerprint)], shape,
                  ServingOptions(refresh_interval_s=0.0)) as r2:
        assert r2.resolve_prefix(toks + [9]).context_id == other.context_id


@needs_native
def test_named_context_prepends_its_tokens_and_loads_its_kv_once(client, server,
                                                                  contexts) -> None:
    info, toks = contexts["ab"]
    with _resolver(server.address, contexts["fp"]) as r:
        with pytest.raises(ctxcache.FailedPrecondition, match="token ids .* unknown"):
            r.resolve([1, 2], context_id=info.context_id)  # tokens never seen here
        with pytest.raises(ValueError, match="do not hash"):
            r.register_tokens(info.context_id, toks[:-1] + [toks[-1] ^ 1])
        r.register_tokens(info.context_id, toks)
        res = r.resolve([1, 2], context_id=info.context_id.upper())
        assert res.prompt == toks + [1, 2] and res.prefix_tokens == len(toks)
        with pytest.raises(ctxcache.InvalidArgument, match="context_id: 'nope', expected 32 hex"):
            r.resolve([1], context_id="nope")
        with pytest.raises(ctxcache.NotFound):
            r.resolve([1], context_id="0" * 32)
        # Sixteen concurrent requests on the context: one load, the same buffers.
        got: List = []
        threads = [threading.Thread(target=lambda: got.append(r.resolve(toks + [3])))
                   for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert len(got) == 16 and all(g.kv is res.kv for g in got)
        assert r.kv_cache.loads == 1 and r.kv_cache.hits >= 16
        # prefetch: routing for its side effects, uncounted, never raising.
        before = dict(r.outcomes)
        r.prefetch(toks + [3])
        r.prefetch([1], context_id="nope")
        assert r.outcomes == before
        # The KV is the stored pages' (bf16 bits), layer 1, kv head 1, page 2.
        page = client.fetch_pages(info.context_id, [(1, 1, [2])], dtype="raw")[0]
        assert np.array_equal(_bf16_bits(res.kv.k[1, 1, 32:48]),
                              np.asarray(page.k).reshape(16, 32).view(np.uint16))


def _bf16_bits(x) -> np.ndarray:
    """uint16 bits of a bf16 torch tensor (or of a uint16 numpy array)."""
    if hasattr(x, "numpy"):
        import torch
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.asarray(x, np.uint16)


def _as_f32(x) -> np.ndarray:
    return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


@needs_native
def test_published_context_matches_through_its_token_key_label(client, server) -> None:
    rng = np.random.default_rng(5)
    fp = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    spec = {"name": "engine-test", "n_layers": 2, "n_q_heads": 4, "n_kv_heads": 2,
            "head_dim": 32, "kv_dtype": "bf16", "fingerprint": fp}
    toks = random_tokens(64, 81)
    layers = [(rng.standard_normal((2, 64, 32)).astype(np.float32),
               rng.standard_normal((2, 64, 32)).astype(np.float32)) for _ in range(2)]
    with _resolver(server.address, fp) as r:
        # Ingested without the label: its id is in the ingest namespace, so
        # nothing can be matched, and publishing the same tokens later is refused.
        other = random_tokens(64, 82)
        plain = client.ingest(spec, other, layers, indexes=["streaming"])
        assert plain.provenance == 1 and token_key(fp, other) != plain.context_id
        assert r.resolve_prefix(other + [1]).outcome == "no_match"
        with pytest.raises(ctxcache.AlreadyExists, match="without the ctxcache.token_key label"):
            publish(client, spec, other, layers, indexes=["streaming"])
        info = publish(client, spec, toks, layers, indexes=["streaming"], name="published")
        assert info.labels[TOKEN_KEY_LABEL] == token_key(fp, toks)
        res = r.resolve(toks + [1, 2])
        assert (res.context_id, res.prefix_tokens) == (info.context_id, 64)
        # The KV round-trips (bf16 of what was ingested).
        want = layers[1][0][1, 10]
        assert np.allclose(_as_f32(res.kv.k[1, 1, 10]), want, rtol=1 / 128, atol=1e-6)
        # Once matched, it can also be named by id.
        assert r.resolve([7], context_id=info.context_id).prompt == toks + [7]


def test_options_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="on_missing: 'retry', expected one of prefill, error"):
        ServingOptions(on_missing="retry").validate()
    with pytest.raises(ValueError, match="load_timeout_s: 0, expected a number of seconds > 0"):
        ServingOptions(load_timeout_s=0).validate()
    with pytest.raises(ValueError, match="min_prefix_tokens: 0, expected an integer >= 1"):
        ServingOptions(min_prefix_tokens=0).validate()
    with pytest.raises(ValueError, match=r"unknown serving option\(s\) \['on_mising'\]"):
        ServingOptions.from_mapping({"on_mising": "error"})
    assert ServingOptions.from_mapping({"on_missing": "error"}).on_missing == "error"
    with pytest.raises(ValueError, match="attention: 'quest', expected one of dense, sparse"):
        ServingOptions(attention="quest").validate()
    with pytest.raises(ValueError, match=r"sparse_rho: 0, expected a fraction in \(0, 1\]"):
        ServingOptions(sparse_rho=0).validate()
    with pytest.raises(ValueError, match="sparse_min_tokens: -1, expected an integer >= 0"):
        ServingOptions(sparse_min_tokens=-1).validate()
    with pytest.raises(ValueError, match="sparse_prefill_rho: 2, expected a fraction"):
        ServingOptions(sparse_prefill_rho=2).validate()
    with pytest.raises(ValueError, match="kv_transport: 'shm', expected one of auto, fetch, map"):
        ServingOptions(kv_transport="shm").validate()
    assert ServingOptions(attention="sparse").validate().sparse_rho == 0.05


@needs_native
def test_kv_transports_load_the_same_kv_and_auto_falls_back_to_fetch(make_server,
                                                                   contexts) -> None:
    """HostKVCache over FetchKV and over MapKV (ctxcached's segment, views
    with no copy) holds the same K and V; "auto" maps on a loopback address
    and, when MapKV is off, fetches and says why; "map" then fails."""
    import torch
    from ctxcache.serving import HostKVCache
    from ctxcache.serving.kv import HostKV
    with pytest.raises(ValueError, match="transport: 'tcp', expected one of auto, fetch, map"):
        HostKVCache("127.0.0.1:1", transport="tcp")
    srv = make_server()
    toks = random_tokens(200, 77, vocab=256)
    with ctxcache.Client(srv.address, timeout=60) as c:
        cid = c.build(tokens=toks).context.context_id
    got = {}
    for transport in ("fetch", "map", "auto"):
        with HostKVCache(srv.address, transport=transport, load_timeout_s=BOUND_S) as kc:
            kv: HostKV = kc.get(cid)
            assert kc.mapped_loads == (transport != "fetch") and kc.map_off is None
            got[transport] = (kv.k.clone(), kv.v.clone())
            assert kv.k.shape == (2, 2, 200, 32) and kv.k.dtype == torch.bfloat16
    for transport in ("map", "auto"):
        assert torch.equal(got[transport][0], got["fetch"][0])
        assert torch.equal(got[transport][1], got["fetch"][1])
    # A mapped KV outlives its cache: the segment stays mapped while tensors use it.
    with HostKVCache(srv.address, transport="map", load_timeout_s=BOUND_S) as kc:
        k = kc.get(cid).k
    assert torch.equal(k, got["fetch"][0])
    del k
    off = make_server(["--shm-socket", "off"])
    with ctxcache.Client(off.address, timeout=60) as c:
        cid = c.build(tokens=toks).context.context_id
    with HostKVCache(off.address, transport="auto", load_timeout_s=BOUND_S) as kc:
        assert torch.equal(kc.get(cid).k, got["fetch"][0])
        assert kc.mapped_loads == 0 and "--shm-socket off" in kc.map_off
    with HostKVCache(off.address, transport="map", load_timeout_s=BOUND_S) as kc:
        with pytest.raises(ctxcache.FailedPrecondition, match="--shm-socket off"):
            kc.get(cid)


@needs_native
def test_a_mapped_load_from_a_stalled_ctxcached_ends_within_load_timeout(make_server) -> None:
    """A MapKV load from a ctxcached that stopped answering (SIGSTOP) fails
    within load_timeout_s, and a load after it resumes works. The check on
    the elapsed time is against timers (the deadline; without the bound the
    call's deadline was 32 times the timeout), not against the machine's
    speed: both processes are idle while it waits."""
    import torch
    from ctxcache.serving import HostKVCache
    srv = make_server()
    toks = random_tokens(64, 79, vocab=256)
    with ctxcache.Client(srv.address, timeout=60) as c:
        cid = c.build(tokens=toks).context.context_id
    with ctxcache.native.NativeClient(srv.address, timeout=60) as nc:
        shape = nc.context(cid)
    timeout = 1.0
    with HostKVCache(srv.address, transport="map", load_timeout_s=timeout) as kc:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises((ctxcache.DeadlineExceeded, ctxcache.Unavailable)):
                kc.get(cid, shape=shape)
            assert time.monotonic() - t < 16 * timeout
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert kc.get(cid, shape=shape).k.shape == (2, 2, 64, 32)
        assert kc.get(cid).k.dtype == torch.bfloat16


@needs_native
def test_context_evicted_while_its_kv_loads(client, server) -> None:
    toks = random_tokens(128, 91)
    for policy in ("prefill", "error"):
        info = client.build(tokens=toks).context
        with _resolver(server.address, bytes(info.model.fingerprint), on_missing=policy) as r:
            hit = r.resolve_prefix(toks + [4])
            assert hit.context_id == info.context_id
            assert client.evict(info.context_id).evicted  # between routing and loading
            if policy == "prefill":
                res = r.load(hit)
                assert (res.context_id, res.prefix_tokens, res.kv) == (None, 0, None)
                assert res.outcome == "fallback:NotFound" and res.prompt == toks + [4]
            else:
                with pytest.raises(ctxcache.NotFound):
                    r.load(hit)
            # Gone from the index too: the next request is a plain one.
            assert r.resolve(toks + [4]).outcome == "no_match"
            # A named context that is gone: prefilled over its known tokens, or NotFound.
            if policy == "prefill":
                named = r.resolve([4], context_id=info.context_id)
                assert named.outcome == "fallback:NotFound" and named.prompt == toks + [4]
            else:
                with pytest.raises(ctxcache.NotFound):
                    r.resolve([4], context_id=info.context_id)


@needs_native
def test_ctxcached_down_then_restarted(make_server) -> None:
    port = free_port()
    srv = make_server(listen=f"127.0.0.1:{port}")
    toks = random_tokens(96, 101)
    with ctxcache.Client(srv.address, timeout=60) as c:
        info = c.build(tokens=toks).context
    fp = bytes(info.model.fingerprint)
    with _resolver(srv.address, fp) as prefill, \
            _resolver(srv.address, fp, on_missing="error") as strict:
        assert prefill.resolve(toks + [1]).kv is not None
        assert prefill.kv_cache.loads == 1
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(BOUND_S)
        for r in (prefill, strict):
            r.kv_cache.drop(info.context_id)  # a load is needed: it must fail, not hang
        t0 = time.monotonic()
        res = prefill.resolve(toks + [1])
        assert res.outcome == "fallback:Unavailable" and res.prompt == toks + [1]
        with pytest.raises(ctxcache.Unavailable):
            strict.resolve(toks + [1])
        # A stale index (no refresh) still confirms with GetContext: same outcome.
        prefill.index.refresh_interval_s = 3600.0
        assert prefill.resolve(toks + [2]).outcome == "fallback:Unavailable"
        assert time.monotonic() - t0 < 3 * BOUND_S
        srv.proc = None
        srv.start()  # same data dir, same port
        got = prefill.resolve(toks + [3])
        assert (got.outcome, got.context_id) == ("hit", info.context_id)
        assert got.kv is not None and prefill.kv_cache.loads == 2
        assert strict.resolve(toks + [3]).context_id == info.context_id


# ------------------------------------------------------- transformers --

def _tiny_model(device: str):
    transformers = pytest.importorskip("transformers")
    import torch
    path = os.path.join(REPO, "tests", "data", "golden", "llama3")
    # fp32 weights and KV (stored as f32): greedy ties cannot flip on rounding
    # differences between batch shapes.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="paged|sdpa").to(device).eval()
    return model


@needs_native
def test_transformers_full_prefix_gives_plain_generate_batch_tokens(client, server,
                                                                    monkeypatch) -> None:
    """Through transformers' continuous batching: requests over a stored
    context (KV captured from the engine's own prefill and published) give
    the greedy tokens plain generate_batch gives, and the backend seeded its
    blocks; a request with no stored prefix is unchanged."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ctxcache.serving import transformers_cb as tcb
    from ctxcache.torch import hf
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _tiny_model(device)
    block = 32
    def cb_cfg() -> "transformers.ContinuousBatchingConfig":
        cfg = transformers.ContinuousBatchingConfig(block_size=block, num_blocks=64,
                                                    max_batch_tokens=256)
        cfg.allow_block_sharing = True  # prefix sharing: how stored prefixes are served
        return cfg
    gen = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    ctx = random_tokens(4 * block, 111)
    prompts = [ctx + [7 + i, 8, 9] for i in range(6)] + [random_tokens(40, 112)]
    plain = model.generate_batch(prompts, generation_config=gen,
                                 continuous_batching_config=cb_cfg(), warmup=False)
    want = [list(o.generated_tokens) for o in plain.values()]
    # The context's KV as the engine computes it, published with its token key.
    mgr = model.init_continuous_batching(generation_config=gen,
                                         continuous_batching_config=cb_cfg())
    mgr.start()
    try:
        mgr.add_request(ctx + [1], request_id="capture", max_new_tokens=2)
        out = mgr.get_result(request_id="capture", timeout=BOUND_S)
        assert out is not None and out.error is None
        kv = tcb.capture_prefix_kv(mgr, ctx)
    finally:
        mgr.stop(block=True, timeout=BOUND_S)
        mgr.destroy()
    assert kv is not None and kv[0].shape[2] == len(ctx)
    spec = dict(hf.model_spec(model, "tiny-llama3"), kv_dtype="f32")
    publish(client, spec, ctx, [(kv[0][i], kv[1][i]) for i in range(kv[0].shape[0])],
            indexes=["streaming"])

    # generate_batch goes through add_requests: every prompt routed before
    # any is submitted (recorded per manager call, not timed).
    calls: list = []
    for name in ("_route", "_submit"):
        real = getattr(tcb.CtxcacheBatchingManager, name)

        def wrapped(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(tcb.CtxcacheBatchingManager, name, wrapped)

    def run_backend(options: ServingOptions):
        calls.clear()
        b = tcb.CtxcacheBackend(server.address, model, [spec["fingerprint"]], options)
        try:
            outs = b.generate_batch(prompts, generation_config=gen,
                                    continuous_batching_config=cb_cfg(), warmup=False,
                                    timeout_s=120)
            # the warmup's selection kernels: the stored context's 4 blocks,
            # batches of 1, 2, 4 and 8 (none in dense mode)
            warmed = b.warm_sparse_kernels(block, 8)
            assert warmed == (4 if options.attention == "sparse" else 0), warmed
            return outs, b.stats()
        finally:
            b.close()
    got, stats = run_backend(ServingOptions(refresh_interval_s=0.0, rpc_timeout_s=5.0))
    assert [list(o.generated_tokens) for o in got.values()] == want
    assert stats["outcomes"].get("hit", 0) == 6 and stats["outcomes"]["no_match"] == 1
    assert stats["kv_loads"] == 1 and stats["seeded_blocks"] >= 4
    assert calls == ["_route"] * len(prompts) + ["_submit"] * len(prompts), calls
    # attention="sparse" (ctxcache.serving.sparse): with every page kept it is
    # dense attention computed in parts (a decode batch: one masked softmax
    # per prefix), so the same greedy tokens (fp32);
    # with a quarter of the pages it still serves every request. Every
    # request over the context took the sparse path, and the model's own
    # attention implementation is back afterwards.
    for rho in (1.0, 0.25):
        outs, st = run_backend(ServingOptions(refresh_interval_s=0.0, rpc_timeout_s=5.0,
                                              attention="sparse", sparse_rho=rho,
                                              sparse_min_tokens=0))
        toks = [list(o.generated_tokens) for o in outs.values()]
        assert len(toks) == len(prompts) and all(len(t) == 8 for t in toks), toks
        assert st["sparse_prefix_requests"] >= 6 and st["prefix_index_bytes"] > 0, st
        # the decode steps (7 per request) went through the batched call
        assert st["sparse_batched_requests"] >= 7 * len(prompts), st
        assert len(st["sparse_forward_log"]) == st["sparse_forwards"], st
        # every forward, the prompts' too, read the block table: no host
        # read index of the past tokens
        assert st["sparse_table_forwards"] == st["sparse_forwards"], st
        if rho == 1.0:
            assert toks == want
        assert model.config._attn_implementation == "paged|sdpa"
    # ctxcached unreachable: "prefill" gives the same tokens, "error" fails
    # every request with a message (nothing hangs: bounded by the options).
    dead = f"127.0.0.1:{free_port()}"
    for policy in ("prefill", "error"):
        b = tcb.CtxcacheBackend(dead, model, [spec["fingerprint"]],
                                ServingOptions(on_missing=policy, rpc_timeout_s=1.0,
                                               rpc_attempts=1))
        try:
            t0 = time.monotonic()
            outs = b.generate_batch(prompts, generation_config=gen,
                                    continuous_batching_config=cb_cfg(), warmup=False,
                                    timeout_s=120)
            assert time.monotonic() - t0 < 120
        finally:
            b.close()
        if policy == "prefill":
            assert [list(o.generated_tokens) for o in outs.values()] == want
        else:
            assert len(outs) == len(prompts)
            assert all(o.error is not None and "UNAVAILABLE" in o.error
                       for o in outs.values())


def test_serve_without_the_server_packages_says_which_are_missing(capsys) -> None:
    """transformers serve imports fastapi, uvicorn and openai: without them the
    launcher exits 2 naming the missing ones, before loading anything."""
    from ctxcache.serving import serve
    missing = serve.missing_server_packages()
    if not missing:
        pytest.skip("fastapi, uvicorn and openai are installed")
    rc = serve.main(["--model", "models/ctxcache-ref", "--ctxcache", "127.0.0.1:1"])
    assert rc == 2
    err = capsys.readouterr().err
    for m in missing:
        assert m in err


def test_serve_refuses_bad_sparse_settings_before_loading(capsys) -> None:
    """The launcher's sparse flags reach ServingOptions: a bad value exits 2
    naming the field, before any package or model is looked at."""
    from ctxcache.serving import serve
    rc = serve.main(["--model", "models/ctxcache-ref", "--ctxcache", "127.0.0.1:1",
                     "--attention", "sparse", "--sparse-rho", "0"])
    assert rc == 2
    assert "sparse_rho: 0.0, expected a fraction in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--model", "m", "--ctxcache", "127.0.0.1:1", "--attention", "quest"])
