#!/usr/bin/env python3
"""Plots pairs/s against threads, one panel per workload, one line per allocator and stream mode
(colour: allocator; line style: stream mode), from the JSON lines of `cuarena --json`. Rows
without a `streams` field (older runs) count as `ptds`.
Usage: tools/plot_bench.py RESULTS.jsonl OUT.png [TITLE]"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in rows:
    r.setdefault("streams", "ptds")
title = sys.argv[3] if len(sys.argv) > 3 else ""
# random_allocations runs on one thread only: nothing to plot against threads.
workloads = [w for w in dict.fromkeys(r["workload"] for r in rows) if not w.startswith("random_allocations")]
allocators = list(dict.fromkeys(r["allocator"] for r in rows))
modes = list(dict.fromkeys(r["streams"] for r in rows))
styles = {"ptds": "-", "legacy": ":", "own": "--"}
colours = {a: f"C{i}" for i, a in enumerate(allocators)}
cols = 3
nrows = max(1, (len(workloads) + cols - 1) // cols)
fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
for ax, w in zip(axes.flat, workloads):
    for a in allocators:
        for m in modes:
            pts = sorted(
                (r["threads"], r["pairs_per_sec"])
                for r in rows
                if r["workload"] == w and r["allocator"] == a and r["streams"] == m
            )
            if pts:
                label = a if len(modes) == 1 else f"{a} ({m})"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    color=colours[a],
                    linestyle=styles.get(m, "-."),
                    label=label,
                )
    ax.set_title(w)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("threads")
    ax.set_ylabel("alloc+free pairs / s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
for ax in list(axes.flat)[len(workloads):]:
    ax.axis("off")
fig.suptitle(title)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
