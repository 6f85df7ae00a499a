"""A ctxcached cluster on loopback: a real etcd (Debian's etcd-server) and 3
real ctxcached processes, each with its own data dir (cluster_harness.py).

Default suite (ctest `cluster`): a context built through one node is readable,
byte for byte, through every node (forwarding) and through an etcd:// routing
client; pins and evictions are cluster-wide; SIGKILL of the node serving a
decode session: the session continues on a replica with identical
selections; the lost node's contexts get R live copies again; the node
restarted with its data rejoins without a copy.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Dict, List, Tuple

import numpy as np
import pytest

import ctxcache
from ctxcache import tensors
from ctxcache.cluster import owners_of
from cluster_harness import Cluster, wait_for

R = 2
LEASE_TTL_S = 2


@pytest.fixture(scope="module")
def cluster(bin_dir: str, model_dir: str):
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", str(R), "--etcd-lease-ttl-s",
                                              str(LEASE_TTL_S)])
    try:
        yield c
    finally:
        c.close()


def holders(cluster: Cluster, context_id: str) -> List[str]:
    rc = ctxcache.ClusterClient(cluster.uri)
    return sorted(rc._membership.holders(context_id))


def settle(cluster: Cluster, context_id: str) -> List[str]:
    """Waits until exactly the context's owners hold it (copies made, the
    builder's surplus copy dropped); returns them."""
    rc = ctxcache.ClusterClient(cluster.uri)

    def settled():
        owners = sorted(o.node_id for o in owners_of(context_id, rc.nodes(refresh=True), R))
        return owners if holders(cluster, context_id) == owners else None
    return wait_for(settled, 20, "holders == owners")


def live_holders(cluster: Cluster, context_id: str) -> List[str]:
    live = {n.name for n in cluster.live()}
    return [h for h in holders(cluster, context_id) if h in live]


def pages_of(client, context_id: str) -> Dict[Tuple[int, int, int], bytes]:
    tables = [(layer, head, list(range(8))) for layer in range(2) for head in range(2)]
    out = {}
    for p in client.fetch_pages(context_id, tables, dtype="raw"):
        out[(p.layer, p.kv_head, p.block)] = bytes(p.k) + bytes(p.v)
    return out


def test_built_through_one_node_readable_through_every_node(cluster: Cluster) -> None:
    c0 = ctxcache.Client(cluster.nodes[0].address)
    ctx = c0.build(tokens=[(i * 7919) % 500 + 1 for i in range(300)],
                   name="anywhere").context.context_id
    # READY means R durable copies; the builder's surplus copy (if it is no
    # owner) goes once both owners hold theirs.
    settle(cluster, ctx)
    reference = pages_of(c0, ctx) if cluster.nodes[0].name in holders(cluster, ctx) else None
    seen = []
    for n in cluster.nodes:
        c = ctxcache.Client(n.address)
        got = c.get(ctx)
        assert got.context_id == ctx and got.n_tokens == 300 and got.name == "anywhere"
        pages = pages_of(c, ctx)
        assert len(pages) == 2 * 2 * 8
        seen.append(pages)
    for p in seen[1:]:
        assert p == seen[0]
    if reference is not None:
        assert reference == seen[0]
    # The node without a copy answered by forwarding.
    non_holders = [n for n in cluster.nodes if n.name not in holders(cluster, ctx)]
    assert len(non_holders) == 1
    m = non_holders[0].metrics()
    assert m.get('ctxcache_forwarded_requests_total{method="GetContext"}', 0) >= 1
    assert m.get('ctxcache_forwarded_requests_total{method="FetchPages"}', 0) >= 1
    # The routing client reaches an owner directly and reads the same bytes.
    rc = ctxcache.connect(cluster.uri)
    assert isinstance(rc, ctxcache.ClusterClient)
    owners = owners_of(ctx, rc.nodes(), R)
    assert sorted(o.node_id for o in owners) == holders(cluster, ctx)
    assert rc.candidates(ctx)[0].node_id == owners[0].node_id
    assert pages_of(rc, ctx) == seen[0]
    for n in cluster.nodes:
        # Each node's view refreshes every second.
        wait_for(lambda: n.metrics()["ctxcache_cluster_nodes"] == 3, 5, "3 nodes seen")
        wait_for(lambda: n.metrics()["ctxcache_replication_lag_contexts"] == 0, 5, "no lag")


