"""Retries, deadlines and corruption against real ctxcached processes."""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import ctxcache
from conftest import free_port, random_tokens


def test_unreachable_server_is_unavailable_after_the_retries() -> None:
    port = free_port()  # nothing listens there
    with ctxcache.Client(f"127.0.0.1:{port}", timeout=5, max_attempts=3,
                         initial_backoff=0.1) as c:
        t0 = time.monotonic()
        with pytest.raises(ctxcache.Unavailable, match="cannot reach ctxcached") as info:
            c.stats()
        elapsed = time.monotonic() - t0
    assert info.value.rpc == "GetStats"
    assert 0.15 <= elapsed < 10  # slept 0.05-0.1 + 0.1-0.2 s between the 3 attempts


def test_calls_are_retried_until_the_server_is_up(make_server) -> None:
    port = free_port()
    srv = make_server(listen=f"127.0.0.1:{port}", start=False)
    starter = threading.Timer(0.4, srv.start)
    starter.start()
    try:
        with ctxcache.Client(f"127.0.0.1:{port}", timeout=10,
                             max_attempts=8, initial_backoff=0.1) as c:
            t0 = time.monotonic()
            stats = c.stats()  # fails with UNAVAILABLE until the server listens
            assert time.monotonic() - t0 >= 0.3
            assert "llama3" in stats.models
    finally:
        starter.join(30)


def test_a_stopped_server_hits_the_deadline(make_server) -> None:
    srv = make_server()
    with ctxcache.Client(srv.address, timeout=30) as c, \
            ctxcache.Client(srv.address, timeout=0.5) as short:
        ctx = c.build(tokens=random_tokens(64, 30)).context
        assert short.get(ctx.context_id).n_tokens == 64  # connected, and fast enough
        session = c.open_session(ctx.context_id, "csa")
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(ctxcache.DeadlineExceeded) as info:
                short.get(ctx.context_id)
            assert info.value.rpc == "GetContext"
            assert time.monotonic() - t0 < 5
            session.timeout = 0.5
            with pytest.raises(ctxcache.DeadlineExceeded):
                session.step(0, np.ones((4, 32), np.float32))
            assert session.closed  # a session message past its deadline ends the session
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        assert c.get(ctx.context_id).context_id == ctx.context_id


def test_corrupt_pages_are_data_loss(make_server) -> None:
    srv = make_server(["--fault-corrupt-pages-for-testing"])
    with ctxcache.Client(srv.address, timeout=30) as c:
        ctx = c.build(tokens=random_tokens(200, 31)).context
        with pytest.raises(ctxcache.DataLoss, match="crc32c"):
            c.fetch_pages(ctx.context_id, [(0, 0, [0, 1])])
        with c.open_session(ctx.context_id, "csa") as s:
            with pytest.raises(ctxcache.DataLoss, match="crc32c"):
                s.step(0, np.full((4, 32), 0.3, np.float32))
        # Index artifacts are not corrupted by this fault: their crc holds.
        assert len(c.fetch_index(ctx.context_id, "csa")) == 4
        # The GPU engine's bulk load into a host tier checks every page's
        # crc32c natively: the load fails with DataLoss.
        pytest.importorskip("torch")
        from ctxcache import native
        from ctxcache.engine import HostTier

        with native.NativeClient(srv.address, timeout=30) as nc:
            tier = HostTier.from_server(nc, ctx.context_id, streams=2, pin=False)
            with tier.load, pytest.raises(ctxcache.DataLoss, match="crc32c"):
                tier.load.wait()


def test_sigterm_stops_the_server_cleanly(make_server) -> None:
    srv = make_server()
    with ctxcache.Client(srv.address, timeout=5) as c:
        assert c.health() == "SERVING"
        assert c.health("ctxcache.v1.DecodeService") == "SERVING"
    assert srv.stop() == 0


def test_sessions_past_a_connections_stream_limit_open_on_further_connections(
        make_server) -> None:
    """The server takes 3 streams per connection: a client that assumes 3
    per connection opens 8 sessions over 3 connections of their own, all
    usable at once, while its own connection still serves streaming calls;
    a closed session's room is reused; one that assumes more gets the
    server's RESOURCE_EXHAUSTED naming the flag on its 4th session."""
    srv = make_server(["--max-streams-per-connection", "3"])
    with ctxcache.Client(srv.address, sessions_per_connection=3) as c:
        info = c.build(tokens=list(range(1, 97))).context
        q = np.ones((int(info.model.n_q_heads), int(info.model.head_dim)), np.float32)
        sessions = [c.open_session(info.context_id, "streaming") for _ in range(8)]
        assert c.sessions_per_connection_open() == [3, 3, 2]
        for s in sessions:
            assert len(s.step(0, q).heads) == int(info.model.n_kv_heads)
        assert c.fetch_index(info.context_id, "streaming")  # a stream on the client's own
        sessions[0].close()
        sessions[1].close()
        assert c.sessions_per_connection_open() == [1, 3, 2]
        sessions.append(c.open_session(info.context_id, "streaming"))
        assert c.sessions_per_connection_open() == [2, 3, 2]
        for s in sessions[2:]:
            s.close()
        assert c.sessions_per_connection_open() == [0, 0, 0]
    with ctxcache.Client(srv.address, sessions_per_connection=100, max_attempts=1) as c:
        held = [c.open_session(info.context_id, "streaming") for _ in range(3)]
        with pytest.raises(ctxcache.ResourceExhausted, match="max-streams-per-connection"):
            c.open_session(info.context_id, "streaming")
        for s in held:
            s.close()
