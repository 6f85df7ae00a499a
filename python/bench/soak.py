"""Soak test of a real ctxcached on loopback (issue #19): N concurrent decode
sessions plus builds, evictions and watches for a fixed time, sampling the
server's RSS and threads, the step latency and the error count every
--interval seconds. Prints and writes JSON, and a PNG plot with
--plot (matplotlib).

    tests/python/run.sh          # makes build/python-venv with the package
    build/python-venv/bin/python python/bench/soak.py --bin-dir build/bin --minutes 10 \
        --sessions 64 --out soak.json --plot docs/img/soak.png

(or cmake -DCTXCACHE_SOAK=ON and ctest -L soak, which runs exactly that)

Goal: 0 errors, RSS and threads flat after warm-up (slope < 1% per minute).
A NotFound when opening a session on a context that was just evicted is the
correct answer, counted as ``benign``, not as an error.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

import ctxcache  # noqa: E402
from ctxcache import errors  # noqa: E402


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def plot(res: dict, path: str) -> None:
    """RSS, threads and step latency against time (needs python3-matplotlib;
    skipped with a warning without it)."""
    try:
        import matplotlib
    except ImportError:
        print("soak: python3-matplotlib is not installed; no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    samples = res["samples"]
    t = [x["t_s"] / 60 for x in samples]
    fig, ax = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    ax[0].plot(t, [x["rss_mib"] for x in samples])
    ax[0].set_ylabel("server RSS (MiB)")
    ax[1].plot(t, [x["threads"] for x in samples])
    ax[1].set_ylabel("server threads")
    ax[2].plot(t, [x["step_p50_ms"] for x in samples], label="p50")
    ax[2].plot(t, [x["step_p99_ms"] for x in samples], label="p99")
    ax[2].set_ylabel("step (ms)")
    ax[2].legend()
    ax[2].set_xlabel("minutes")
    fig.suptitle(f"ctxcached soak: {res['sessions']} sessions + builds, evictions, watches; "
                 f"{res['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--model-dir", default=os.path.join(REPO, "tests", "data", "golden"))
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--replot", default="", help="only re-plot a saved --out JSON")
    a = ap.parse_args()
    if a.replot:
        plot(json.load(open(a.replot)), a.plot)
        return 0

    work = tempfile.mkdtemp(prefix="ctxcache-soak-")
    ports = os.path.join(work, "ports")
    log = open(os.path.join(work, "ctxcached.log"), "wb")
    server = subprocess.Popen(
        [os.path.join(a.bin_dir, "ctxcached"), "--data-dir", os.path.join(work, "data"),
         "--listen", "127.0.0.1:0", "--metrics-listen", "", "--port-file", ports,
         "--model-dir", a.model_dir, "--default-model", a.model, "--default-indexes",
         "csa,quest", "--max-context-tokens", "65536", "--max-sessions", str(a.sessions + 8)],
        stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(ports) and open(ports).read().strip():
            break
        time.sleep(0.1)
    addr = "127.0.0.1:" + open(ports).read().split()[0]
    stop = threading.Event()
    lock = threading.Lock()
    stats: Dict[str, int] = {"steps": 0, "errors": 0, "benign": 0, "builds": 0, "evictions": 0,
                             "events": 0}
    latencies: List[float] = []
    error_samples: List[str] = []
    contexts: List[str] = []
    model: Dict[str, int] = {}

    def error(e: BaseException) -> None:
        with lock:
            stats["errors"] += 1
            if len(error_samples) < 20:
                error_samples.append(f"{type(e).__name__}: {e}")

    def builder() -> None:
        rng = random.Random(1)
        with ctxcache.Client(addr, timeout=120) as c:
            while not stop.is_set():
                try:
                    toks = [rng.randrange(3, 500) for _ in range(rng.randrange(500, 2000))]
                    info = c.build(tokens=toks, name="soak").context
                    with lock:
                        stats["builds"] += 1
                        contexts.append(info.context_id)
                        model.update(n_layers=info.model.n_layers, n_q=info.model.n_q_heads,
                                     n_kv=info.model.n_kv_heads, d=info.model.head_dim)
                        victim = contexts.pop(0) if len(contexts) > 12 else None
                    if victim:
                        c.evict(victim)
                        with lock:
                            stats["evictions"] += 1
                except Exception as e:  # noqa: BLE001
                    error(e)
                stop.wait(1.0)

    def watcher() -> None:
        with ctxcache.Client(addr, timeout=30) as c:
            while not stop.is_set():
                try:
                    for _ in c.watch(timeout=5):
                        with lock:
                            stats["events"] += 1
                        if stop.is_set():
                            break
                except errors.DeadlineExceeded:
                    pass
                except Exception as e:  # noqa: BLE001
                    error(e)

    def worker(i: int) -> None:
        rng = random.Random(100 + i)
        with ctxcache.Client(addr, timeout=60) as c:
            while not stop.is_set():
                with lock:
                    ids = list(contexts)
                    m = dict(model)
                if not ids:
                    stop.wait(0.5)
                    continue
                method = rng.choice(["csa", "quest", "streaming"])
                try:
                    with c.open_session(rng.choice(ids), method=method) as s:
                        for _ in range(rng.randrange(5, 30)):
                            if stop.is_set():
                                break
                            layer = rng.randrange(m["n_layers"])
                            q = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
                                (m["n_q"], m["d"])).astype(np.float32)
                            t0 = time.perf_counter()
                            s.step(layer, q)
                            dt = time.perf_counter() - t0
                            with lock:
                                stats["steps"] += 1
                                latencies.append(dt)
                            if rng.random() < 0.3:
                                kv = np.zeros((m["n_layers"], m["n_kv"], m["d"]), np.float32)
                                s.append(kv, kv)
                except errors.NotFound:
                    with lock:
                        stats["benign"] += 1
                except Exception as e:  # noqa: BLE001
                    error(e)

    threads = [threading.Thread(target=builder, daemon=True)]
    threads += [threading.Thread(target=watcher, daemon=True) for _ in range(2)]
    threads += [threading.Thread(target=worker, args=(i,), daemon=True)
                for i in range(a.sessions)]
    for t in threads:
        t.start()
    samples = []
    t_start = time.monotonic()
    end = t_start + a.minutes * 60
    while time.monotonic() < end:
        time.sleep(a.interval)
        with lock:
            lat = list(latencies)
            latencies.clear()
            snap = dict(stats)
        lat.sort()
        samples.append({
            "t_s": round(time.monotonic() - t_start, 1),
            "rss_mib": proc_status(server.pid, "VmRSS") / 1024,
            "threads": proc_status(server.pid, "Threads"),
            "step_p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
            "step_p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            **snap})
        print(json.dumps(samples[-1]), flush=True)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    server.terminate()
    server.wait(30)

    warm = [s for s in samples if s["t_s"] >= a.warmup_minutes * 60]
    res = {"minutes": a.minutes, "sessions": a.sessions, "samples": samples,
           "errors": stats["errors"], "error_samples": error_samples, "totals": stats}
    if len(warm) >= 2:
        t = np.array([s["t_s"] / 60 for s in warm])
        for key in ("rss_mib", "threads"):
            y = np.array([s[key] for s in warm], dtype=float)
            slope = np.polyfit(t, y, 1)[0]
            res[f"{key}_slope_pct_per_min"] = 100 * slope / max(1e-9, float(np.mean(y)))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot)
    return 0 if stats["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
