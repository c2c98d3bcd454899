"""Draw tok/s and peak memory, qshard against the reference, from benchmarks/speed.py results.

  python3 benchmarks/chart.py --out docs/speed.png RESULTS.json [RESULTS.json ...]

Each results file is one configuration (its `label`, or "seq N"); bars per system. Needs matplotlib
(the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("results", nargs="+", type=Path)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(path.read_text()) for path in args.results]
    labels = [r.get("label") or f"seq {r['seq']}" for r in runs]
    systems = list(dict.fromkeys(res["system"] for r in runs for res in r["results"]))
    width = 0.8 / len(systems)
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, system in enumerate(systems):
        xs, speed, mem = [], [], []
        for j, run in enumerate(runs):
            found = next((res for res in run["results"] if res["system"] == system), None)
            if found:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                speed.append(found["tokens_per_s"])
                mem.append(found["peak_alloc_gib"])
        bars = ax_speed.bar(xs, speed, width, label=system)
        ax_speed.bar_label(bars, fmt="{:,.0f}", fontsize=7)
        bars = ax_mem.bar(xs, mem, width, label=system)
        ax_mem.bar_label(bars, fmt="{:.1f}", fontsize=7)
    for ax, title in ((ax_speed, "tokens / s (higher is better)"), (ax_mem, "peak allocated GiB (lower is better)")):
        ax.set_xticks(range(len(runs)), labels)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    # One legend under both plots: inside a plot it covers bars of the configurations with fewer systems.
    handles, names = ax_speed.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(systems), fontsize=8, frameon=False)
    device = runs[0].get("device", "")
    fig.suptitle(f"Llama-3-8B-shaped QLoRA r=64, batch 1, one {device}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
