"""`qshard plan`'s predictions against measured runs: a grid of real training runs on this machine's GPU(s), each
predicted first (`qshard plan --json`, same options) and then run for a few steps; peak GPU memory (the training
log's peak_mem_gib, torch's max_memory_allocated) and steady tok/s (the median of the steps after the warm-up)
are recorded beside the prediction in one JSON file, and drawn as two predicted-vs-measured scatter plots.

  python3 benchmarks/plan_vs_measured.py --out DIR [--gpu-kind h200] [--steps 8] [--warmup 3] [--only NAME ...]
      [--gpu-mem GIB] [--fit-checks] [--list]

Models are named shapes with random weights (model.shape: no checkpoint is needed) trained on letters data of the
run's length (make_data.py). A run that fails (an OOM included) is recorded with its last error line: a
prediction of "does not fit" that then runs out of memory is a correct prediction. --fit-checks adds the issue's
two: `--fit` for the 70B shape and for the 8B shape at 32k under a 24 GiB cap, and a run of each chosen setting
under that cap (torch.cuda.set_per_process_memory_fraction). Results: DIR/plan_vs_measured.json
and DIR/plan_vs_measured.png; each run's log and output directory in DIR/runs/NAME.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def grid() -> dict[str, list[str]]:
    """name -> qshard options: 8B and 70B shapes; seq 2k, 8k, 32k; qlora and lora; offload, compile, batch sizes."""
    runs: dict[str, list[str]] = {}
    for seq, train_type, compiled, batch in itertools.product((2048, 8192, 32768), ("qlora", "lora"), (True, False),
                                                              (1, 2)):
        if seq == 32768 and batch > 1:
            continue
        name = f"8b-{train_type}-{seq // 1024}k-b{batch}{'-compile' if compiled else ''}"
        runs[name] = ["--model.shape", "llama3-8b", "--train-type", train_type, "--max-length", str(seq),
                      "--batch-size", str(batch), "--parallel.compile", str(compiled).lower()]
    runs["8b-qlora-32k-actoffload"] = ["--model.shape", "llama3-8b", "--max-length", "32768",
                                       "--parallel.activation_offload", "true"]
    runs["8b-qlora-8k-ac2"] = ["--model.shape", "llama3-8b", "--max-length", "8192", "--parallel.ac_every", "2"]
    runs["8b-qlora-2k-saveproj"] = ["--model.shape", "llama3-8b", "--max-length", "2048", "--parallel.compile", "true",
                                    "--parallel.ac_save_projections", "true"]
    runs["8b-full-2k"] = ["--model.shape", "llama3-8b", "--train-type", "full", "--max-length", "2048"]
    for offload in (False, True):
        runs[f"70b-qlora-2k{'-cpuoffload' if offload else ''}"] = [
            "--model.shape", "llama3-70b", "--max-length", "2048", "--parallel.cpu_offload", str(offload).lower()]
    runs["70b-qlora-8k-cpuoffload-actoffload"] = ["--model.shape", "llama3-70b", "--max-length", "8192",
                                                  "--parallel.cpu_offload", "true",
                                                  "--parallel.activation_offload", "true"]
    return runs


COMMON = ["--lora-rank", "64", "--lora.alpha", "16", "--data.eval_fraction", "0", "--optim.schedule", "constant",
          "--lr", "1e-4", "--train.log_every", "1"]


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
                        str(16 * (args.steps + 2)), "--tokens", str(seq)], check=True)
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
        return {"name": name, "predicted": planned,
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


def main() -> None:
    if sys.argv[1:2] == ["--_capped-train"]:
        sys.exit(capped_train(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where results go (required unless --list)")
    parser.add_argument("--gpu-kind", default="h200")
    parser.add_argument("--gpu-mem", type=float, help="cap each run's GPU memory (and tell the prediction)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="run only these names (see --list)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--fit-checks", action="store_true", help="also run the two --fit checks (24 GiB cap)")
    args = parser.parse_args()
    runs = grid()
    if args.list:
        print("\n".join(f"{name}: {' '.join(options)}" for name, options in runs.items()))
        return
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, options in runs.items():
        if args.only and name not in args.only:
            continue
        predicted = predict([*options, *COMMON], args)
        measured = measure(name, options, _seq(options), args)
        row = {"name": name, "options": options, "predicted": predicted, "measured": measured}
        for key in ("peak_gpu_gib", "tok_s"):
            if key in predicted and key in measured:
                row[f"{key}_error"] = round(predicted[key] / measured[key] - 1, 4)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "predicted"}), flush=True)
        (args.out / "plan_vs_measured.json").write_text(json.dumps(results, indent=1))
    for name, options in FIT_CHECKS.items() if args.fit_checks else ():
        row = fit_check(name, options, args)
        results.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "plan_vs_measured.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "plan_vs_measured.png")


if __name__ == "__main__":
    main()
