"""Random SIGKILLs during builds and copies (ctest cluster_long): after every
round the killed node restarts with its data; at the end every node's data
dir passes `ctxcache fsck` (no partial context anywhere: a copy, like a
build, becomes visible only by its atomic READY commit), every context a
build reported READY is readable through every node, and each has R live
copies again."""
from __future__ import annotations

import os
import random
import subprocess
import threading
import time

import pytest

import ctxcache
from ctxcache.cluster import owners_of
from cluster_harness import Cluster, wait_for

pytestmark = pytest.mark.long
R = 2


def test_random_kills_leave_no_partial_context(bin_dir: str, model_dir: str) -> None:
    rounds = int(os.environ.get("CTXCACHE_CLUSTER_KILL_ROUNDS", "8"))
    rng = random.Random(int(os.environ.get("CTXCACHE_CLUSTER_KILL_SEED", "18")))
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", str(R), "--etcd-lease-ttl-s", "2"])
    ready: list = []
    stop = threading.Event()

    def builder() -> None:
        rc = ctxcache.ClusterClient(c.uri, timeout=30)
        j = 0
        while not stop.is_set():
            j += 1
            n = rng.choice((64, 300, 900))
            try:
                info = rc.build(tokens=[(i * 7 + j * 13) % 500 + 1 for i in range(n)])
                ready.append(info.context.context_id)
            except ctxcache.Error:
                pass  # a node died mid-build or mid-copy: allowed, never partial

    t = threading.Thread(target=builder, daemon=True)
    t.start()
    try:
        for _ in range(rounds):
            time.sleep(rng.uniform(0.3, 1.5))
            victim = rng.choice(c.nodes)
            victim.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            victim.start()
        stop.set()
        t.join(120)
        assert ready, "no build completed"
        rc = ctxcache.ClusterClient(c.uri)

        def replicated() -> bool:
            nodes = rc.nodes(refresh=True)
            return len(nodes) == 3 and all(
                len(set(rc._membership.holders(x)) & {o.node_id for o in owners_of(
                    x, nodes, R)}) == R for x in ready)
        wait_for(replicated, 90, "R live copies of every READY context", interval=1.0)
        for x in ready:
            for n in c.nodes:
                assert ctxcache.Client(n.address).get(x).context_id == x
        for n in c.nodes:
            n.stop()
        cli = os.path.join(bin_dir, "ctxcache")
        for n in c.nodes:
            r = subprocess.run([cli, "fsck", "--json", "--data-dir",
                                os.path.join(n.workdir, "data")],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{n.name}: {r.stdout[-2000:]} {r.stderr[-2000:]}"
    finally:
        stop.set()
        c.close()
