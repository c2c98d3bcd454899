"""`qshard plot RUN [RUN ...] [--out FILE]`: one PNG comparing runs over their steps (train and held-out loss,
learning rate, tokens/s, peak memory), read from each run's metrics.jsonl. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from qshard.errors import QShardError
from qshard.rundir import write_atomic, writing
from qshard.train.metrics import read_until

log = logging.getLogger("qshard")

# (metrics.jsonl field, panel title); a run without the field (no held-out set) has no line in that panel.
PANELS = (
    ("loss", "train loss"),
    ("eval_loss", "held-out loss"),
    ("lr", "learning rate"),
    ("tokens_per_s", "tokens/s"),
    ("peak_mem_gib", "peak memory (GiB)"),
)


def run_plot(runs: list[Path], out: Path | None) -> Path:
    """Draw `runs` into `out` (default: RUN/plot.png for one run, plot.png here for several) and return it."""
    pyplot = _pyplot()
    metrics = {run: read_metrics(run) for run in runs}  # every run checked before anything is drawn
    out = out or (runs[0] / "plot.png" if len(runs) == 1 else Path("plot.png"))
    fig, grid = pyplot.subplots(2, 3, figsize=(13, 7))
    axes = grid.flat
    for ax, (field, title) in zip(axes, PANELS, strict=False):
        for run, records in metrics.items():
            points = [(r["step"], r[field]) for r in records if field in r]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="." if len(points) < 50 else None, label=_label(run, runs))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    grid[0][0].legend(fontsize="small")
    grid[-1][-1].axis("off")  # five panels on a grid of six
    fig.tight_layout()
    with writing(out):
        write_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    pyplot.close(fig)
    log.info("wrote %s", out)
    return out


def read_metrics(run: Path) -> list[dict]:
    """A run's step records; a directory without metrics.jsonl is a QShardError naming it."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise QShardError(f"{run}: no metrics.jsonl (not a qshard run?)")
    return [json.loads(line) for line in read_until(path, sys.maxsize)]


def _label(run: Path, runs: list[Path]) -> str:
    """The run directory's name, or its path where two runs share a name."""
    same_name = sum(r.name == run.name for r in runs) > 1
    return str(run) if same_name else run.name


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise QShardError("qshard plot needs matplotlib: pip install 'qshard[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as pyplot

    return pyplot
