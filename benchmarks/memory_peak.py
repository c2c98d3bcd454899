"""Where a training step's peak GPU memory comes from: the peak of each phase, the bytes kept for backward,
and the allocations live at the step's peak grouped by the line of code that made them.

  python3 benchmarks/memory_peak.py --shape llama3-8b [--seq 2048] [--warmup 3] [--section.key V ...]

Random weights (`model.shape`) and random tokens, like step_phases.py; with a preference `--train.objective`,
pairs of two `--seq` rows (half prompt) and only the allocator history. After the warm-up steps, one step runs
phase by phase (forward, backward, clip, optimizer, zero_grad) with the peak reset before each; a second step
runs under torch's allocator history (torch.cuda.memory._record_memory_history), which is replayed here to
find the moment of the peak and what was live then. Allocations made before that step (weights, optimizer
state) have no history and are reported as one `before the step` figure. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import linecache
from collections import defaultdict

import torch
from step_phases import build_trainer, device_batch, run_phases

from qshard.train.loop import Trainer

GiB = 2**30


def _phase_peaks(trainer: Trainer, step: int) -> dict[str, float]:
    """Each phase's own peak above what was live before the step, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = {}

    def peak(name, fn):
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        out[name] = round((torch.cuda.max_memory_allocated() - base) / GiB, 3)
        return result

    run_phases(trainer, step, peak)
    return out


def _kept_for_backward(trainer: Trainer, step: int) -> float:
    """GiB that autograd keeps from one forward for backward, parameters and their views not counted."""
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    kept = 0

    def pack(t):
        nonlocal kept
        if t.device.type == "cuda" and t.untyped_storage().data_ptr() not in params:
            kept += t.numel() * t.element_size()
        return t

    batch = device_batch(trainer, step)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.loss_sum(trainer.model, batch)
    loss.backward()  # frees what was kept (dropping `loss` alone left it alive); the gradients go with zero_grad
    trainer.optimizer.zero_grad(set_to_none=True)
    return round(kept / GiB, 3)


def _where(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (compiled graphs' wrappers count as outside)."""
    for f in frames:
        name = f["filename"]
        if "torchinductor" in name or ("/torch/" not in name and name.endswith(".py")):
            return f"{name.rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"].rsplit("/", 1)[-1] + ":" + frames[0]["name"] if frames else "?"


def _live_at_peak(trainer: Trainer, step: int, top: int) -> dict:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    trainer.step(step)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    live, total, peak, peak_at, peak_live = {}, 0, 0, 0, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e["frames"])
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        else:
            continue
        if total > peak:
            peak, peak_at, peak_live = total, i, dict(live)
    groups = defaultdict(lambda: [0, 0])
    code = {}  # compiled graphs' lines: the buffer and the kernel that fills it (what the allocation is)
    for size, frames in peak_live.values():
        where = _where(frames)
        g = groups[where]
        g[0] += 1
        g[1] += size
        frame = next((f for f in frames if "torchinductor" in f["filename"]), None)
        if frame is not None and where not in code:
            code[where] = [linecache.getline(frame["filename"], n).strip()[:160]
                           for n in range(frame["line"] - 2, frame["line"] + 4)]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "before_the_step_gib": round(before / GiB, 3),
        "peak_above_it_gib": round(peak / GiB, 3),
        "peak_at_event": [peak_at, len(events)],
        "live_at_peak_by_line": {k: [n, round(b / GiB, 4)] for k, (n, b) in ranked},
        "compiled_code_at_those_lines": {k: code[k] for k, _ in ranked if k in code},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    args, extra = p.parse_known_args()
    trainer = build_trainer(args, extra, args.warmup + 4)
    for step in range(args.warmup):
        trainer.step(step)
    result = {"shape": args.shape, "seq": args.seq, "overrides": extra,
              "run_peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 3)}
    if trainer.cfg.train.objective == "sft":  # the phases are the token objective's (step_phases.run_phases)
        result["phase_peaks_above_start_gib"] = _phase_peaks(trainer, args.warmup)
        result["kept_for_backward_gib"] = _kept_for_backward(trainer, args.warmup + 1)
    torch.cuda.synchronize()
    result.update(_live_at_peak(trainer, args.warmup + 2, args.top))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
