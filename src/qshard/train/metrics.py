"""What a run reports: metrics.jsonl (one object per optimizer step), a live bar or plain lines."""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

log = logging.getLogger("qshard")


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsLog:
    """Appends one JSON object per line; flushed each write so a reader can follow the run live."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a") if path is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise; silent on every rank but the first."""

    def __init__(self, total_steps: int, enabled: bool, log_every: int) -> None:
        self.enabled, self.log_every, self.total = enabled, log_every, total_steps
        self.bar = None

    def start(self, start_step: int) -> None:
        """Open the bar (on a terminal) at `start_step`: a resumed run's ETA counts only what is left."""
        if self.enabled and sys.stderr.isatty():
            self.bar = tqdm(total=self.total, initial=start_step, desc="train", dynamic_ncols=True)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        fields = f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | {record['peak_mem_gib']:.2f} GiB"
        evaluated = "eval_loss" in record
        if evaluated:  # the steps that evaluated show the held-out numbers, whatever log_every says
            held_out = f"held-out loss {record['eval_loss']:.4f} (perplexity {record['eval_ppl']:.2f})"
            fields += f" | {held_out}"
        if self.bar is not None:
            self.bar.set_postfix_str(fields, refresh=False)
            if evaluated:  # a line of its own: the bar's postfix is overwritten at the next step
                self.bar.write(f"step {record['step']}: {held_out}")
            self.bar.update(1)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total or evaluated:
            log.info(
                "step %d/%d | %s | lr %.3g | grad_norm %.3f",
                record["step"], self.total, fields, record["lr"], record["grad_norm"],
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
