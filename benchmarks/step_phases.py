"""Where a training step's time goes: each phase timed twice, when the host has issued it and when the GPU
has finished it, plus the GPU's busy time and the host time inside FSDP2's hooks (torch profiler).

  python3 benchmarks/step_phases.py --shape llama3-8b [--seq 2048] [--steps 4] [--top-kernels 25] [--section.key V ...]

A phase whose host time is close to its wall time is bound by the host (Python, dispatch, kernel launches);
one whose wall time is much longer waits for the GPU. The whole step is timed the same way: the host time to
queue it (`step_issue_host_s`) against its time to the end (`step_s`). Random weights (`model.shape`) and
random tokens: nothing is read from disk. One JSON line at the end. `auto` settings are settled as `qshard train`
settles them on this machine (`build_trainer`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from qshard import config as config_mod
from qshard.build import build_model
from qshard.data import IGNORE_INDEX, Example
from qshard.data.preference import Pair
from qshard.parallel.distributed import init_distributed
from qshard.planner.command import preflight, this_machine
from qshard.train.loop import Trainer
from qshard.train.optim import clip_grad_norm


def _examples(n: int, seq: int) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [Example(ids := torch.randint(3, 250, (seq,), generator=g).tolist(), ids) for _ in range(n)]


def _pairs(n: int, seq: int, kto: bool = False) -> list[Pair]:
    """Preference pairs of `seq` tokens a row: a prompt of half of them (not trained), the same in both rows, and
    two completions; for KTO, examples of one such row, desirable and undesirable in turn (the other row of the
    pair empty)."""
    g = torch.Generator().manual_seed(0)
    prompt = seq // 2
    pairs = []
    for i in range(n):
        shared = torch.randint(3, 250, (prompt,), generator=g).tolist()
        rows = [Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:])
                for ids in (shared + torch.randint(3, 250, (seq - prompt,), generator=g).tolist() for _ in range(2))]
        if kto:
            rows[1 - i % 2] = Example([], [])
        pairs.append(Pair(*rows))
    return pairs


def device_batch(trainer: Trainer, step: int) -> dict[str, torch.Tensor]:
    """The first micro-batch of global batch `step`, collated and on the device as the trainer's step sends it."""
    return trainer._to_device(trainer._collate(trainer.sampler.microbatches(step)[0]))


def run_phases(trainer: Trainer, step: int, measure) -> None:
    """The training step of train/loop.py, phase by phase, each run as `measure(name, fn)`. The "optimizer" phase
    times the blocking step (`optimizer.step()` through the loss scaler), also under
    parallel.overlap_host_optimizer, whose overlapped update has no phase of its own (it runs under the next
    forward): its effect shows in the trainer's step time (benchmarks/offload_70b.py)."""
    batch = device_batch(trainer, step)
    loss = measure("forward", lambda: trainer.loss_sum(trainer.model, batch))
    measure("backward", lambda: (loss / batch["input_ids"].numel()).backward())
    measure("clip", lambda: (trainer.scaler.unscale_(trainer.optimizer),
                             clip_grad_norm(trainer.params, trainer.cfg.optim.max_grad_norm, trainer.grad_norm)))
    measure("optimizer", lambda: (trainer.scaler.step(trainer.optimizer), trainer.scaler.update()))
    measure("zero_grad", lambda: trainer.optimizer.zero_grad(set_to_none=True))


