#!/usr/bin/env python3
"""Plots `ctxcache-bench tasks` output: exact-match accuracy against the page
budget, one line per method (full attention as a horizontal line), for all
tasks and for the far needles (depth <= 0.25).

Usage: python3 bench/plot_tasks.py RESULT.json [more.json ...] --out docs/img/tasks_accuracy.png
Each input is a file whose last line is the bench's JSON; several inputs are
merged by summing the correct/total counts of each group.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths):
    merged = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            out = json.loads(f.read().strip().splitlines()[-1])
        for label, a in out["accuracy"].items():
            m = merged.setdefault(label, {"method": a["method"], "budget": a["budget"], "groups": {}})
            for g, c in a["groups"].items():
                t = m["groups"].setdefault(g, {"correct": 0, "total": 0})
                t["correct"] += c["correct"]
                t["total"] += c["total"]
    return merged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    acc = load(a.inputs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, group, name in ((axes[0], "all", "all tasks"), (axes[1], "depth:far", "far needles")):
        methods = sorted({v["method"] for v in acc.values() if v["budget"] > 0})
        for m in methods:
            pts = sorted((v["budget"], v["groups"][group]) for v in acc.values()
                         if v["method"] == m and group in v["groups"])
            if pts:
                ax.plot([100 * b for b, _ in pts], [c["correct"] / c["total"] for _, c in pts],
                        "o-", label=m)
        if "full" in acc and group in acc["full"]["groups"]:
            c = acc["full"]["groups"][group]
            ax.axhline(c["correct"] / c["total"], color="k", ls="--", label="full")
        n = max((v["groups"].get(group, {}).get("total", 0) for v in acc.values()), default=0)
        ax.set_title(f"{name} ({n} tasks)")
        ax.set_xlabel("page budget (% of pages)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact-match accuracy")
    axes[1].legend(fontsize=8, loc="best")
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
