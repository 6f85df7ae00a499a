#!/usr/bin/python3
"""Turns the JSON lines of ctxcache-bench runs into PNGs in docs/img/.

Usage: scripts/plot-benchmarks.py [--out docs/img] FILE...

Each FILE is a bench's captured stdout (its last JSON line is used) or a
.json file. The bench is recognised by its fields, and each plot is drawn
from every file that feeds it:

  storage   (ctxcache-bench storage)  storage-reads-by-qd.png: cold and warm
            page-table reads against fio random reads by queue depth;
            storage-write.png: write GB/s per store variant against fio
            sequential write.
  index     (ctxcache-bench index, one file per --method)  build-time-vs-n.png:
            build time per (layer, head) against N per method.
  prefill   (ctxcache-bench prefill)  build-overhead-vs-n.png: index build as a
            percentage of prefill against N per method.
  fidelity  (ctxcache-bench fidelity)  recall-mass-vs-budget.png: recall and
            attention mass against the token budget per method.
  e2e       (ctxcache-bench e2e, one file per context length)
            e2e-step-latency-vs-length.png: decode-step p50/p99 against the
            context length, sparse (csa) against dense (full).

Needs python3-matplotlib (scripts/install-deps.sh). Prints the PNGs it wrote;
exits 1 if no file fed any plot.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_json(path):
    """The last line of `path` that parses as a JSON object, or None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def kind_of(j):
    if "read_vs_fio_qd32" in j or ("fio_seqwrite_gbps" in j and "variants" in j):
        return "storage"
    if j.get("workload") == "index":
        return "index"
    return j.get("bench")


def save(fig, out_dir, name, written):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)


