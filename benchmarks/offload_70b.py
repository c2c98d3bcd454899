"""70B-shaped QLoRA with CPU offload under a per-GPU memory cap (24 GiB by default), on one GPU or several:
tok/s, peak GPU memory, peak CPU RSS.

  python benchmarks/offload_70b.py --out DIR [--cap-gib 24] [--seq 2048] [--steps 6] [--warmup 2]
                                   [--nproc N] [--no-offload] [--quant-sharding dtensor] [--qshard-args "..."]
  python benchmarks/offload_70b.py --out DIR --dry-run [--nproc 2]   # llama-tiny, a few short steps, on any machine

One GPU (`--nproc 1`, the default): the cap is applied in this process with
torch.cuda.set_per_process_memory_fraction(cap / total) before qshard allocates anything, then `qshard train`
runs in the same process (runpy, one rank), so every allocation the run makes is under the cap: the caching
allocator raises out-of-memory past it, as a 24 GiB card would.

Several GPUs (`--nproc N`, N > 1): this process writes the data, then starts N worker processes through
torch's elastic launcher (torch.distributed.launcher.api.elastic_launch, what torchrun runs on one node with a
free port), each `python offload_70b.py SAME OPTIONS --worker`; the options go to the workers untouched, where
torchrun's own parser would take `--nproc` for an abbreviation of its `--nproc-per-node`. Each worker selects
the GPU of its LOCAL_RANK, caps its own process on that GPU the same way, and runs `qshard train` in-process
(qshard sees LOCAL_RANK and joins the launcher's process group instead of launching again): one FSDP2 rank per
GPU, every rank under the cap. Each worker then writes OUT/rank{r}.json (its peak GPU memory on its device,
its peak CPU RSS); this process gathers them into result.json. If any worker fails, this process says which
ranks gave no record and exits non-zero.

The model: random weights of the llama3-70b shape (no checkpoint), LoRA r=64 alpha 16 on every block linear,
NF4 base, activation checkpointing, `parallel.cpu_offload true` (LoRA, gradients and AdamW state on the CPU
through FSDP2; the NF4 storage in pinned host memory, a block or two on the GPU at a time); `--no-offload`
sets it false, to see whether the sharded model fits the cap on its own. `--quant-sharding dtensor` by
default: the storage stays DTensor buffers, offloaded by parallel/offload.py, which measured faster on one
GPU (535 against 442 tok/s on an H200); with `fsdp` the storage is inside FSDP2 and offloaded by FSDP2's
CPUOffloadPolicy, faster on two GPUs (554 against 381 tok/s per GPU). docs/benchmarks.md has both.

tok/s is the median over the steps after `--warmup` (from metrics.jsonl: input tokens / step time, optimizer
step included). qshard sums the step's input tokens over all ranks before dividing (train/loop.py), so with
N GPUs it is the whole run's throughput; result.json also gives it per GPU. Peak GPU memory is torch's
max_memory_allocated (and max_memory_reserved, what the cap bounds) over the whole run, loading included,
per rank on that rank's device, with the allocator's num_alloc_retries and num_ooms (a retry frees the cached
blocks and synchronizes: a cap too tight for the run shows there before it fails); peak CPU RSS is each
process's ru_maxrss, and their sum (an upper bound on the machine's peak: the ranks need not peak at the same
moment) is the CPU RAM of the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap for each process, GiB")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (one process each, through torch's launcher)")
    p.add_argument("--no-offload", action="store_true", help="parallel.cpu_offload false: all of it on the GPUs")
    p.add_argument("--quant-sharding", default="dtensor", choices=["fsdp", "dtensor"])
    p.add_argument("--qshard-args", default="", help="extra options for qshard train (e.g. '--parallel.compile true')")
    p.add_argument("--dry-run", action="store_true", help="llama-tiny, seq 64, 3 steps: checks the script anywhere")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, started by the launcher
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.seq, args.steps, args.warmup = "llama-tiny", 64, 3, 1
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    if args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    return args


def qshard_argv(args: argparse.Namespace, data: Path, run_dir: Path) -> list[str]:
    return [
        "train", "--model.shape", args.shape, "--data", str(data), "--data.eval_fraction", "0",
        "--output-dir", str(run_dir), "--overwrite", "--max-length", str(args.seq),
        "--batch-size", str(args.batch), "--grad-accum", str(args.grad_accum), "--max-steps", str(args.steps),
        "--lora-rank", "64", "--lora.alpha", "16", "--optim.schedule", "constant", "--lr", "1e-4",
        "--parallel.cpu_offload", "false" if args.no_offload else "true",
        "--parallel.quant_sharding", args.quant_sharding,
        *shlex.split(args.qshard_args),
    ]


def cap_gpu_memory(cap_gib: float, device: int = 0) -> float | None:
    """Cap this process's CUDA caching allocator on `device` at `cap_gib`; returns the fraction (None without
    CUDA). `device` is made the current device first, so that nothing lands on another GPU by default."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
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


