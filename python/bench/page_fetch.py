"""How fast a decode step's scattered pages reach a worker's host memory
through the native library, against a bulk load of the whole context, on
one ctxcached over loopback. Prints JSON.

The context: --layers x --kv-heads x --tokens random bf16 K/V (head_dim
128), ingested with the ``quest`` index. Measured, each --reps times
(the best kept):
- ``bulk``: ``NativeClient.load_kv`` of every layer (FetchKV frames);
- ``framed``: ``NativeClient.fetch_pages_into`` of --fraction of each
  (layer, kv head)'s pages, one table per call, --streams calls at a time
  (FetchKV with page tables: many pages per frame);
- ``per_page``: the same pages through ``ctxcache_fetch_pages`` (FetchPages:
  one ``Page`` message per page), the same concurrency;
- ``step_cold`` / ``step_warm``: a decode step's first pass as the engine's
  on-demand tier makes it, layer by layer (each layer's --kv-heads tables
  in concurrent calls, waited for before the next layer), on pages not read
  before, then on the same pages again: milliseconds per layer;
  ``step_cold_split2``: the same on other pages, each table in two calls.

Usage: python3 python/bench/page_fetch.py --bin-dir build/bin [--tokens 32768]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_server import start_ctxcached, stop_ctxcached  # noqa: E402
from ctxcache import native  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--model-dir", default="tests/data/golden")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="page-fetch-")
    proc = None
    try:
        proc, addr = start_ctxcached(a.bin_dir, work, [
            "--model-dir", a.model_dir, "--default-model", "llama3",
            "--max-context-tokens", str(max(65536, a.tokens))])
        L, H, D, T = a.layers, a.kv_heads, 128, a.tokens
        g = torch.Generator().manual_seed(0)
        layers = [(torch.randn(H, T, D, generator=g).bfloat16(),
                   torch.randn(H, T, D, generator=g).bfloat16()) for _ in range(L)]
        spec = {"name": "page-fetch", "n_layers": L, "n_q_heads": 4 * H, "n_kv_heads": H,
                "head_dim": D, "rope": {"theta": 10000.0}, "kv_dtype": "bf16",
                "fingerprint": b"ctxcache-bench-page-fetch-000001"}
        nc = native.NativeClient(addr, timeout=600)
        cid = nc.ingest(spec, list(range(3, 3 + T)), layers, indexes=["quest"],
                        name="page-fetch").context_id
        shape = nc.context(cid)
        k = torch.zeros(shape.kv_shape(), dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        n_pages = (T + 15) // 16
        rng = np.random.default_rng(1)
        tables = [(layer, h, np.sort(rng.choice(n_pages, max(1, int(a.fraction * n_pages)),
                                                replace=False)).astype(np.uint32))
                  for layer in range(L) for h in range(H)]
        picked = sum(len(b) for _, _, b in tables)
        page_bytes = 2 * 16 * D * 2
        res = {"bench": "page_fetch", "layers": L, "kv_heads": H, "tokens": T,
               "fraction": a.fraction, "pages": picked, "cpus": os.cpu_count()}

        def best(fn) -> float:
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        s = best(lambda: nc.load_kv(cid, k, v, streams=4))
        res["bulk_gb_per_s"] = 2 * k.numel() * 2 / s / 1e9
        buf = np.zeros(max(len(b) for _, _, b in tables) * page_bytes, np.uint8)
        lib = native.load_library()

        def per_page(group) -> None:
            out = np.zeros_like(buf)
            for layer, h, b in group:
                err = ctypes.c_void_p()
                arr = b.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
                rc = lib.ctxcache_fetch_pages(nc._live(), cid.encode(), layer, h, arr, len(b),
                                              out.ctypes.data, out.nbytes, ctypes.byref(err))
                if rc:
                    raise RuntimeError(f"ctxcache_fetch_pages: code {rc}")

        # A decode step's first pass, as the engine's on-demand tier makes it:
        # layer after layer, each (layer, kv head)'s table in its own call, all
        # of a layer's calls at once and waited for before the next layer
        # (the step plans layer l + 1 from layer l's output). Pages not read
        # before (cold: the bulk load leaves the block cache alone), then the
        # same pages again (warm); into pinned buffers where CUDA is there.
        pin = torch.cuda.is_available()
        pk = torch.zeros(shape.kv_shape(), dtype=torch.bfloat16, pin_memory=pin)
        pv = torch.zeros_like(pk, pin_memory=pin)

        def step_pages(seed: int) -> list:
            r = np.random.default_rng(seed)
            return [[(layer, h, np.sort(r.choice(n_pages, max(1, int(a.fraction * n_pages)),
                                                 replace=False)).astype(np.uint32))
                     for h in range(H)] for layer in range(L)]

        step_pool = ThreadPoolExecutor(2 * H)
        fresh = step_pages(2)
        # cold_split2: other pages not read before, each table in two calls.
        for kind, pages, split in (("cold", fresh, 1), ("warm", fresh, 1),
                                   ("cold_split2", step_pages(3), 2)):
            per_layer = []
            for group in pages:
                calls = [(layer, h, part) for layer, h, b in group
                         for part in np.array_split(b, split)]
                t = time.perf_counter()
                list(step_pool.map(lambda tb: nc.fetch_pages_into(cid, [tb], pk, pv, shape),
                                   calls))
                per_layer.append(time.perf_counter() - t)
            step_bytes = sum(len(b) for _, _, b in pages[0]) * page_bytes
            res[f"step_{kind}_ms_per_layer"] = 1e3 * sum(per_layer) / L
            res[f"step_{kind}_gb_per_s"] = step_bytes * L / sum(per_layer) / 1e9
        step_pool.shutdown()
        for streams in [int(x) for x in a.streams.split(",") if x]:
            pool = ThreadPoolExecutor(streams)
            framed = best(lambda: list(pool.map(
                lambda t: nc.fetch_pages_into(cid, [t], k, v, shape), tables)))
            groups = [tables[i::streams] for i in range(streams)]
            paged = best(lambda: list(pool.map(per_page, groups)))
            res[f"framed_gb_per_s_{streams}"] = picked * page_bytes / framed / 1e9
            res[f"per_page_gb_per_s_{streams}"] = picked * page_bytes / paged / 1e9
            pool.shutdown()
        nc.close()
    finally:
        stop_ctxcached(proc)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
