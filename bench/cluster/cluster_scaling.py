#!/usr/bin/env python3
"""Cluster read scaling on one host: pages/s with 1, 2, 3 nodes under a fixed
C++ client load (ctxcache-cluster-load), printed as JSON with the ratio to
the first node count.

Per node count N, a fresh cluster (tests/cluster/cluster_harness.py): a real
etcd and N ctxcached (R = min(2, N)), then ctxcache-cluster-load builds
--contexts contexts through the C++ routing client, waits until each is on
exactly its owners, and runs --concurrency FetchPages calls in flight for
--seconds (--pages random pages of a random (context, layer, kv head) each).

"Scaling on loopback" here means: node i runs pinned (taskset) to its own
--cores-per-node cores, the same cores whatever N is, and the load
generator (and etcd) to the remaining cores, also the same for every N. So
the client side is identical across runs and each added node adds its own
cores: the ratio measures per-node serving capacity, not network or disk
(the pages are in the nodes' block caches after the first reads). When the
host has fewer than 3 * cores-per-node + 2 cores, nothing is pinned
("pinned": false) and the ratio says nothing about scaling.

usage: bench/cluster/cluster_scaling.py [--nodes 1,2,3] [--cores-per-node 2]
       [--concurrency 64] [--seconds 8] [--contexts 12] [--tokens 4096]
       [--pages 64] [--bin-dir build/bin] [--model-dir tests/data/golden]
       [--out FILE]
The binaries (ctxcached, ctxcache-cluster-load) come from --bin-dir; etcd
from $CTXCACHE_ETCD_BIN or /usr/bin/etcd.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))

from cluster_harness import Etcd, Node  # noqa: E402


def cpu_list(cpus) -> str:
    return ",".join(str(c) for c in cpus)


def plan(max_nodes: int, cores_per_node: int):
    """(per-node cpu lists, client cpu list) or None when the host is too small."""
    avail = sorted(os.sched_getaffinity(0))
    need = max_nodes * cores_per_node + 2
    if len(avail) < need or not shutil.which("taskset"):
        return None
    nodes = [avail[i * cores_per_node:(i + 1) * cores_per_node] for i in range(max_nodes)]
    return nodes, avail[max_nodes * cores_per_node:]


def pinned(cmd, cpus):
    return ["taskset", "-c", cpu_list(cpus), *cmd] if cpus else list(cmd)


def run(n_nodes: int, args, cpus) -> dict:
    r = min(2, n_nodes)
    tmp = tempfile.mkdtemp(prefix="ctxcache-scaling-")
    etcd = Etcd(tmp)
    if cpus:
        etcd.prefix = ["taskset", "-c", cpu_list(cpus[1])]
    nodes = []
    try:
        etcd.start()
        name = f"scale{n_nodes}"
        uri = f"etcd://{etcd.endpoint}/{name}"
        for i in range(n_nodes):
            node = Node(f"n{i}", os.path.join(tmp, f"n{i}"), uri, args.bin_dir, args.model_dir,
                        ["--replicas", str(r), "--log-level", "warn"])
            node.args = pinned(node.args, cpus[0][i] if cpus else None)
            nodes.append(node)
            node.start()
        before = {n.name: n.metrics() for n in nodes}
        cmd = [os.path.join(args.bin_dir, "ctxcache-cluster-load"), "--server", uri,
               "--replicas", str(r), "--contexts", str(args.contexts),
               "--tokens", str(args.tokens), "--pages", str(args.pages),
               "--concurrency", str(args.concurrency), "--seconds", str(args.seconds),
               "--warmup-s", str(args.warmup_s)]
        p = subprocess.run(pinned(cmd, cpus[1] if cpus else None), capture_output=True,
                           text=True, timeout=args.seconds + args.warmup_s + 600)
        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if not lines:
            raise RuntimeError(f"ctxcache-cluster-load rc={p.returncode}: {p.stderr[-2000:]}")
        res = json.loads(lines[-1])
        res["rc"] = p.returncode
        res["nodes_count"] = n_nodes
        key = "ctxcache_page_bytes_read_total"
        for n in nodes:
            after = n.metrics()
            res["nodes"].setdefault(n.name, {})["page_bytes_read"] = (
                after.get(key, 0.0) - before[n.name].get(key, 0.0))
            if cpus:
                res["nodes"][n.name]["cpus"] = cpu_list(cpus[0][int(n.name[1:])])
        return res
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--cores-per-node", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--contexts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--model-dir", default=os.path.join(REPO, "tests", "data", "golden"))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    cpus = plan(max(counts), args.cores_per_node)
    runs = []
    for n in counts:
        t = time.monotonic()
        runs.append(run(n, args, cpus))
        runs[-1]["wall_s"] = time.monotonic() - t
    base = runs[0]["pages_per_s"] or 1.0
    for x in runs:
        x["ratio_vs_first"] = x["pages_per_s"] / base
    out = {"bench": "cluster_scaling", "host_cpus": len(os.sched_getaffinity(0)),
           "pinned": cpus is not None,
           "node_cpus": [cpu_list(c) for c in cpus[0]] if cpus else None,
           "client_cpus": cpu_list(cpus[1]) if cpus else None,
           "cores_per_node": args.cores_per_node, "concurrency": args.concurrency,
           "seconds": args.seconds, "contexts": args.contexts, "tokens": args.tokens,
           "pages_per_call": args.pages,
           "ratios": [round(x["ratio_vs_first"], 3) for x in runs], "runs": runs}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if all(x["rc"] == 0 for x in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