def peak_cpu_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def allocator_retries(device: int | None) -> dict:
    """How often torch's CUDA allocator, short of memory under the cap, freed its cached blocks and tried again
    (each retry synchronizes the device), and how often it still failed; None without CUDA."""
    import torch

    stats = torch.cuda.memory_stats(device) if device is not None else {}
    return {key: stats.get(key) if device is not None else None for key in ("num_alloc_retries", "num_ooms")}


def make_data(args: argparse.Namespace) -> Path:
    """The training data at the benchmark's sequence length: enough examples for every step's global batch."""
    data = args.out / f"data-{args.seq}.jsonl"
    needed = max(16, args.steps * args.batch * args.grad_accum * args.nproc)
    if not data.exists() or len(data.read_text().splitlines()) < needed:
        subprocess.run([sys.executable, str(HERE / "make_data.py"), "--out", str(data), "--tokens", str(args.seq),
                        "--examples", str(needed)], check=True)
    return data


def step_records(run_dir: Path, warmup: int) -> tuple[list[dict], list[dict]]:
    """All optimizer steps of metrics.jsonl, and those after the warm-up."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    return steps, steps[warmup:]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args)
    if args.nproc > 1:
        return launch(args, argv, data)
    fraction = cap_gpu_memory(args.cap_gib)
    run_dir = args.out / "run"
    argv_q = qshard_argv(args, data, run_dir)
    start = time.perf_counter()
    run_qshard(argv_q)
    wall = time.perf_counter() - start

    import torch

    steps, timed = step_records(run_dir, args.warmup)
    result = {
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        "nproc": 1,
        "cpu_offload": not args.no_offload,
        "cap_gib": args.cap_gib if fraction is not None else None,
        "memory_fraction": fraction,
        "steps_timed": len(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in steps],
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if fraction is not None else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if fraction is not None else None,
        **allocator_retries(0 if fraction is not None else None),
        "peak_cpu_rss_gib": peak_cpu_rss_gib(),
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


# ---------------------------------------------------------------------------------------------------------------
# Several GPUs: this process launches one worker per GPU and gathers what they report.


def worker(args: argparse.Namespace) -> dict:
    """One rank under the launcher: cap this rank's GPU, train in-process, write OUT/rank{RANK}.json."""
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("offload_70b.py: --worker is for the processes torch's launcher starts (no LOCAL_RANK)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    data = args.out / f"data-{args.seq}.jsonl"  # written by the launching process
    if not data.exists():
        raise SystemExit(f"offload_70b.py: rank {rank}: no data at {data}")
    fraction = cap_gpu_memory(args.cap_gib, local_rank)
    start = time.perf_counter()
    try:
        run_qshard(qshard_argv(args, data, args.out / "run"))
    except SystemExit as exc:
        raise SystemExit(f"offload_70b.py: rank {rank}: {exc.code}") from None
    wall = time.perf_counter() - start

    import torch

    cuda = fraction is not None
    record = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu",
        "memory_fraction": fraction,
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated(local_rank) / 2**30 if cuda else None,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(local_rank) / 2**30 if cuda else None,
        **allocator_retries(local_rank if cuda else None),
        "peak_cpu_rss_gib": peak_cpu_rss_gib(),
        "wall_s": wall,
        "torch": torch.__version__,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(record, indent=2))
    return record