def _phases(trainer: Trainer, step: int) -> dict[str, tuple[float, float]]:
    """(host seconds, wall seconds) of each phase."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = {}

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        sync()
        out[name] = (t1 - t0, time.perf_counter() - t0)
        return result

    run_phases(trainer, step, timed)
    return out


def build_trainer(args: argparse.Namespace, extra: list[str], examples: int) -> Trainer:
    """The benchmarks' trainer: the named shape with random weights, LoRA r=64, batch 1, `examples` random
    examples of `args.seq` tokens (pairs of two such rows under a preference `--train.objective`), and any
    `--section.key VALUE` options in `extra`. Settled before the build as `qshard train` settles it on this
    machine (on a GPU: `parallel.ac_save_projections: auto`, from the planner's prediction, under any memory cap
    already set)."""
    overrides = [("model.shape", args.shape), ("data.max_length", str(args.seq)), ("lora.rank", "64"),
                 ("lora.alpha", "16"), ("train.micro_batch_size", "1")]
    overrides += [(extra[i][2:], extra[i + 1]) for i in range(0, len(extra), 2)]
    cfg = config_mod.resolve(None, overrides)
    env = init_distributed()
    preflight(cfg, this_machine(env.device, env.world_size), None, None, auto_fit=False, is_main=env.is_main)
    model, _ = build_model(cfg, env, None)
    objective = cfg.train.objective
    data = _examples(examples, args.seq) if objective == "sft" else _pairs(examples, args.seq, objective == "kto")
    return Trainer(cfg, env, model, data, [], 0)


_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _gpu_idle(prof, min_gap_us: float = 10.0, max_launch_latency_us: float = 40.0, top: int = 12) -> dict:
    """Where the GPU waits in the profiled step: the time from the step's start on the host to its first
    kernel, the idle time between its kernels, and, for each gap of at least `min_gap_us`, the host ops
    that were running when the kernel after it was launched, if it was launched at most
    `max_launch_latency_us` before it started (the host was the bound), or else the kernels on either side
    (queued in time, the GPU waited on something else: another stream, a launch of its own cost)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    gpu = sorted((e for e in trace if e.get("cat") in _GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return {}
    launches = {e["args"]["correlation"]: e for e in trace
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = [e for e in trace if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    step_start = min(e["ts"] for e in ops) if ops else gpu[0]["ts"]
    by_cause: dict[str, float] = defaultdict(float)
    early: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gaps, small, prev = [], 0.0, gpu[0]
    busy_end, busy = gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["dur"]
    for e in gpu[1:]:
        gap = e["ts"] - busy_end
        busy += max(0.0, e["ts"] + e["dur"] - max(busy_end, e["ts"]))
        if gap >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            lead = e["ts"] - (launch["ts"] + launch.get("dur", 0)) if launch is not None else None
            if lead is not None and lead <= max_launch_latency_us:
                t, tid = launch["ts"], launch["tid"]
                stack = sorted((o for o in ops if o["tid"] == tid and o["ts"] <= t <= o["ts"] + o["dur"]),
                               key=lambda o: o["ts"])
                by_cause[" > ".join(o["name"][:60] for o in stack[:3]) or "(no op)"] += gap
            else:  # queued in time, yet the GPU waited: name the kernels on either side and the stream
                key = f"{prev['name'][:50]} -> {e['name'][:50]} (stream {e.get('args', {}).get('stream')})"
                early[key][0] += gap
                early[key][1] += 1
            gaps.append(gap)
        elif gap > 0:
            small += gap
        if e["ts"] + e["dur"] > busy_end:
            busy_end, prev = e["ts"] + e["dur"], e
    total = busy_end - gpu[0]["ts"]
    return {
        "host_start_to_first_kernel_ms": round((gpu[0]["ts"] - step_start) / 1e3, 2),
        "first_to_last_kernel_ms": round(total / 1e3, 2),
        "busy_union_ms": round(busy / 1e3, 2),
        "gaps_over_min_ms": round(sum(gaps) / 1e3, 2),
        "gaps_over_min": len(gaps),
        "min_gap_us": min_gap_us,
        "gaps_under_min_ms": round(small / 1e3, 2),
        "late_launch_idle_by_host_ops_ms": {k: round(v / 1e3, 2) for k, v in
                                            sorted(by_cause.items(), key=lambda kv: -kv[1])[:top]},
        "early_launch_idle_ms_count": {k: [round(v[0] / 1e3, 2), v[1]] for k, v in
                                       sorted(early.items(), key=lambda kv: -kv[1][0])[:top]},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top-kernels", type=int, default=25, help="how many of the profiled step's kernels to list")
    args, extra = p.parse_known_args()
    trainer = build_trainer(args, extra, args.warmup + 2 * args.steps + 2)
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
    # The phases split the token objective's step (run_phases); a preference step is timed whole only.
    for i in range(args.steps if trainer.cfg.train.objective == "sft" else 0):
        for name, times in _phases(trainer, args.warmup + args.steps + i).items():
            phases[name].append(times)

    # One step under the profiler: GPU busy time (sum of kernel times; streams may overlap) and the host time
    # of FSDP2's own hooks (its record_function ranges, "FSDP::...").
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainer.step(args.warmup + 2 * args.steps)
    idle = _gpu_idle(prof) if torch.cuda.is_available() else None
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
        "step_times_s": [round(t, 4) for t in whole],
        "step_issue_host_s": round(statistics.median(issued), 4),
        "phases_host_wall_s": {k: [round(statistics.median(h for h, _ in v), 4),
                                   round(statistics.median(w for _, w in v), 4)] for k, v in phases.items()},
        "profiled_step_gpu_busy_ms": round(gpu_ms, 1),
        "profiled_step_kernels": kernels,
        "fsdp_hooks_host_ms": {k: round(v, 1) for k, v in sorted(fsdp.items(), key=lambda kv: -kv[1])},
        "fsdp_hooks_total_ms": round(sum(fsdp.values()), 1),
        "profiled_step_gpu_idle": idle,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
        else None,
        "top_kernels_ms_count": {e.key[:140]: [round(e.self_device_time_total / 1e3, 2), e.count]
                                 for e in sorted((e for e in events if e.device_type.name == "CUDA"),
                                                 key=lambda e: -e.self_device_time_total)[:args.top_kernels]},
        "top_host_ops_ms": {e.key: round(e.self_cpu_time_total / 1e3, 1)
                            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
