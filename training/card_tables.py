#!/usr/bin/env python3
"""Markdown tables for models/ctxcache-ref/MODEL_CARD.md from `train.py eval`
output: perplexity by context length, attention on token 0 by layer, and
full-attention task accuracy by family x length and by depth.

Usage: python3 training/card_tables.py training/results/v2-run3/eval.json
"""
import json
import sys


def length_label(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def frac(c):
    return f"{c[0]}/{c[1]} ({c[0] / c[1]:.0%})" if c[1] else "-"


def main():
    e = json.load(open(sys.argv[1]))
    print("| context | windows | perplexity | last 512 positions | unigram, same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for n, p in sorted(e["perplexity"].items(), key=lambda kv: int(kv[0])):
        print(f"| {length_label(int(n))} | {p['windows']} | {p['ppl']:.2f} | {p['ppl_last512']:.2f} | "
              f"{p['unigram_ppl_same_tokens']:.1f} |")
    print()
    s = e["attention_sinks"]
    print("| layer | doc_start: mean | doc_start: max head | mid_doc: mean | mid_doc: max head |")
    print("| --- | --- | --- | --- | --- |")
    for a, b in zip(s["doc_start"]["layers"], s["mid_doc"]["layers"]):
        print(f"| {a['layer']} | {a['mean']:.4f} | {a['max_head']:.4f} | {b['mean']:.4f} | "
              f"{b['max_head']:.4f} |")
    print()
    by = e["tasks"]["by"]
    fams = sorted({k.split(":")[1] for k in by if k.startswith("family:") and "/" not in k})
    lens = sorted({int(k.split(":")[1]) for k in by if k.startswith("length:")})
    print("| family | " + " | ".join(length_label(n) for n in lens) + " | all |")
    print("| --- |" + " --- |" * (len(lens) + 1))
    for f in fams:
        cells = [frac(by.get(f"family:{f}/length:{n}", [0, 0])) for n in lens]
        print(f"| {f} | " + " | ".join(cells) + f" | {frac(by[f'family:{f}'])} |")
    print("| all | " + " | ".join(frac(by[f"length:{n}"]) for n in lens) +
          f" | {frac(by['all'])} |")
    print()
    deps = sorted(k for k in by if k.startswith("depth:"))
    print("| needle depth | " + " | ".join(d.split(":")[1] for d in deps) + " |")
    print("| --- |" + " --- |" * len(deps))
    print("| accuracy | " + " | ".join(frac(by[d]) for d in deps) + " |")


if __name__ == "__main__":
    main()
