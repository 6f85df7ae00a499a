"""ContextAdmin against a real ctxcached: build, extend, get, list, pin, evict,
stats, watch, and the mapping of server errors to exception classes."""
from __future__ import annotations

import sys
import threading
import time
import types
from typing import List

import pytest

import ctxcache
from conftest import random_tokens

pb = ctxcache.pb
Phase = pb.BuildProgress


def test_build_streams_monotonic_progress_and_is_idempotent(client: ctxcache.Client) -> None:
    tokens = random_tokens(700, 2)
    progress: List[pb.BuildProgress] = []
    done = client.build(tokens=tokens, name="progress", labels={"suite": "py"},
                        on_progress=progress.append)
    assert len(progress) >= 3
    phases = [p.phase for p in progress]
    assert phases == sorted(phases), phases
    assert Phase.PREFILL in phases and phases[-1] == Phase.DONE
    prefilled = [p.tokens_prefilled for p in progress]
    assert prefilled == sorted(prefilled)
    assert progress[-1] is done or progress[-1] == done
    ctx = done.context
    assert not done.reused
    assert ctx.state == ctxcache.storage_pb.CONTEXT_STATE_READY
    assert ctx.n_tokens == 700 and len(ctx.context_id) == 32
    assert ctx.name == "progress" and dict(ctx.labels) == {"suite": "py"}
    assert {i.method for i in ctx.indexes} >= {"csa", "tactic"}
    assert ctx.bytes_by_kind["index/csa"] > 0 and ctx.bytes_by_kind["pages"] > 0
    again = client.build(tokens=tokens)
    assert again.reused and again.context.context_id == ctx.context_id
    # Numpy and torch-free token inputs give the same id.
    import numpy as np
    assert client.build(tokens=np.array(tokens, dtype=np.int32)).context.context_id == \
        ctx.context_id


