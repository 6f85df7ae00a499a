#!/usr/bin/env python3
"""Plots `ctxcache-bench tasks` output: exact-match accuracy against the page
budget, one line per method (full attention as a horizontal line), for all
tasks and for the far needles (depth <= 0.25).

Usage: python3 bench/plot_tasks.py RESULT.json [more.json ...] --out docs/img/tasks_accuracy.png
         [--table]
Each input is a file whose last line is the bench's JSON; several inputs are
merged by summing the correct/total counts of each group (the shards of
`ctxcache-bench tasks --shard I/N`, or runs at different lengths). --table
prints the merged accuracies as a markdown table (method@budget x all, far,
near, families, lengths, and the accuracy relative to full).
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
            m = merged.setdefault(label, {"method": a["method"], "budget": a["budget"],
                                          "groups": {}})
            for g, c in a["groups"].items():
                t = m["groups"].setdefault(g, {"correct": 0, "total": 0})
                t["correct"] += c["correct"]
                t["total"] += c["total"]
    return merged


def table(acc):
    """Markdown: one row per configuration (full first, then by method and
    budget), a column per group, and all/full (the share of full's accuracy)."""
    groups = set()
    for v in acc.values():
        groups |= set(v["groups"])
    fams = sorted(g for g in groups if g.startswith("family:"))
    lens = sorted((g for g in groups if g.startswith("length:")), key=lambda g: int(g[7:]))
    cols = ["all", "depth:far", "depth:near"] + fams + lens
    names = [c.replace("family:", "").replace("depth:", "").replace("length:", "") for c in cols]
    order = sorted(acc, key=lambda k: (acc[k]["budget"] > 0, acc[k]["method"], acc[k]["budget"]))
    full = acc.get("full", {}).get("groups", {}).get("all")
    full_acc = full["correct"] / full["total"] if full and full["total"] else None
    lines = ["| method@budget | " + " | ".join(names) + " | all / full |",
             "| --- |" + " --- |" * (len(cols) + 1)]
    for k in order:
        g = acc[k]["groups"]
        cells = [f"{g[c]['correct'] / g[c]['total']:.3f}" if c in g and g[c]["total"] else "-"
                 for c in cols]
        a = g.get("all")
        rel = (f"{(a['correct'] / a['total']) / full_acc:.3f}"
               if a and a["total"] and full_acc else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {rel} |")
    n = full["total"] if full else max(v["groups"]["all"]["total"] for v in acc.values())
    lines.append(f"\n({n} tasks; far = depth <= 0.25, near = depth >= 0.75)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--table", action="store_true", help="print a markdown table")
    a = ap.parse_args()
    acc = load(a.inputs)
    if a.table:
        print(table(acc))
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
