"""What a run reports: metrics.jsonl (one object per optimizer step), a live bar or plain lines."""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from qshard.errors import QShardError
from qshard.quant.linear import QuantizedLinear
from qshard.rundir import writing

if TYPE_CHECKING:
    from qshard.train.trackers import Guarded

log = logging.getLogger("qshard")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def device_memory_gib(device: torch.device) -> float:
    """The device's whole memory; on CPU the machine's physical memory (what peak_memory_gib is a share of)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


# Dense bf16 tensor-core peak (FLOP/s) by a part of the device's name; the first match wins (PCIe before SXM).
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))


def peak_bf16_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak from PEAK_BF16_FLOPS; None for a device not in the table (no MFU then)."""
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in device_name), None)


def matmul_flops_per_token(model: torch.nn.Module) -> int:
    """FLOPs a token costs in one training step: 6 x the weights of every matmul it goes through (the blocks'
    linears and the output head, quantized or not; not the input embedding, attention scores or LoRA factors).
    6 = forward + its recomputation under activation checkpointing + the backward to the activations (the
    frozen base needs no weight gradients). Counted from the modules' shapes, which sharding leaves whole."""
    linears = (m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear)))
    return 6 * sum(m.in_features * m.out_features for m in linears)


def mfu_per_token_rate(model: torch.nn.Module, device: torch.device, world_size: int) -> float | None:
    """What multiplies a step's tokens/s (summed over ranks) into model FLOPs utilisation; None on CPU and on
    GPUs without a known peak, where no MFU is reported."""
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return matmul_flops_per_token(model) / (peak * world_size) if peak else None


class MetricsLog:
    """Appends one JSON object per line, each line in one write on an O_APPEND descriptor, so that a reader
    following the run live, or a crash, never sees half a line; a write that does not fit on the disk is
    taken back whole and becomes a QShardError naming the file. Each record then goes to the `trackers`
    (output.trackers, rank 0; none when off)."""

    def __init__(self, path: Path | None, samples_path: Path | None = None, trackers: Sequence[Guarded] = ()) -> None:
        self.path, self.samples_path, self.trackers = path, samples_path, trackers
        self._fd = _open_append(path)
        self._samples_fd = _open_append(samples_path)  # samples.jsonl, the same way

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is not None:
            with writing(self.path):
                _append_whole(self._fd, (json.dumps(record) + "\n").encode())
        for tracker in self.trackers:
            tracker.log_step(record)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The samples of `step` (rows of prompt and completion): to samples.jsonl, one line each, all in one
        write; then to the trackers, as a table."""
        if self._samples_fd is not None:
            lines = "".join(json.dumps({"step": step, **row}) + "\n" for row in rows)
            with writing(self.samples_path):
                _append_whole(self._samples_fd, lines.encode())
        for tracker in self.trackers:
            tracker.log_samples(step, rows)

    def close(self) -> None:
        for name in ("_fd", "_samples_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        for tracker in self.trackers:
            tracker.close()
        self.trackers = ()


def _open_append(path: Path | None) -> int | None:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    return os.open(path, flags, 0o644) if path is not None else None


def _append_whole(fd: int, line: bytes) -> None:
    """One write of the whole line; a short one (the disk filled mid-line) is finished or cut back off."""
    size = os.fstat(fd).st_size
    done = os.write(fd, line)
    try:
        while done < len(line):  # the next write says why the first one stopped short
            done += os.write(fd, line[done:])
    except OSError:
        os.ftruncate(fd, size)
        raise


def read_until(path: Path, step: int) -> list[str]:
    """The lines of metrics.jsonl for steps up to `step` (what a run resumed there keeps). A torn last line,
    from a write that never finished, is dropped with a warning; any other line that is not a step's
    record is a QShardError naming its file and line."""
    if not path.is_file():
        return []
    *lines, last = path.read_bytes().split(b"\n")
    if last and _record(last) is None:  # a whole line always ends in a newline
        log.warning("%s:%d: dropping a torn last line (a write that did not finish): %r",
                    path, len(lines) + 1, last[:60].decode(errors="replace"))
    elif last:
        lines.append(last)
    kept = []
    for number, line in enumerate(lines, start=1):
        record = _record(line)
        if record is None:
            raise QShardError(f"{path}:{number}: not a step's metrics record; repair or delete that line to resume")
        if record["step"] <= step:
            kept.append(line.decode())
    return kept


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # JSON errors and bytes that are not UTF-8
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int)
    return record if ok else None


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise; silent on every rank but the first."""

    def __init__(self, total_steps: int, enabled: bool, log_every: int, memory_total_gib: float) -> None:
        self.enabled, self.log_every, self.total = enabled, log_every, total_steps
        self.memory_total_gib = memory_total_gib
        self.recent = deque(maxlen=20)  # the last steps' times: their median, times the steps left, is the ETA
        self.bar = None

    def start(self, start_step: int) -> None:
        """Open the bar (on a terminal) at `start_step`: a resumed run's ETA counts only what is left."""
        if self.enabled and sys.stderr.isatty():
            self.bar = tqdm(total=self.total, initial=start_step, desc="train", dynamic_ncols=True)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.recent.append(record["step_time_s"])
        fields = f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s"
        if "rewards_margin" in record:  # a preference objective's
            fields += f" | margin {record['rewards_margin']:.3f}" + _accuracy(record, "")
        if "mfu" in record:
            fields += f" | MFU {record['mfu']:.1%}"
        memory = record["peak_mem_gib"]
        fields += f" | {memory:.2f} GiB ({memory / self.memory_total_gib:.0%})"
        evaluated = "eval_loss" in record
        if evaluated:  # the steps that evaluated show the held-out numbers, whatever log_every says
            held_out = f"held-out loss {record['eval_loss']:.4f}"
            ppl = f" (perplexity {record['eval_ppl']:.2f})" if "eval_ppl" in record else ""
            held_out += ppl or _accuracy(record, "eval_")
            fields += f" | {held_out}"
        if self.bar is not None:  # tqdm shows its own ETA
            self.bar.set_postfix_str(fields, refresh=False)
            if evaluated:  # a line of its own: the bar's postfix is overwritten at the next step
                self.bar.write(f"step {record['step']}: {held_out}")
            self.bar.update(1)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total or evaluated:
            eta = (self.total - record["step"]) * statistics.median(self.recent)
            log.info(
                "step %d/%d | %s | lr %.3g | grad_norm %.3f | ETA %s",
                record["step"], self.total, fields, record["lr"], record["grad_norm"], format_duration(eta),
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            log.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _accuracy(record: dict[str, Any], prefix: str) -> str:
    """A preference record's accuracy (` | acc 0.75`), where its method has one (KTO's unpaired data has none)."""
    key = f"{prefix}rewards_accuracy"
    return f" | {'held-out ' if prefix else ''}acc {record[key]:.2f}" if key in record else ""


def format_duration(seconds: float) -> str:
    """`1h02m03s`, `4m05s`, `6s`: a duration as the log line shows it."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
