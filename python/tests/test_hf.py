"""ctxcache.torch.hf: the decode attention (torch, CPU) always; the HF
transformers path only where transformers is installed (the GPU machine:
scripts/gpu-suite.sh), against the real ctxcached."""
from __future__ import annotations

import os

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
    ctx_k = [k[h // 4, :n] for h in range(nq)]
    ctx_v = [v[h // 4, :n] for h in range(nq)]
    got = hf.attend(q, ctx_k, ctx_v, k[:, n:], v[:, n:], d ** -0.5)
    torch.testing.assert_close(got, dense(q, k, v, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_gather_selected_gives_each_q_head_its_own_rows() -> None:
    d = 4
    ids = np.array([1, 5, 9], dtype=np.int64)
    k = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    head = HeadResult(kv_head=0, per_q_head=[np.array([1, 9]), np.array([5])], ids=ids, k=k,
                      v=k + 100)
    step = StepResult(layer=0, heads=[head], selections=[], page_tables=[], stats=None,
                      bytes_received=0)
    ks, vs = hf.gather_selected(step, 2, "cpu", torch.float32)
    assert torch.equal(ks[0], torch.tensor(k[[0, 2]]))
    assert torch.equal(ks[1], torch.tensor(k[[1]]))
    assert torch.equal(vs[1], torch.tensor(k[[1]] + 100))


transformers = pytest.importorskip("transformers") if os.environ.get("CTXCACHE_HF_TESTS") else None


@pytest.mark.skipif(transformers is None, reason="set CTXCACHE_HF_TESTS=1 with transformers")
def test_hf_full_through_ctxcache_equals_dense_and_csa_agrees(make_server) -> None:
    import ctxcache
    from transformers import AutoModelForCausalLM

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(repo, "models", "ctxcache-ref"),
                                                 dtype=torch.bfloat16).to(dev).eval()
    server = make_server(["--default-indexes", "csa"])
    ids = list(np.random.default_rng(0).integers(3, 1000, size=1200))
    with ctxcache.Client(server.address, timeout=120) as c:
        info, pre = hf.prefill_and_ingest(c, model, ids[:-1], indexes=["csa"])
        dense_out = hf.generate_dense(model, pre, ids[-1], 16)
        full = hf.generate(c, model, info, ids[-1], 16, method="full")
        assert full.tokens == dense_out.tokens
        for a, b in zip(full.logits, dense_out.logits):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        csa = hf.generate(c, model, info, ids[-1], 16, method="csa")
        assert len(csa.tokens) == 16
        assert csa.bytes_received < full.bytes_received
