"""Long context on one GPU: 8B-shaped QLoRA at growing sequence lengths, with and without activation offload
and the sequence-tiled MLP, under a GPU memory cap (80 GiB by default): tok/s, peak GPU memory, peak host RSS.

  python benchmarks/long_context.py --out DIR [--seqs 32768,65536,131072,262144,350208] [--max]
        [--variants plain,offload,tiled,offload_tiled,offload_tiled_kept] [--tile 8192] [--cap-gib 80]
        [--steps 2] [--warmup 1]
        [--shape llama3-8b] [--timeout-s 1800] [--section.key VALUE ...]
  python benchmarks/long_context.py --out DIR --dry-run    # llama-tiny, two short sequences, on any machine

Every (sequence, variant) runs in a process of its own (this script again, with --child), so an out-of-memory
error, or the kernel killing a process that outgrew the host's memory, ends that run only; its status says
which. Results go to DIR/result.json after each run (a sweep cut short keeps what finished), added to the
runs an earlier invocation left there, so a sweep can be split over several commands (one sequence each).
With --max, the longest sequence the last variant trains is then searched for, in multiples of --max-step
tokens, between the longest that ran and the shortest that did not (or twice the longest, if all ran).

The model: random weights of the named shape (no checkpoint, so no position limit applies), NF4 base, LoRA
r=64 alpha 16 on every block linear, batch 1, activation checkpointing on every block (benchmarks/
step_phases.py's trainer); extra `--section.key VALUE` options go to every run. The variants:
  plain          the defaults, but parallel.activation_offload false (its auto is on from 8,192 tokens)
  offload        parallel.activation_offload true (what the blocks keep for backward, in pinned host memory)
  tiled          parallel.mlp_tile_tokens --tile, activation offload off
  offload_tiled  both
  offload_tiled_kept  both, and parallel.ac_keep_attention true (the recompute takes the forward's attention)
The cap is torch.cuda.set_per_process_memory_fraction(cap / total) before anything is allocated, so the
caching allocator fails past it as a card of that size would. tok/s: sequence length over the median step
time after --warmup steps (optimizer step included). Peak GPU memory: max_memory_allocated and
max_memory_reserved over the whole run (loading included). Peak host memory: the process's ru_maxrss (page-
locked offload buffers included). `host_offload` is activation offload's own log line (bytes per token).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "plain": ["--parallel.activation_offload", "false"],
    "offload": ["--parallel.activation_offload", "true"],
    "tiled": ["--parallel.activation_offload", "false", "--parallel.mlp_tile_tokens", "{tile}"],
    "offload_tiled": ["--parallel.activation_offload", "true", "--parallel.mlp_tile_tokens", "{tile}"],
    "offload_tiled_kept": ["--parallel.activation_offload", "true", "--parallel.mlp_tile_tokens", "{tile}",
                           "--parallel.ac_keep_attention", "true"],
}
GiB = 2**30


def _options(variant: str, tile: int) -> list[str]:
    return [o.format(tile=tile) for o in VARIANTS[variant]]


# ------------------------------------------------------------------------------------------------ one run


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def child(args: argparse.Namespace, extra: list[str]) -> dict:
    """One run in this process: build, warm up, time; the record (status ok or oom)."""
    import torch
    from step_phases import build_trainer

    if torch.cuda.is_available() and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    lines = _Lines()
    logger = logging.getLogger("qshard")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    record = {"seq": args.seq, "variant": args.variant, "options": extra}
    try:
        trainer = build_trainer(args, extra, args.warmup + args.steps)
        for step in range(args.warmup):
            trainer.step(step)
        times = [trainer.step(args.warmup + i)["step_time_s"] for i in range(args.steps)]
        record.update(status="ok", step_s=round(statistics.median(times), 3),
                      tok_s=round(args.seq / statistics.median(times), 1))
    except torch.OutOfMemoryError as exc:
        record.update(status="oom", error=str(exc).splitlines()[0][:300])
    if torch.cuda.is_available():
        record.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                      peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2))
    record["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 2)
    record["host_offload"] = next((line for line in lines.lines if line.startswith("activation offload:")), None)
    return record


# ------------------------------------------------------------------------------------------------ the sweep


def _run(args: argparse.Namespace, extra: list[str], seq: int, variant: str) -> dict:
    command = [sys.executable, __file__, "--child", "--seq", str(seq), "--variant", variant, "--shape", args.shape,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--cap-gib", str(args.cap_gib),
               *_options(variant, args.tile), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"seq": seq, "variant": variant, "status": "timeout", "wall_s": args.timeout_s}
    wall = round(time.perf_counter() - started, 1)
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    if proc.returncode == 0 and last:
        return {**json.loads(last[0]), "wall_s": wall}
    status = f"killed (signal {-proc.returncode}; host memory?)" if proc.returncode < 0 else "failed"
    return {"seq": seq, "variant": variant, "status": status, "wall_s": wall,
            "stderr_tail": proc.stderr.strip().splitlines()[-5:]}


def _save(out: Path, args: argparse.Namespace, results: list[dict]) -> None:
    meta = {k: v for k, v in vars(args).items() if k not in ("out", "child")}
    (out / "result.json").write_text(json.dumps({"args": meta, "runs": results}, indent=1))


def _search_max(args, extra, results, run) -> None:
    """The longest sequence (a multiple of --max-step) the last variant trains, by bisection."""
    variant = args.variants[-1]
    ok = [r["seq"] for r in results if r["variant"] == variant and r["status"] == "ok"]
    bad = [r["seq"] for r in results if r["variant"] == variant and r["status"] != "ok"]
    low = max(ok, default=0)
    high = min((s for s in bad if s > low), default=2 * low or args.max_step)
    for _ in range(args.max_probes):
        mid = (low + high) // 2 // args.max_step * args.max_step
        if mid <= low or mid >= high:
            break
        if run(mid, variant)["status"] == "ok":
            low = mid
        else:
            high = mid
    print(f"longest {variant}: {low} tokens", flush=True)


def sweep(args: argparse.Namespace, extra: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Runs of earlier invocations into the same DIR are kept: a sweep can be split over several commands.
    saved = out / "result.json"
    results: list[dict] = json.loads(saved.read_text())["runs"] if saved.is_file() else []

    def run(seq: int, variant: str) -> dict:
        record = _run(args, extra, seq, variant)
        results.append(record)
        _save(out, args, results)
        shown = {k: record.get(k) for k in ("status", "tok_s", "peak_allocated_gib", "peak_host_rss_gib")}
        print(f"seq {seq:>7} {variant:<14} {shown}", flush=True)
        return record

    for seq in args.seqs:
        for variant in args.variants:
            run(seq, variant)
    if args.max:
        _search_max(args, extra, results, run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")],
                   default=[32768, 65536, 131072, 262144, 350208])
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--tile", type=int, default=8192)
    p.add_argument("--cap-gib", type=float, default=80.0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--max", action="store_true")
    p.add_argument("--max-step", type=int, default=16384)
    p.add_argument("--max-probes", type=int, default=5)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--seq", type=int)
    p.add_argument("--variant")
    args, extra = p.parse_known_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})")
    if args.child:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(json.dumps(child(args, extra)), flush=True)
        return
    if not args.out:
        p.error("--out DIR is required")
    if args.dry_run:
        args.shape, args.seqs, args.tile, args.steps, args.warmup = "llama-tiny", [64, 128], 16, 1, 1
        args.max_step, args.max_probes = 64, 2
    sweep(args, extra)


if __name__ == "__main__":
    main()
