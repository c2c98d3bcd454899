"""Bytes all-gathered per training step, NF4 (qlora) against a bf16 base (lora), measured, not estimated.

  python3 benchmarks/allgather_bytes.py (--model DIR | --shape llama3-8b) [--nproc N] [--seq 2048]
      [--runs lora,qlora:fsdp,qlora:dtensor] [--json OUT] [--section.key VALUE ...]
  torchrun --nproc_per_node N benchmarks/allgather_bytes.py ...   (the same, one process per GPU)

Each run builds the model as `qshard train` does (same model, same LoRA, random tokens), takes one
warm-up step, then one step under CommCounter (benchmarks/comm_stats.py), which records every collective
the step issues and charges each all-gathered byte to the tensor it carries. Without torchrun it starts
--nproc processes itself (gloo on CPU, NCCL on GPUs). Prints, on rank 0, one row per run and the ratios
to the lora run; `--json` writes the full per-run summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def parse() -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    p = argparse.ArgumentParser()
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory")
    src.add_argument("--shape", help="a named shape (random weights), e.g. llama3-8b")
    p.add_argument("--nproc", type=int, default=0, help="processes to start (default: GPUs, or 2 on CPU)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--runs", default="lora,qlora:fsdp,qlora:dtensor",
                   help="train_type[:quant_sharding], comma-separated; the first lora run is the reference")
    p.add_argument("--json", help="write the per-run summaries here")
    args, extra = p.parse_known_args()
    if len(extra) % 2 or not all(e.startswith("--") for e in extra[::2]):
        p.error(f"extra options must be --section.key VALUE pairs: {extra}")
    overrides = [(extra[i][2:], extra[i + 1]) for i in range(0, len(extra), 2)]
    return args, overrides


def worker(rank: int, world: int, port: int, args: argparse.Namespace, overrides: list[tuple[str, str]]) -> None:
    if port:  # started here, not by torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
    from comm_stats import measure_train_step

    from qshard import config as config_mod
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    source = [("model.path", args.model)] if args.model else [("model.shape", args.shape)]
    results = []
    for run in args.runs.split(","):
        train_type, _, how = run.partition(":")
        cfg = config_mod.resolve(None, [
            *source, ("train.train_type", train_type), ("parallel.quant_sharding", how or "fsdp"),
            ("train.micro_batch_size", str(args.batch)), ("train.grad_accum", "1"),
            ("data.max_length", str(args.seq)), ("lora.rank", str(args.lora_rank)), *overrides,
        ])
        summary = measure_train_step(cfg, env, args.model, seq=args.seq)
        results.append({"run": run, "world_size": env.world_size, **summary})
    if env.is_main:
        report(results, args)
    shutdown()


def gathered(r: dict, where: str | None = None, cat: str | None = None) -> int:
    from comm_stats import part_bytes

    return part_bytes(r, where, cat)


def report(results: list[dict], args: argparse.Namespace) -> None:
    ref = next((r for r in results if r["run"].startswith("lora")), None)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\nall-gather bytes per step: {args.model or args.shape}, {results[0]['world_size']} ranks ({device}), "
          f"seq {args.seq}, batch {args.batch}/rank, LoRA r={args.lora_rank}; MiB per rank")
    print("| run | all-gathers | total | blocks | block base | block base dtypes | block LoRA | rest "
          "| total vs lora | blocks vs lora | block base vs lora | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        total = sum(r["bytes"].get("all_gather", {}).values())
        blocks, base = gathered(r, "blocks"), gathered(r, "blocks", "base")
        dtypes = sorted({k.split("/")[2] for k in r["all_gather_parts"] if k.startswith("blocks/base/")})
        r["ratios"] = {}
        if ref is not None:
            r["ratios"] = {"total": total / sum(ref["bytes"]["all_gather"].values()),
                           "blocks": blocks / gathered(ref, "blocks"),
                           "block_base": base / gathered(ref, "blocks", "base")}
        ratio = [f"{r['ratios'][k]:.3f}" if r["ratios"] else "-" for k in ("total", "blocks", "block_base")]
        mib = [f"{b / 2**20:,.1f}" for b in (total, blocks, base, gathered(r, "blocks", "lora"), gathered(r, "rest"))]
        print(f"| {r['run']} | {r['calls'].get('all_gather', 0)} | {' | '.join(mib[:3])} | {','.join(dtypes)} | "
              f"{' | '.join(mib[3:])} | {' | '.join(ratio)} | {r['loss']:.4f} |")
    unattributed = sum(gathered(r, cat="<unattributed>") for r in results)
    if unattributed:
        print(f"warning: {unattributed} all-gathered bytes could not be traced to a tensor (this torch's FSDP2 "
              "fills its buffers differently); totals are still measured", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "seq": args.seq, "batch": args.batch, "lora_rank": args.lora_rank,
                       "source": args.model or args.shape, "torch": torch.__version__, "results": results}, f, indent=1)


def main() -> None:
    args, overrides = parse()
    if "RANK" in os.environ:  # under torchrun (or srun with the variables set): this process is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args, overrides)
        return
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(nproc, port, args, overrides), nprocs=nproc, join=True)


if __name__ == "__main__":
    main()
