#!/usr/bin/env python3
"""Cluster read throughput on loopback: pages/s with 1, 2, 3 nodes under a
fixed client load, printed as JSON with the ratio to 1 node.

Workload (per node count N, a fresh cluster: a real etcd and N ctxcached,
tests/cluster/cluster_harness.py; R = min(2, N)):
  * build --contexts contexts of --tokens tokens (golden llama3: 2 layers,
    2 kv heads, head_dim 32, 16-token pages) through the routing client;
  * wait until every context is on exactly its owners;
  * --clients load processes, each routing FetchPages calls through an
    etcd:// ClusterClient (to a holder of the context, owners first) for
    --seconds: each call reads --pages random pages of one random
    (context, layer, kv head);
  * report pages/s (all clients), calls/s, p50/p99 call latency.
The client load is fixed (same processes, same requests); only the number of
nodes changes. On a small machine the clients and the nodes share the cores:
read the ratio together with `cores` in the output.

usage: bench/cluster/cluster_throughput.py [--nodes 1,2,3] [--clients 4]
       [--seconds 8] [--contexts 12] [--tokens 1024] [--pages 16]
       [--bin-dir build/bin] [--model-dir tests/data/golden]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))

import ctxcache  # noqa: E402
from ctxcache.cluster import owners_of  # noqa: E402
from cluster_harness import Cluster, wait_for  # noqa: E402


def load(uri: str, ids, n_blocks: int, pages: int, seconds: float, seed: int, out) -> None:
    rc = ctxcache.ClusterClient(uri)
    rng = random.Random(seed)
    # Resolve each context's first candidate once (the routing a worker does
    # per session), so the measured loop is FetchPages only.
    route = {x: rc.client_for(rc.candidates(x)[0].address) for x in ids}
    n_pages, lat = 0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x = rng.choice(ids)
        blocks = sorted(rng.sample(range(n_blocks), pages))
        t = time.perf_counter()
        got = route[x].fetch_pages(x, [(rng.randrange(2), rng.randrange(2), blocks)], dtype="raw")
        lat.append(time.perf_counter() - t)
        n_pages += len(got)
    out.put((n_pages, lat))


def run(n_nodes: int, args) -> dict:
    r = min(2, n_nodes)
    c = Cluster(n_nodes, args.bin_dir, args.model_dir, name=f"bench{n_nodes}",
                extra=["--replicas", str(r), "--log-level", "warn"])
    try:
        rc = ctxcache.ClusterClient(c.uri, replicas=r)
        wait_for(lambda: len(rc.nodes(refresh=True)) == n_nodes, 10, "membership")
        ids = [rc.build(tokens=[(i * 37 + j * 101) % 500 + 1 for i in range(args.tokens)])
               .context.context_id for j in range(args.contexts)]

        def placed() -> bool:
            nodes = rc.nodes(refresh=True)
            return all(sorted(rc._membership.holders(x)) ==
                       sorted(o.node_id for o in owners_of(x, nodes, r)) for x in ids)
        wait_for(placed, 60, "placement", interval=0.5)
        n_blocks = (args.tokens + 15) // 16
        ctx = mp.get_context("spawn")  # gRPC channels do not survive fork
        q = ctx.Queue()
        procs = [ctx.Process(target=load, args=(c.uri, ids, n_blocks, args.pages, args.seconds,
                                               i, q)) for i in range(args.clients)]
        for p in procs:
            p.start()
        results = [q.get(timeout=args.seconds + 60) for _ in procs]
        for p in procs:
            p.join()
        pages = sum(n for n, _ in results)
        lat = sorted(x for _, l in results for x in l)
        primaries = {}
        for x in ids:
            o = owners_of(x, rc.nodes(), r)[0].node_id
            primaries[o] = primaries.get(o, 0) + 1
        return {"nodes": n_nodes, "replicas": r, "pages": pages,
                "pages_per_s": pages / args.seconds, "calls_per_s": len(lat) / args.seconds,
                "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)],
                "contexts_per_primary": primaries}
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--contexts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--model-dir", default=os.path.join(REPO, "tests", "data", "golden"))
    args = ap.parse_args()
    runs = [run(int(n), args) for n in args.nodes.split(",")]
    base = runs[0]["pages_per_s"] or 1.0
    for x in runs:
        x["ratio_vs_first"] = x["pages_per_s"] / base
    print(json.dumps({"bench": "cluster_throughput", "cores": os.cpu_count(),
                      "clients": args.clients, "seconds": args.seconds,
                      "contexts": args.contexts, "tokens": args.tokens,
                      "pages_per_call": args.pages, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