def test_an_ingested_child_through_a_node_without_its_parent_is_forwarded(
        cluster: Cluster) -> None:
    """IngestContext with parent_id goes, whole stream and all, to a node
    that holds the parent; the child shares its pages there."""
    rc = ctxcache.connect(cluster.uri)
    parent = rc.build(tokens=[(i * 31) % 500 + 1 for i in range(100)], name="turns").context
    settle(cluster, parent.context_id)
    other = [n for n in cluster.nodes if n.name not in holders(cluster, parent.context_id)][0]
    m = parent.model
    rng = np.random.default_rng(3)
    kv = [(rng.standard_normal((m.n_kv_heads, 20, m.head_dim)).astype(np.float32),
           rng.standard_normal((m.n_kv_heads, 20, m.head_dim)).astype(np.float32))
          for _ in range(m.n_layers)]
    before = other.metrics().get('ctxcache_forwarded_requests_total{method="IngestContext"}', 0)
    with ctxcache.Client(other.address) as c:
        child = c.ingest(m, list(range(7, 27)), kv, indexes=["streaming"],
                         parent_id=parent.context_id, parent_tokens=100)
    assert child.parent_id == parent.context_id and child.n_tokens == 120
    after = other.metrics()['ctxcache_forwarded_requests_total{method="IngestContext"}']
    assert after == before + 1
    got = rc.fetch_pages(child.context_id, [(1, 0, [6, 7])])
    want = tensors.bf16_to_float32(tensors.float32_to_bf16(kv[1][0][0]))
    assert np.array_equal(np.concatenate([p.k for p in got])[4:], want)


def test_pin_and_evict_are_cluster_wide(cluster: Cluster) -> None:
    rc = ctxcache.connect(cluster.uri)
    ctx = rc.build(tokens=list(range(5, 105)), name="lifecycle").context.context_id
    settle(cluster, ctx)
    # Pin through a node that does not hold it: forwarded, recorded in etcd,
    # applied by every holder.
    non_holder = next(n for n in cluster.nodes if n.name not in holders(cluster, ctx))
    ctxcache.Client(non_holder.address).pin(ctx)
    by_name = {n.name: n for n in cluster.nodes}

    def pinned_everywhere() -> bool:
        return all(ctxcache.Client(by_name[h].address).get(ctx).pinned
                   for h in holders(cluster, ctx))
    wait_for(pinned_everywhere, 10, "pin on every holder")
    with pytest.raises(ctxcache.FailedPrecondition):
        rc.evict(ctx)
    rc.unpin(ctx)
    wait_for(lambda: not any(ctxcache.Client(by_name[h].address).get(ctx).pinned
                             for h in holders(cluster, ctx)), 10, "unpin on every holder")
    rc.evict(ctx)

    def gone_everywhere() -> bool:
        for n in cluster.nodes:
            try:
                ctxcache.Client(n.address, max_attempts=1).get(ctx)
                return False
            except ctxcache.NotFound:
                pass
        return True
    wait_for(gone_everywhere, 10, "eviction on every node")
    wait_for(lambda: holders(cluster, ctx) == [], 10, "no holder left")


