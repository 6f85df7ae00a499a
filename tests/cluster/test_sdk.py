"""The C++ SDK's routing client (tests/cluster/sdk_cluster_test.cc) against a
real etcd and 3 ctxcached: routes calls, and a decode session survives
SIGKILL of its node with identical selections; its watch of etcd sees a
node's lease revocation within a second."""
from __future__ import annotations

import os
import subprocess

import pytest

from cluster_harness import Cluster


def test_cpp_sdk_routes_and_fails_over(bin_dir: str, model_dir: str) -> None:
    binary = os.path.join(bin_dir, "..", "tests", "sdk_cluster_test")
    if not os.path.exists(binary):
        pytest.fail(f"{binary} not built (cmake --build build --target sdk_cluster_test)")
    c = Cluster(3, bin_dir, model_dir, extra=["--replicas", "2", "--etcd-lease-ttl-s", "2"])
    try:
        env = dict(os.environ, CTXCACHE_CLUSTER_URI=c.uri,
                   CTXCACHE_CLUSTER_PIDS=",".join(f"{n.name}={n.proc.pid}" for n in c.nodes))
        r = subprocess.run([binary], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "selections identical" in r.stdout
        assert "left the watched view" in r.stdout
        print(r.stdout[-2000:])
        assert sum(1 for n in c.nodes if not n.alive()) == 1  # it did kill the serving node
    finally:
        c.close()
