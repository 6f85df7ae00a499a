"""Ingest into a ctxcached on loopback, through the Python gRPC client
(``--client grpc``) or the native library (``--client native``,
NativeClient.ingest over the C ABI): a context of random bf16 K/V (the
Llama-3-8B shape's 8 kv heads x 128 dims per layer), Quest index, timed from
the first byte sent to READY. Also times the Python client's own encoding of
the same chunks. Prints one JSON object, with the server's and this client
process's CPU seconds per run (user + system: steadier than wall time on a
busy or virtualized machine).

    PYTHONPATH=python python3 python/bench/ingest_loopback.py --layers 4 --tokens 32768
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import ctxcache
from bench_server import start_ctxcached, stop_ctxcached
from ctxcache import tensors as _t


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_gib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), GiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 3)
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--indexes", default="quest")
    ap.add_argument("--wire", default="bf16", choices=("bf16", "f32"),
                    help="the chunks' dtype (bf16: as stored)")
    ap.add_argument("--bin-dir", default=os.environ.get("CTXCACHE_BIN_DIR", "build/bin"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--client", default="grpc", choices=("grpc", "native"))
    a = ap.parse_args()
    L, H, N, D = a.layers, a.kv_heads, a.tokens, a.head_dim
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(H, N, D, generator=g).to(torch.bfloat16),
               torch.randn(H, N, D, generator=g).to(torch.bfloat16)) for _ in range(L)]
    if a.wire == "f32":
        layers = [(k.float(), v.float()) for k, v in layers]
    t = time.perf_counter()
    for k, v in layers:
        for t0 in range(0, N, 2048):
            _t.encode_tensor(k[:, t0:t0 + 2048]).SerializeToString()
            _t.encode_tensor(v[:, t0:t0 + 2048]).SerializeToString()
    encode_s = time.perf_counter() - t
    gib = L * H * N * D * 2 * 2 / 2**30
    runs, server_cpu, client_cpu, peak = [], [], [], 0.0
    with tempfile.TemporaryDirectory() as data:
        srv, addr = start_ctxcached(a.bin_dir, data)
        try:
            if a.client == "native":
                from ctxcache import native
                c = native.NativeClient(addr, timeout=600)
            else:
                c = ctxcache.connect(addr)
            for rep in range(a.reps):
                spec = dict(name="bench", n_layers=L, n_q_heads=a.q_heads, n_kv_heads=H,
                            head_dim=D, kv_dtype="bf16", fingerprint=bytes([rep + 1] * 32))
                ids = [int(x) for x in torch.randint(0, 1000, (N,), generator=g)]
                cpu0, mine0 = cpu_seconds(srv.pid), cpu_seconds(os.getpid())
                t = time.perf_counter()
                info = c.ingest(spec, ids, layers, indexes=a.indexes.split(","))
                runs.append(round(time.perf_counter() - t, 3))
                server_cpu.append(round(cpu_seconds(srv.pid) - cpu0, 3))
                client_cpu.append(round(cpu_seconds(os.getpid()) - mine0, 3))
                if rep == 0:
                    peak = peak_rss_gib(srv.pid)
                assert info.n_tokens == N
            c.close()
        finally:
            stop_ctxcached(srv)
    best = min(runs)
    print(json.dumps({"bench": "ingest_loopback", "client": a.client, "layers": L, "tokens": N,
                      "kv_heads": H, "head_dim": D, "wire": a.wire, "indexes": a.indexes,
                      "kv_gib": round(gib, 3), "client_encode_s": round(encode_s, 3),
                      "ingest_s": runs, "server_cpu_s": server_cpu,
                      "client_cpu_s": client_cpu,
                      "server_peak_rss_gib_first": peak,
                      "gib_per_s_best": round(gib / best, 3),
                      "tokens_per_s_best": round(N / best, 1), "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
