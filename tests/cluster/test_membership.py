"""Membership changes (ctest cluster): a node joining moves each context to
its new owners (and the surplus copies go); etcd stopped and restarted does
not break reads on serving nodes, and the nodes register again; a node
leaving is seen by the other nodes and by routing clients within a second
(etcd watch, not a poll)."""
from __future__ import annotations

import base64
import json
import time
import urllib.request
from typing import List

import ctxcache
from ctxcache.cluster import owners_of
from cluster_harness import Cluster, Etcd, wait_for

R = 2


def holders(cluster: Cluster, context_id: str) -> List[str]:
    return sorted(ctxcache.ClusterClient(cluster.uri)._membership.holders(context_id))


def test_join_rebalances_to_new_owners(bin_dir: str, model_dir: str) -> None:
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", str(R), "--etcd-lease-ttl-s", "2"])
    try:
        rc = ctxcache.connect(c.uri)
        ids = [rc.build(tokens=[(i * 13 + j) % 500 + 1 for i in range(64)]).context.context_id
               for j in range(12)]
        c.add_node()
        rc = ctxcache.ClusterClient(c.uri)
        wait_for(lambda: len(rc.nodes(refresh=True)) == 4, 10, "4 nodes")

        def placed() -> bool:
            nodes = rc.nodes(refresh=True)
            return all(holders(c, x) == sorted(o.node_id for o in owners_of(x, nodes, R))
                       for x in ids)
        wait_for(placed, 60, "every context on exactly its owners", interval=0.5)
        moved = [x for x in ids if "n3" in holders(c, x)]
        assert moved, "the new node owns none of 12 contexts"
        for x in moved:
            assert ctxcache.Client(c.nodes[3].address).get(x).n_tokens == 64
        assert c.nodes[3].metrics()["ctxcache_replication_bytes_total"] > 0
    finally:
        c.close()


def test_etcd_restart_keeps_reads_and_nodes_reregister(bin_dir: str, model_dir: str) -> None:
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", str(R), "--etcd-lease-ttl-s", "2"])
    try:
        rc = ctxcache.connect(c.uri)
        ctx = rc.build(tokens=list(range(1, 120))).context.context_id
        wait_for(lambda: len(holders(c, ctx)) == R, 10, "R holders")
        c.etcd.stop()
        # Every node keeps serving from its last view, forwarding included.
        for _ in range(3):
            for n in c.nodes:
                assert ctxcache.Client(n.address).get(ctx).n_tokens == 119
        # Same data dir and ports: the leases expired meanwhile, so the nodes
        # register again, with every context they store.
        restarted = Etcd(c.tmp)
        restarted.client_port, restarted.peer_port = c.etcd.client_port, c.etcd.peer_port
        c.etcd = restarted.start()
        wait_for(lambda: len(ctxcache.ClusterClient(c.uri).nodes(refresh=True)) == 3, 30,
                 "3 nodes registered again", interval=0.5)
        wait_for(lambda: len(holders(c, ctx)) == R, 30, "holders registered again")
        for n in c.nodes:
            assert ctxcache.Client(n.address).get(ctx).n_tokens == 119
    finally:
        c.close()


def _etcd(c: Cluster, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{c.etcd.endpoint}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def test_leave_is_seen_at_watch_latency(bin_dir: str, model_dir: str) -> None:
    # Default lease TTL (10 s): a poll would see the leave after up to its
    # period, a watch within milliseconds. The node's lease is revoked in
    # etcd (what a clean shutdown does, without the shutdown's own time).
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", str(R)])
    try:
        rc = ctxcache.ClusterClient(c.uri)
        wait_for(lambda: len(rc.nodes()) == 3, 10, "3 nodes seen by the client")
        wait_for(lambda: c.nodes[0].metrics()["ctxcache_cluster_nodes"] == 3, 10, "3 nodes on n0")
        key = base64.b64encode(f"/{c.name}/nodes/n2".encode()).decode()
        lease = _etcd(c, "/v3/kv/range", {"key": key})["kvs"][0]["lease"]
        t0 = time.monotonic()
        _etcd(c, "/v3/lease/revoke", {"ID": lease})
        wait_for(lambda: c.nodes[0].metrics()["ctxcache_cluster_nodes"] == 2, 1.0,
                 "n0 to see n2 leave", interval=0.005)
        node_s = time.monotonic() - t0
        wait_for(lambda: "n2" not in [n.node_id for n in rc.nodes()], 1.0,
                 "the Python routing client to see n2 leave", interval=0.005)
        client_s = time.monotonic() - t0
        assert node_s < 1.0 and client_s < 1.0, (node_s, client_s)
        print(f"n2's lease revoked: n0 saw it leave after {1e3 * node_s:.0f} ms, "
              f"the Python routing client after {1e3 * client_s:.0f} ms")
        # n2's keep-alive finds its lease gone and it registers again.
        wait_for(lambda: "n2" in [n.node_id for n in rc.nodes()], 15, "n2 back", interval=0.1)
        wait_for(lambda: c.nodes[0].metrics()["ctxcache_cluster_nodes"] == 3, 5, "3 nodes on n0")
    finally:
        c.close()