def plot_storage(runs, out_dir, written):
    j = runs[-1][1]  # the latest storage run
    cfg = j.get("config", {})
    threads = cfg.get("reader_threads", 2)
    fig, ax = plt.subplots(figsize=(8, 6))
    fio = j.get("fio_randread_by_qd", {})
    if fio:
        qds = sorted(int(q) for q in fio)
        ax.plot(qds, [fio[str(q)] for q in qds], "k--o", label="fio randread (libaio, 1 job)")
    sweep = j.get("read_cold_by_depth", [])
    if sweep:
        xs = [r["reads_in_flight"] for r in sweep]
        ax.plot(xs, [r["stored_gbps"] for r in sweep], "b-s",
                label=f"store cold (O_DIRECT, {threads} readers x read_io_depth)")
    if "read_cold_gbps" in j:
        depth = cfg.get("read_io_depth", 32)
        ax.plot([threads * depth], [j["read_cold_gbps"]], "b*", markersize=14,
                label=f"store cold, default read_io_depth {depth}, between fio QD32 runs "
                      f"({j['read_cold_gbps']:.3f} GB/s = {j.get('read_vs_fio_qd32', 0):.2f} x "
                      f"fio QD32)")
    if "read_warm_gbps" in j:
        ax.axhline(j["read_warm_gbps"], color="r", linestyle="-",
                   label=f"store warm ({threads} readers, block-cache hit ratio "
                         f"{j.get('block_cache_hit_ratio', 0):.3f})")
    if "fio_randread_gbps" in j:
        ax.plot([threads], [j["fio_randread_gbps"]], "k^",
                label=f"fio randread psync, {threads} jobs x QD1 (around the cold reads)")
    if "fio_randread_qd32_gbps" in j:
        ax.plot([32], [j["fio_randread_qd32_gbps"]], "kD",
                label="fio randread libaio QD32 (around the cold reads)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("reads in flight (queue depth)")
    ax.set_ylabel("GB/s (stored bytes)")
    ax.set_title(f"page-table reads vs the disk, bs {j.get('fio_randread_bs', '?')} B, "
                 f"{cfg.get('tokens', '?')} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    save(fig, out_dir, "storage-reads-by-qd.png", written)

    variants = j.get("variants", {})
    if variants:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        names = list(variants)
        ax.bar(names, [variants[n].get("write_gbps", 0) for n in names], color="tab:blue")
        if j.get("fio_seqwrite_gbps"):
            ax.axhline(j["fio_seqwrite_gbps"], color="k", linestyle="--",
                       label="fio sequential write")
            ax.axhline(0.7 * j["fio_seqwrite_gbps"], color="gray", linestyle=":",
                       label="0.7 x fio (goal)")
        ax.set_ylabel("write GB/s (raw KV, commit included)")
        ax.set_title("context write per store variant")
        ax.legend(fontsize=8)
        save(fig, out_dir, "storage-write.png", written)


def plot_index(runs, out_dir, written):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_method = {}
    for _, j in runs:
        method = j.get("method", "csa")
        for r in j.get("runs", []):
            if "n" in r and "build_ms" in r:
                by_method.setdefault(method, []).append((r["n"], r["build_ms"]))
    if not by_method:
        plt.close(fig)
        return
    for method, pts in sorted(by_method.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (tokens)")
    ax.set_ylabel("build ms per (layer, kv head)")
    ax.set_title("index build time vs N (ctxcache-bench index)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, out_dir, "build-time-vs-n.png", written)


def plot_prefill(runs, out_dir, written):
    by_method = {}
    for _, j in runs:
        for r in j.get("results", []):
            builds = r.get("index_build_s") or {}
            for method, s in builds.items():
                if s is not None and r.get("prefill_s"):
                    by_method.setdefault(method, []).append(
                        (r["tokens"], 100.0 * s / r["prefill_s"]))
    if not by_method:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, pts in sorted(by_method.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=method)
    ax.axhline(10, color="gray", linestyle=":", label="10% goal (all methods)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("build time, % of prefill")
    ax.set_title("index build overhead vs N (ctxcache-bench prefill)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    save(fig, out_dir, "build-overhead-vs-n.png", written)


def plot_fidelity(runs, out_dir, written):
    by_method = {}
    for _, j in runs:
        for b in j.get("equal_budget", []):
            for r in b.get("methods", []):
                if "recall" in r:
                    by_method.setdefault(r["method"], []).append(
                        (b["budget_frac"], r["recall"], r["mass"]))
    if not by_method:
        return
    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(10, 4.2))
    for method, pts in sorted(by_method.items()):
        pts.sort()
        xs = [100 * p[0] for p in pts]
        ax_r.plot(xs, [p[1] for p in pts], "-o", label=method)
        ax_m.plot(xs, [p[2] for p in pts], "-o", label=method)
    for ax, label in ((ax_r, "recall@K"), (ax_m, "attention mass")):
        ax.set_xlabel("budget (% of tokens per q head)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_r.set_title("recall vs budget (ctxcache-bench fidelity)")
    ax_m.set_title("mass vs budget")
    ax_m.legend(fontsize=8)
    save(fig, out_dir, "recall-mass-vs-budget.png", written)


def plot_e2e(runs, out_dir, written):
    rows = []
    for _, j in runs:
        if "n_tokens" in j and "csa" in j and "full" in j:
            rows.append(j)
    if not rows:
        return
    rows.sort(key=lambda j: j["n_tokens"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [j["n_tokens"] for j in rows]
    for method, style in (("csa", "b"), ("full", "k")):
        label = "sparse (csa, 5%)" if method == "csa" else "dense (full)"
        ax.plot(xs, [j[method]["step_p50_us_1"] / 1000 for j in rows], style + "-o",
                label=label + " p50")
        ax.plot(xs, [j[method]["step_p99_us_1"] / 1000 for j in rows], style + ":^",
                label=label + " p99")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step, ms (1 session, loopback)")
    ax.set_title("end-to-end step latency vs context length (ctxcache-bench e2e)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out_dir, "e2e-step-latency-vs-length.png", written)


PLOTTERS = {
    "storage": plot_storage,
    "index": plot_index,
    "prefill": plot_prefill,
    "fidelity": plot_fidelity,
    "e2e": plot_e2e,
}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/img", help="output directory (default docs/img)")
    parser.add_argument("files", nargs="+", help="bench stdout captures or .json files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for path in args.files:
        j = load_json(path)
        if j is None:
            print(f"plot-benchmarks: {path}: no JSON object line; skipped", file=sys.stderr)
            continue
        kind = kind_of(j)
        if kind not in PLOTTERS:
            print(f"plot-benchmarks: {path}: unknown bench; skipped", file=sys.stderr)
            continue
        runs.setdefault(kind, []).append((path, j))
    written = []
    for kind, items in runs.items():
        PLOTTERS[kind](items, args.out, written)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
