"""DPO at the 70B shape on one GPU: pairs/s, peak GPU memory and peak host RSS, with the whole GPU or under a
memory cap with CPU offload (the issue's "70B DPO on one GPU, and under a 24 GiB cap with CPU offload").

  python3 benchmarks/dpo_70b.py --out DIR [--cap-gib 24] [--prompt 1024] [--completion 1024] [--steps 6]
                                [--warmup 2] [--qshard-args "--parallel.cpu_offload true"]

The work is benchmarks/dpo_8b.py's (one pair per step, the reference from the base with the adapters off), over
random weights of the llama3-70b shape (`model.shape`: no checkpoint, which would not fit the GPU machine's
disk). `--cap-gib` caps the process's GPU memory (torch.cuda.set_per_process_memory_fraction, as
benchmarks/plan_vs_measured.py does) before qshard allocates anything. Prints one line and writes
DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dpo_8b import write_pairs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shape", default="llama3-70b")
    p.add_argument("--cap-gib", type=float, help="cap the run's GPU memory at this many GiB")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--qshard-args", default="")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "pairs.jsonl"
    write_pairs(data, args.steps + 8, args.prompt, args.completion)
    run_dir = args.out / "qshard"
    cmd = [sys.executable, str(HERE / "plan_vs_measured.py"), "--_capped-train", "--model.shape", args.shape,
           "--data", str(data), "--data.eval_fraction", "0", "--output-dir", str(run_dir), "--overwrite",
           "--train.objective", "dpo", "--pref.beta", "0.1", "--pref.max_prompt_length", str(args.prompt),
           "--data.max_length", str(args.prompt + args.completion), "--batch-size", "1",
           "--max-steps", str(args.steps), "--lora-rank", "64", "--lora.alpha", "16", "--optim.schedule", "constant",
           "--optim.warmup_steps", "0", "--lr", "5e-6", "--train.log_every", "1", "--checkpoint.at_end", "false",
           *shlex.split(args.qshard_args)]
    env = {**os.environ, **({"QSHARD_BENCH_GPU_MEM_GIB": str(args.cap_gib)} if args.cap_gib else {})}
    with open(args.out / "qshard.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    host_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if done.returncode:
        sys.exit(f"qshard failed ({done.returncode}); see {args.out / 'qshard.log'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time_s" in r]
    step = statistics.median(r["step_time_s"] for r in records[args.warmup:])
    result = {"shape": args.shape, "cap_gib": args.cap_gib, "qshard_args": args.qshard_args, "step_s": step,
              "pairs_per_s": 1 / step, "peak_gib": max(r["peak_mem_gib"] for r in records),
              "host_rss_gib": host_gib, "step_times_s": [r["step_time_s"] for r in records]}
    print(json.dumps(result))
    (args.out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
