"""`qshard plan`'s predictions against measured runs: a grid of real training runs on this machine's GPU(s), each
predicted first (`qshard plan --json`, same options) and then run for a few steps; peak GPU memory (the training
log's peak_mem_gib, torch's max_memory_allocated) and steady tok/s (the median of the steps after the warm-up)
are recorded beside the prediction in one JSON file, and drawn as two predicted-vs-measured scatter plots.

  python3 benchmarks/plan_vs_measured.py --out DIR [--gpu-kind h200] [--steps 8] [--warmup 3] [--only NAME ...]
      [--gpu-mem GIB] [--fit-checks] [--list] [--skip-predict]
  python3 benchmarks/plan_vs_measured.py --out DIR2 --predict-from DIR/plan_vs_measured.json [--gpu-kind h200]

Models are named shapes with random weights (model.shape: no checkpoint is needed) trained on letters data of the
run's length (make_data.py). A run that fails (an OOM included) is recorded with its last error line: a
prediction of "does not fit" that then runs out of memory is a correct prediction. --fit-checks adds the issue's
two: `--fit` for the 70B shape and for the 8B shape at 32k under a 24 GiB cap, and a run of each chosen setting
under that cap (torch.cuda.set_per_process_memory_fraction). Results: DIR/plan_vs_measured.json
and DIR/plan_vs_measured.png; each run's log and output directory in DIR/runs/NAME. Predictions need no GPU:
--skip-predict measures only, and --predict-from predicts the measured runs of an earlier result again (on any
machine) and writes the comparison and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def grid() -> dict[str, list[str]]:
    """name -> qshard options: 13 runs over the 8B and 70B shapes; seq 2k, 8k, 32k; qlora, lora and full; compile
    on and off; micro-batch 1 and 2; activation offload, CPU offload, checkpointing every other block."""

    def row(shape: str, seq: int, train_type: str = "qlora", batch: int = 1, compiled: bool = True,
            *extra: str) -> list[str]:
        offload = [] if "--parallel.activation_offload" in extra else ["--parallel.activation_offload", "false"]
        return ["--model.shape", f"llama3-{shape}", "--train-type", train_type, "--max-length", str(seq),
                "--batch-size", str(batch), "--parallel.compile", str(compiled).lower(), *offload, *extra]

    return {
        "8b-qlora-2k-b1-compile": row("8b", 2048),
        "8b-qlora-2k-b2": row("8b", 2048, "qlora", 2, False),
        "8b-qlora-8k-b1-compile": row("8b", 8192),
        "8b-qlora-8k-b2": row("8b", 8192, "qlora", 2, False),
        "8b-qlora-32k-b1-compile": row("8b", 32768),
        "8b-qlora-32k-actoffload-compile": row("8b", 32768, "qlora", 1, True, "--parallel.activation_offload", "true"),
        "8b-qlora-8k-ac2-compile": row("8b", 8192, "qlora", 1, True, "--parallel.ac_every", "2"),
        "8b-lora-2k-b1-compile": row("8b", 2048, "lora"),
        "8b-lora-8k-b2-compile": row("8b", 8192, "lora", 2),
        "8b-full-bf16-2k-compile": row("8b", 2048, "full", 1, True, "--train.precision", "bf16"),
        "70b-qlora-2k-compile": row("70b", 2048),
        "70b-qlora-2k-cpuoffload": row("70b", 2048, "qlora", 1, False, "--parallel.cpu_offload", "true"),
        "70b-qlora-8k-cpuoffload-actoffload": row("70b", 8192, "qlora", 1, False, "--parallel.cpu_offload", "true",
                                                  "--parallel.activation_offload", "true"),
    }


COMMON = ["--lora-rank", "64", "--lora.alpha", "16", "--data.eval_fraction", "0", "--optim.schedule", "constant",
          "--lr", "1e-4", "--train.log_every", "1", "--checkpoint.at_end", "false"]


def predict(options: list[str], args) -> dict:
    cmd = [sys.executable, "-m", "qshard", "plan", *options, "--gpu-kind", args.gpu_kind, "--json"]
    if args.gpu_mem:
        cmd += ["--gpu-mem", str(args.gpu_mem)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout)


def measure(name: str, options: list[str], seq: int, args) -> dict:
    """Train `steps` steps; the peak memory and the median tok/s of the steps after `warmup`."""
    run_dir = args.out / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    data = args.out / f"data-{seq}.jsonl"
    if not data.exists():
        subprocess.run([sys.executable, str(HERE / "make_data.py"), "--out", str(data), "--examples",
                        str(2 * args.steps + 16), "--tokens", str(seq)], check=True)
    env = {**os.environ}
    if args.gpu_mem:  # a cap below the device's memory: what the prediction is told
        env["QSHARD_BENCH_GPU_MEM_GIB"] = str(args.gpu_mem)
    cmd = [sys.executable, str(HERE / "plan_vs_measured.py"), "--_capped-train", *options, *COMMON,
           "--data", str(data), "--output-dir", str(run_dir / "out"), "--overwrite", "--max-steps", str(args.steps)]
    with open(run_dir / "train.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    metrics = run_dir / "out" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "tokens_per_s" in r]
    if done.returncode or len(records) <= args.warmup:
        tail = (run_dir / "train.log").read_text().strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0], "oom": "out of memory" in tail[0].lower()}
    steady = records[args.warmup:]
    return {"peak_gpu_gib": max(r["peak_mem_gib"] for r in records),
            "tok_s": statistics.median(r["tokens_per_s"] for r in steady)}


# The two --fit checks: the settings `qshard plan --fit` picks under a 24 GiB cap must then train.
FIT_CHECKS = {
    "fit-70b-2k-24gib": ["--model.shape", "llama3-70b", "--max-length", "2048"],
    "fit-8b-32k-24gib": ["--model.shape", "llama3-8b", "--max-length", "32768"],
}


def fit_check(name: str, options: list[str], args) -> dict:
    """`qshard plan --fit` under a 24 GiB cap, then a run with its fastest setting under the same cap."""
    capped = argparse.Namespace(**{**vars(args), "gpu_mem": 24.0})
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    planned = predict([*options, *COMMON, "--fit", "--top", "1", "--host-mem", f"{host:.0f}"], capped)
    if not planned.get("fit"):  # the plan's own error where it failed: no GPU run for it
        return {"name": name, "options": options, "predicted": planned,
                "measured": {"error": planned.get("error", "--fit found no setting")}}
    chosen = [arg for flag in planned["fit"][0]["overrides"] for arg in flag.split(" ")]
    measured = measure(name, [*options, *chosen], _seq(options), capped)
    return {"name": name, "options": [*options, *chosen], "predicted": planned["fit"][0], "measured": measured}


def capped_train(argv: list[str]) -> int:
    """`qshard train` under a GPU memory cap (torch.cuda.set_per_process_memory_fraction), for --gpu-mem."""
    import torch

    cap = os.environ.get("QSHARD_BENCH_GPU_MEM_GIB")
    if cap and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) * 2**30 / total))
    from qshard.cli import main

    return main(["train", *argv])


def _seq(options: list[str]) -> int:
    return int(options[options.index("--max-length") + 1])


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, key, unit, band in ((axes[0], "peak_gpu_gib", "GiB", 0.1), (axes[1], "tok_s", "tok/s", 0.2)):
        points = [(r["measured"][key], r["predicted"][key], r["name"]) for r in results
                  if key in r.get("measured", {}) and key in r.get("predicted", {})]
        if not points:
            continue
        top = max(max(m, p) for m, p, _ in points) * 1.1
        ax.plot([0, top], [0, top], "k-", lw=0.8)
        ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], color="0.9",
                        label=f"within {band:.0%}")
        ax.scatter([m for m, _, _ in points], [p for _, p, _ in points], s=18)
        for m, p, name in points:
            ax.annotate(name, (m, p), fontsize=6, alpha=0.7)
        ax.set(xlabel=f"measured {unit}", ylabel=f"predicted {unit}", xlim=(0, top), ylim=(0, top),
               title=f"qshard plan: {key}")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def compare(name: str, options: list[str], predicted: dict, measured: dict) -> dict:
    row = {"name": name, "options": options, "predicted": predicted, "measured": measured}
    for key in ("peak_gpu_gib", "tok_s"):
        if key in predicted and key in measured:
            row[f"{key}_error"] = round(predicted[key] / measured[key] - 1, 4)
    return row


def main() -> None:
    if sys.argv[1:2] == ["--_capped-train"]:
        sys.exit(capped_train(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where results go (required unless --list)")
    parser.add_argument("--gpu-kind", default="h200")
    parser.add_argument("--gpu-mem", type=float, help="cap each run's GPU memory (and tell the prediction)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="run only these names (see --list; with --fit-checks, naming "
                                                      "fit-70b-2k-24gib or fit-8b-32k-24gib runs only that one)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--fit-checks", action="store_true", help="also run the two --fit checks (24 GiB cap)")
    parser.add_argument("--skip-predict", action="store_true",
                        help="measure only (predictions need no GPU: add them later with --predict-from)")
    parser.add_argument("--predict-from", type=Path,
                        help="a plan_vs_measured.json of measured runs: predict each again, write the comparison and "
                             "the plot to --out (no training)")
    args = parser.parse_args()
    runs = grid()
    if args.list:
        print("\n".join(f"{name}: {' '.join(options)}" for name, options in runs.items()))
        return
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []

    def record(row: dict) -> None:
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "predicted"}), flush=True)
        (args.out / "plan_vs_measured.json").write_text(json.dumps(results, indent=1))

    if args.predict_from:
        for old in json.loads(args.predict_from.read_text()):
            if old["name"] in FIT_CHECKS:  # a --fit check: its choice (or failure) is kept as it was made
                record(old)
                continue
            # Runs recorded before model.embedding_on_host had `auto` (2026-12-04) kept the embedding on the GPU.
            given = old["options"] if "--model.embedding_on_host" in old["options"] else \
                [*old["options"], "--model.embedding_on_host", "false"]
            record(compare(old["name"], given, predict([*given, *COMMON], args), old["measured"]))
        plot(results, args.out / "plan_vs_measured.png")
        return
    for name, options in runs.items():
        if args.only and name not in args.only:
            continue
        predicted = {} if args.skip_predict else predict([*options, *COMMON], args)
        record(compare(name, options, predicted, measure(name, options, _seq(options), args)))
    named_fits = [n for n in args.only or () if n in FIT_CHECKS]
    for name, options in FIT_CHECKS.items() if args.fit_checks else ():
        if named_fits and name not in named_fits:
            continue
        record(fit_check(name, options, args))
    if not args.skip_predict:
        plot(results, args.out / "plan_vs_measured.png")


if __name__ == "__main__":
    main()