def test_build_shows_a_tqdm_bar_without_callback(client: ctxcache.Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bars: List["FakeBar"] = []

    class FakeBar:
        def __init__(self, total=None, unit="", desc=""):
            self.total, self.unit, self.desc, self.n, self.closed = total, unit, desc, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    fake = types.ModuleType("tqdm.auto")
    fake.tqdm = FakeBar
    monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
    monkeypatch.setitem(sys.modules, "tqdm.auto", fake)
    client.build(tokens=random_tokens(200, 3), progress=True)
    units = [b.unit for b in bars]
    assert "tok" in units, units
    tok = bars[units.index("tok")]
    assert tok.total == 200 and tok.n == 200 and tok.closed
    assert all(b.closed for b in bars)
    bars.clear()
    client.build(tokens=random_tokens(200, 3), progress=False)  # reused, and no bar asked
    assert bars == []


def test_extend_appends_to_the_parent(client: ctxcache.Client,
                                      built: ctxcache.pb.ContextInfo) -> None:
    done = client.extend(built.context_id, tokens=random_tokens(40, 4), name="child")
    child = done.context
    assert child.n_tokens == built.n_tokens + 40
    assert child.parent_id == built.context_id and child.prefix_tokens == built.n_tokens
    assert child.context_id != built.context_id
    assert {i.method for i in child.indexes} == {i.method for i in built.indexes}
    # A parent of a child cannot be evicted.
    with pytest.raises(ctxcache.FailedPrecondition):
        client.evict(built.context_id)
    assert client.evict(child.context_id).evicted


def test_get_list_pin_evict_stats(client: ctxcache.Client) -> None:
    ids = [client.build(tokens=random_tokens(50, 100 + i), labels={"batch": "list", "i": i}
                        ).context.context_id for i in range(3)]
    got = client.get(ids[0])
    assert got.context_id == ids[0] and got.n_tokens == 50 and got.labels["i"] == "0"
    # Paginated iteration sees every context; page_size 1 forces several pages.
    listed = [c.context_id for c in client.list(label_filter={"batch": "list"}, page_size=1)]
    assert sorted(listed) == sorted(ids)
    first = client.list_page(page_size=1, label_filter={"batch": "list"})
    assert len(first.contexts) == 1 and first.next_page_token
    assert [c.context_id for c in client.list(label_filter={"i": 2})] == [ids[2]]
    assert len(list(client.list(label_filter={"batch": "list"}, limit=2))) == 2
    assert ids[0] in {c.context_id for c in client.list(state="READY", page_size=1000)}
    # Pin: eviction refused until unpinned.
    assert client.pin(ids[0]).pinned
    assert client.get(ids[0]).pinned
    with pytest.raises(ctxcache.FailedPrecondition, match="pinned"):
        client.evict(ids[0])
    assert not client.unpin(ids[0]).pinned
    before = client.stats()
    ev = client.evict(ids[0])
    assert ev.evicted and not ev.deferred and ev.bytes_reclaimed > 0
    with pytest.raises(ctxcache.NotFound):
        client.get(ids[0])
    after = client.stats()
    assert after.n_contexts == before.n_contexts - 1
    assert after.stored_bytes < before.stored_bytes
    assert "llama3" in after.models and after.version and after.uptime_s > 0


def test_the_same_tokens_built_again_store_the_same_bytes(client: ctxcache.Client) -> None:
    # Rebuilding evicted text must store the same KV pages and index
    # artifacts bit for bit: the prefill's results once depended on where
    # the heap put its buffers (Eigen's elementwise exp; model.h
    # AlignedFloats), and rebuilds on one server differed in a few values.
    import hashlib

    tokens = random_tokens(1500, 77)
    seen = set()
    for _ in range(3):
        info = client.build(tokens=tokens, indexes=["csa"]).context
        n_pages = (info.n_tokens + 15) // 16
        h = hashlib.sha256()
        for layer in range(info.model.n_layers):
            for p in client.fetch_wire_pages(info.context_id, [
                    (layer, kv, list(range(n_pages))) for kv in range(info.model.n_kv_heads)]):
                h.update(p.k)
                h.update(p.v)
        for key, blob in sorted(client.fetch_index(info.context_id, "csa").items()):
            h.update(blob)
        seen.add(h.hexdigest())
        assert client.evict(info.context_id).evicted
    assert len(seen) == 1


@pytest.mark.parametrize("call,cls", [
    (lambda c: c.get("00112233445566778899aabbccddeeff"), ctxcache.NotFound),
    (lambda c: c.get("xyz"), ctxcache.InvalidArgument),
    (lambda c: c.get(""), ctxcache.InvalidArgument),
    (lambda c: c.evict("00112233445566778899aabbccddeeff"), ctxcache.NotFound),
    (lambda c: c.pin("not-hex-not-hex-not-hex-not-hex!"), ctxcache.InvalidArgument),
    (lambda c: c.build(tokens=[]), ctxcache.InvalidArgument),
    (lambda c: c.build(tokens=[1, 2], indexes=["nope"]), ctxcache.InvalidArgument),
    (lambda c: c.build(tokens=[1, 2], indexes=[("csa", {"bogus": 1})]),
     ctxcache.InvalidArgument),
    (lambda c: c.build(tokens=[100000]), ctxcache.InvalidArgument),  # outside the vocabulary
    (lambda c: c.build(tokens=[1], model="no-such-model"), ctxcache.NotFound),
    (lambda c: c.build(text="hello"), ctxcache.FailedPrecondition),  # llama3 has no tokenizer
    (lambda c: c.extend("00112233445566778899aabbccddeeff", tokens=[1]), ctxcache.NotFound),
], ids=["unknown-id", "bad-id", "empty-id", "evict-unknown", "pin-bad-id", "no-tokens",
        "unknown-method", "unknown-param", "token-outside-vocab", "unknown-model",
        "text-without-tokenizer", "extend-unknown-parent"])
def test_errors_map_to_their_classes(client: ctxcache.Client, call, cls) -> None:
    with pytest.raises(cls) as info:
        call(client)
    e = info.value
    assert isinstance(e, ctxcache.Error) and e.code == cls.code
    assert e.message  # the server's message
    assert e.rpc


def test_unknown_model_message_lists_the_models(client: ctxcache.Client) -> None:
    with pytest.raises(ctxcache.NotFound, match="llama3"):
        client.build(tokens=[1], model="no-such-model")


def test_conflicting_index_params_are_already_exists(client: ctxcache.Client,
                                                     built: ctxcache.pb.ContextInfo) -> None:
    with pytest.raises(ctxcache.AlreadyExists) as info:
        client.build(tokens=random_tokens(300, 1), indexes=[("csa", {"alpha": 0.5})])
    assert "alpha=0.5" in info.value.message and "evict" in info.value.message
    assert client.get(built.context_id).stored_bytes == built.stored_bytes


def test_watch_sees_created_and_ready(client: ctxcache.Client) -> None:
    tokens = random_tokens(120, 5)
    with client.watch(label_filter={"watch": "me"}, timeout=60, max_events=10) as w:
        done = client.build(tokens=tokens, labels={"watch": "me"})
        cid = done.context.context_id
        seen = []
        for ev in w:
            seen.append(pb.ContextEvent.Type.Name(ev.type))
            assert ev.context.context_id == cid
            if ev.type == pb.ContextEvent.READY:
                assert ev.context.state == ctxcache.storage_pb.CONTEXT_STATE_READY
                assert ev.context.n_tokens == 120 and ev.at_ms > 0
                break
    assert "READY" in seen, seen
    # Eviction is seen by a watch on the id.
    with client.watch(context_id=cid, timeout=60, max_events=5) as w:
        client.evict(cid)
        ev = next(w)
        assert ev.type == pb.ContextEvent.EVICTED and ev.context.context_id == cid


def test_watch_ends_quietly_at_its_deadline(client: ctxcache.Client) -> None:
    t0 = time.monotonic()
    events = list(client.watch(label_filter={"nobody": "builds-this"}, timeout=0.5))
    elapsed = time.monotonic() - t0
    assert events == []
    assert 0.4 <= elapsed < 10


def test_watch_from_another_thread_while_building(client: ctxcache.Client) -> None:
    got: List[pb.ContextEvent] = []
    w = client.watch(label_filter={"thread": "yes"}, timeout=60, max_events=2)

    def consume() -> None:
        got.extend(w)  # CREATED, READY, then max_events ends it

    t = threading.Thread(target=consume)
    t.start()
    client.build(tokens=random_tokens(60, 6), labels={"thread": "yes"})
    t.join(60)
    assert not t.is_alive()
    assert [pb.ContextEvent.Type.Name(e.type) for e in got] == ["CREATED", "READY"]
