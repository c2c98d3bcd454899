"""Where a training step's time goes: each phase timed twice, when the host has issued it and when the GPU
has finished it, plus the GPU's busy time and the host time inside FSDP2's hooks (torch profiler).

  python3 benchmarks/step_phases.py --shape llama3-8b [--seq 2048] [--steps 4] [--section.key V ...]

A phase whose host time is close to its wall time is bound by the host (Python, dispatch, kernel launches);
one whose wall time is much longer waits for the GPU. The whole step is timed the same way: the host time to
queue it (`step_issue_host_s`) against its time to the end (`step_s`). Random weights (`model.shape`) and
random tokens: nothing is read from disk. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from qshard import config as config_mod
from qshard.build import build_model
from qshard.data import Example
from qshard.parallel.distributed import init_distributed
from qshard.train.loop import Trainer
from qshard.train.optim import clip_grad_norm


def _examples(n: int, seq: int) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [Example(ids := torch.randint(3, 250, (seq,), generator=g).tolist(), ids) for _ in range(n)]


def _phases(trainer: Trainer, step: int) -> dict[str, tuple[float, float]]:
    """The training step of train/loop.py, phase by phase: (host seconds, wall seconds) for each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = {}
    batch = trainer._batch(trainer.sampler.microbatches(step)[0])

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        sync()
        out[name] = (t1 - t0, time.perf_counter() - t0)
        return result

    loss = timed("forward", lambda: trainer.loss_sum(trainer.model, batch))
    timed("backward", lambda: (loss / 2048).backward())
    timed("clip", lambda: (trainer.scaler.unscale_(trainer.optimizer),
                           clip_grad_norm(trainer.params, trainer.cfg.optim.max_grad_norm)))
    timed("optimizer", lambda: (trainer.scaler.step(trainer.optimizer), trainer.scaler.update()))
    timed("zero_grad", lambda: trainer.optimizer.zero_grad(set_to_none=True))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    args, extra = p.parse_known_args()
    overrides = [("model.shape", args.shape), ("data.max_length", str(args.seq)), ("lora.rank", "64"),
                 ("lora.alpha", "16"), ("train.micro_batch_size", "1")]
    overrides += [(extra[i][2:], extra[i + 1]) for i in range(0, len(extra), 2)]
    cfg = config_mod.resolve(None, overrides)
    env = init_distributed()
    model, _ = build_model(cfg, env, None)
    trainer = Trainer(cfg, env, model, _examples(args.warmup + 2 * args.steps + 2, args.seq), [], 0)
    for step in range(args.warmup):
        trainer.step(step)

    whole, issued = [], []
    for i in range(args.steps):
        # Host time to queue the whole step (Trainer.issue: nothing in it waits for the device), then its
        # record (the one wait). Issue time close to the step time means the host bounds the step.
        t0 = time.perf_counter()
        pending = trainer.issue(args.warmup + i)
        issued.append(time.perf_counter() - t0)
        whole.append(trainer.finish(pending)["step_time_s"])
    phases = defaultdict(list)
    for i in range(args.steps):
        for name, times in _phases(trainer, args.warmup + args.steps + i).items():
            phases[name].append(times)

    # One step under the profiler: GPU busy time (sum of kernel times; streams may overlap) and the host time
    # of FSDP2's own hooks (its record_function ranges, "FSDP::...").
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainer.step(args.warmup + 2 * args.steps)
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
    # Per hook kind, summed over the units ("FSDP::pre_forward (model.layers.3)", "FSDP::backward_prefetch for
    # model.layers.3").
    fsdp = defaultdict(float)
    for e in events:
        if e.key.startswith("FSDP::"):
            fsdp[e.key.split(" (")[0].split(" for ")[0]] += e.cpu_time_total / 1e3
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")

    result = {
        "shape": args.shape, "seq": args.seq, "overrides": extra,
        "step_s": round(statistics.median(whole), 4),
        "step_issue_host_s": round(statistics.median(issued), 4),
        "phases_host_wall_s": {k: [round(statistics.median(h for h, _ in v), 4),
                                   round(statistics.median(w for _, w in v), 4)] for k, v in phases.items()},
        "profiled_step_gpu_busy_ms": round(gpu_ms, 1),
        "profiled_step_kernels": kernels,
        "fsdp_hooks_host_ms": {k: round(v, 1) for k, v in sorted(fsdp.items(), key=lambda kv: -kv[1])},
        "fsdp_hooks_total_ms": round(sum(fsdp.values()), 1),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
        else None,
        "top_host_ops_ms": {e.key: round(e.self_cpu_time_total / 1e3, 1)
                            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