def _decode(session, steps: int, seed: int, on_step=None) -> List[List[List[int]]]:
    """`steps` tokens: per token a step on both layers (recording the
    selected ids per q head) and an append. Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        if on_step:
            on_step(t)
        per_token = []
        for layer in range(2):
            r = session.step(layer, rng.standard_normal((4, 32)).astype(np.float32))
            per_token.append([list(map(int, s)) for s in r.selections])
        k = rng.standard_normal((2, 2, 32)).astype(np.float32)
        v = rng.standard_normal((2, 2, 32)).astype(np.float32)
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        session.append(k, v, q, token_id=1000 + t)
        out.append(per_token)
    return out


def test_decode_session_through_a_node_without_the_context(cluster: Cluster) -> None:
    rc = ctxcache.connect(cluster.uri)
    ctx = rc.build(tokens=[(i * 17) % 450 + 2 for i in range(200)]).context.context_id
    owners = settle(cluster, ctx)
    holder = next(n for n in cluster.nodes if n.name in owners)
    other = next(n for n in cluster.nodes if n.name not in owners)
    with ctxcache.Client(holder.address).open_session(ctx, "csa", {"rho": 0.1}) as s:
        direct = _decode(s, 6, seed=3)
    before = other.metrics().get('ctxcache_forwarded_requests_total{method="Decode"}', 0)
    with ctxcache.Client(other.address).open_session(ctx, "csa", {"rho": 0.1}) as s:
        proxied = _decode(s, 6, seed=3)
    assert proxied == direct
    assert other.metrics()['ctxcache_forwarded_requests_total{method="Decode"}'] == before + 1


def test_sigkill_owner_mid_session_continues_on_replica_then_rereplicates(
        cluster: Cluster) -> None:
    rc = ctxcache.connect(cluster.uri)
    ctx = rc.build(tokens=[(i * 31) % 400 + 3 for i in range(250)],
                   name="failover").context.context_id
    settle(cluster, ctx)
    params = {"rho": 0.1}
    with ctxcache.Client(cluster.nodes[0].address).open_session(ctx, "csa", params) as s:
        reference = _decode(s, 12, seed=7)

    session = rc.open_session(ctx, "csa", params)
    victim = next(n for n in cluster.nodes if n.address == session.address)

    def kill_at(t: int) -> None:
        if t == 5:
            victim.kill()
    got = _decode(session, 12, seed=7, on_step=kill_at)
    session.close()
    assert session.failovers >= 1
    assert session.address != victim.address
    assert got == reference

    # The victim's lease expires; the rebalancer copies every context it
    # held to a new owner, so each has R live copies again.
    wait_for(lambda: len(ctxcache.ClusterClient(cluster.uri).nodes(refresh=True)) == 2,
             LEASE_TTL_S * 5, "the killed node leaving")
    wait_for(lambda: len(live_holders(cluster, ctx)) == R, 30, "re-replication")
    survivors = cluster.live()
    wait_for(lambda: all(n.metrics()["ctxcache_replication_lag_contexts"] == 0
                         for n in survivors), 15, "no replication lag")
    for n in survivors:
        assert len(pages_of(ctxcache.Client(n.address), ctx)) == 2 * 2 * 8

    # Restarted with its data, the node rejoins: its contexts count as
    # copies at once, without being copied again.
    victim.start()
    wait_for(lambda: victim.name in holders(cluster, ctx), 15, "rejoined holder")
    assert victim.metrics()["ctxcache_replication_bytes_total"] == 0


def test_cli_cluster_status(cluster: Cluster, bin_dir: str) -> None:
    for n in cluster.live():  # views refresh every second
        wait_for(lambda: n.metrics()["ctxcache_cluster_nodes"] == len(cluster.live()), 10, "view")
    # Through etcd (any live node answers) and through one node directly.
    for server in (cluster.uri, cluster.live()[0].address):
        r = subprocess.run([os.path.join(bin_dir, "ctxcache"), "cluster", "status", "--json",
                            "--server", server], capture_output=True, text=True, timeout=30)
        assert r.returncode in (0, 1), r.stderr
        st = json.loads(r.stdout)
        assert st["cluster"] == cluster.name and st["replicas"] == R
        assert sorted(n["node_id"] for n in st["nodes"]) == sorted(n.name for n in cluster.live())
        assert all(n["health"] == "SERVING" for n in st["nodes"])
        assert st["rebalancer"] in {n.name for n in cluster.live()}
        assert sum(n["stored_contexts"] for n in st["nodes"]) >= R
    table = subprocess.run([os.path.join(bin_dir, "ctxcache"), "cluster", "status", "--server",
                            cluster.uri], capture_output=True, text=True, timeout=30)
    assert "NODE" in table.stdout and "LAG" in table.stdout