def launch(args: argparse.Namespace, argv: list[str], data: Path) -> dict:
    """Run `args.nproc` workers through torch's elastic launcher, then gather their records into result.json."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for stale in args.out.glob("rank*.json"):
        stale.unlink()
    script = str(Path(__file__).resolve())
    worker_argv = [script, *argv, "--worker"]  # handed to each process as is: no launcher parses them
    # One thread per worker is what torchrun would set; the workers' CPU work (offloaded AdamW, the CPU side
    # of the gradients) wants its share of the cores instead. An OMP_NUM_THREADS already set is kept.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report a failure ourselves
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    failures: dict[int, int] = {}
    start = time.perf_counter()
    try:
        elastic_launch(config, sys.executable)(*worker_argv)
    except ChildFailedError as exc:
        failures = {rank: f.exitcode for rank, f in exc.failures.items()}
    wall = time.perf_counter() - start
    ranks = []
    for r in range(args.nproc):
        path = args.out / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    missing = [r for r, rec in enumerate(ranks) if rec is None]
    if failures or missing:
        codes = ", ".join(f"rank {r}: exit code {c}" for r, c in sorted(failures.items())) or "none exited non-zero"
        print(f"offload_70b.py: the {args.nproc}-process run failed ({codes}); rank(s) {missing or 'none'} "
              f"wrote no record; the workers' own errors are above. Worker command: "
              f"{shlex.join(['python', *worker_argv])}", file=sys.stderr)
        raise SystemExit(next((c for c in failures.values() if c and c > 0), 1))

    run_dir = args.out / "run"
    steps, timed = step_records(run_dir, args.warmup)
    cuda = ranks[0]["memory_fraction"] is not None
    allocated = [rec["peak_gpu_allocated_gib"] for rec in ranks]
    reserved = [rec["peak_gpu_reserved_gib"] for rec in ranks]
    rss = [rec["peak_cpu_rss_gib"] for rec in ranks]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)  # global: all ranks' tokens
    result = {
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        "nproc": args.nproc,
        "cpu_offload": not args.no_offload,
        "cap_gib": args.cap_gib if cuda else None,
        "memory_fraction": ranks[0]["memory_fraction"],
        "steps_timed": len(timed),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / args.nproc,
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in steps],
        "peak_gpu_allocated_gib": allocated,
        "peak_gpu_reserved_gib": reserved,
        "peak_gpu_allocated_gib_max": max(allocated) if cuda else None,
        "peak_gpu_reserved_gib_max": max(reserved) if cuda else None,
        "num_alloc_retries": [rec["num_alloc_retries"] for rec in ranks],
        "num_ooms": [rec["num_ooms"] for rec in ranks],
        "peak_cpu_rss_gib": rss,
        "peak_cpu_rss_gib_sum": sum(rss),
        "wall_s": wall,
        "command": shlex.join(["python", str(Path(__file__)), *argv]),
        "worker_command": shlex.join(["python", *worker_argv]),
        "qshard_command": shlex.join(["python", "-m", "qshard", *qshard_argv(args, data, run_dir)]),
        "ranks": ranks,
        "device": ranks[0]["device"],
        "torch": ranks[0]["torch"],
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    if cuda:
        per_rank = ", ".join(f"{a:.2f}/{r:.2f}" for a, r in zip(allocated, reserved))
        gpu = (f"allocated/reserved per rank {per_rank} GiB (max {max(allocated):.2f}/{max(reserved):.2f}; "
               f"cap {args.cap_gib:g} GiB each)")
    else:
        gpu = "no GPU"
    print(f"{args.shape} seq {args.seq} x batch {args.batch} x {args.nproc} GPUs "
          f"({'CPU offload' if not args.no_offload else 'no offload'}): {tokens_per_s:,.0f} tok/s, "
          f"{tokens_per_s / args.nproc:,.0f} per GPU (median step {result['median_step_s']:.2f} s over "
          f"{len(timed)} steps) | peak GPU {gpu} | peak CPU RSS per rank "
          f"{', '.join(f'{x:.2f}' for x in rss)} GiB, sum {sum(rss):.2f} GiB | wall {wall:.0f} s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
