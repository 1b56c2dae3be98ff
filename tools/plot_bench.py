#!/usr/bin/env python3
"""Plots pairs/s against threads, one panel per workload, one line per allocator, from the JSON
lines of `cuarena --json`. Usage: tools/plot_bench.py RESULTS.jsonl OUT.png [TITLE]"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
title = sys.argv[3] if len(sys.argv) > 3 else ""
workloads = [w for w in dict.fromkeys(r["workload"] for r in rows) if w != "random_allocations"]
allocators = list(dict.fromkeys(r["allocator"] for r in rows))
cols = 3
nrows = (len(workloads) + cols - 1) // cols
fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
for ax, w in zip(axes.flat, workloads):
    for a in allocators:
        pts = sorted((r["threads"], r["pairs_per_sec"]) for r in rows if r["workload"] == w and r["allocator"] == a)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=a)
    ax.set_title(w)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("threads")
    ax.set_ylabel("alloc+free pairs / s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
for ax in list(axes.flat)[len(workloads):]:
    ax.axis("off")
fig.suptitle(title)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
