"""70B-shaped QLoRA on one GPU capped at 24 GiB, with CPU offload: tok/s, peak GPU memory, peak CPU RSS.

  python benchmarks/offload_70b.py --out DIR [--cap-gib 24] [--seq 2048] [--steps 6] [--warmup 2]
                                   [--quant-sharding dtensor] [--qshard-args "..."]
  python benchmarks/offload_70b.py --out DIR --dry-run     # llama-tiny, a few short steps, on any machine

The cap is applied in this process with torch.cuda.set_per_process_memory_fraction(cap / total) before
qshard allocates anything, then `qshard train` runs in the same process (runpy, one rank), so every
allocation the run makes is under the cap: the caching allocator raises out-of-memory past it, as a
24 GiB card would. Random weights of the llama3-70b shape (no checkpoint), LoRA r=64 alpha 16 on every
block linear, NF4 base, activation checkpointing, `parallel.cpu_offload true` (LoRA, gradients and AdamW
state on the CPU through FSDP2; the NF4 storage in pinned host memory, a block or two on the GPU at a
time). `--quant-sharding dtensor` by default: that is where the storage offload of parallel/offload.py
applies (and what torch 2.11 picks); under `fsdp` the storage would be materialized on the GPU whole
at load, 35 GiB, over the cap.

tok/s is the median over the steps after `--warmup` (from metrics.jsonl: input tokens / step time,
optimizer step included). Peak GPU memory is torch's max_memory_allocated (and max_memory_reserved, what
the cap bounds) over the whole run, loading included; peak CPU RSS is the process's ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import resource
import runpy
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shape", default="llama3-70b")
    p.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap for this process, GiB")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--quant-sharding", default="dtensor", choices=["auto", "fsdp", "dtensor"])
    p.add_argument("--qshard-args", default="", help="extra options for qshard train (e.g. '--parallel.compile true')")
    p.add_argument("--dry-run", action="store_true", help="llama-tiny, seq 64, 3 steps: checks the script anywhere")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.seq, args.steps, args.warmup = "llama-tiny", 64, 3, 1
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    return args


def qshard_argv(args: argparse.Namespace, data: Path, run_dir: Path) -> list[str]:
    return [
        "train", "--model.shape", args.shape, "--data", str(data), "--data.eval_fraction", "0",
        "--output-dir", str(run_dir), "--overwrite", "--max-length", str(args.seq),
        "--batch-size", str(args.batch), "--grad-accum", str(args.grad_accum), "--max-steps", str(args.steps),
        "--lora-rank", "64", "--lora.alpha", "16", "--optim.schedule", "constant", "--lr", "1e-4",
        "--parallel.cpu_offload", "true", "--parallel.quant_sharding", args.quant_sharding,
        *shlex.split(args.qshard_args),
    ]


def cap_gpu_memory(cap_gib: float) -> float | None:
    """Cap this process's CUDA caching allocator at `cap_gib`; returns the fraction (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def run_qshard(argv: list[str]) -> None:
    """`python -m qshard ARGV` in this process, so that the cap set here applies to it."""
    saved = sys.argv
    sys.argv = ["qshard", *argv]
    try:
        runpy.run_module("qshard", run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # the CLI exits with its status
        if exc.code not in (0, None):
            raise SystemExit(f"qshard train failed with status {exc.code}") from None
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / f"data-{args.seq}.jsonl"
    if not data.exists():
        subprocess.run([sys.executable, str(HERE / "make_data.py"), "--out", str(data), "--tokens", str(args.seq),
                        "--examples", str(max(16, args.steps * args.batch * args.grad_accum))], check=True)
    fraction = cap_gpu_memory(args.cap_gib)
    run_dir = args.out / "run"
    argv_q = qshard_argv(args, data, run_dir)
    start = time.perf_counter()
    run_qshard(argv_q)
    wall = time.perf_counter() - start

    import torch

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    timed = steps[args.warmup:]
    result = {
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        "cap_gib": args.cap_gib if fraction is not None else None,
        "memory_fraction": fraction,
        "steps_timed": len(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in steps],
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if fraction is not None else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if fraction is not None else None,
        "peak_cpu_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
        "wall_s": wall,
        "command": shlex.join(["python", "-m", "qshard", *argv_q]),
        "device": torch.cuda.get_device_name(0) if fraction is not None else "cpu",
        "torch": torch.__version__,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    gpu = (f"{result['peak_gpu_allocated_gib']:.2f} GiB allocated / {result['peak_gpu_reserved_gib']:.2f} GiB reserved"
           if fraction is not None else "no GPU")
    print(f"{args.shape} seq {args.seq} x batch {args.batch}: {result['tokens_per_s']:,.0f} tok/s "
          f"(median step {result['median_step_s']:.2f} s over {len(timed)} steps) | peak GPU {gpu} "
          f"(cap {args.cap_gib:g} GiB) | peak CPU RSS {result['peak_cpu_rss_gib']:.2f} GiB")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
