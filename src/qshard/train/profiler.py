"""train.profile_steps: a torch profiler trace (Chrome/Perfetto JSON, with shapes and Python stacks) of a range
of steps and, on CUDA, a snapshot of the allocator's history over the same steps, written by rank 0 into
OUTPUT/profile/. Open the trace in https://ui.perfetto.dev and the snapshot in https://pytorch.org/memory_viz."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from qshard.config import Config
from qshard.errors import QShardError
from qshard.parallel.distributed import DistEnv
from qshard.rundir import write_atomic, writing

log = logging.getLogger("qshard")

TRACE_FILE = "trace.json"
MEMORY_FILE = "memory_snapshot.pickle"
# Allocator events kept for the memory snapshot (older ones are dropped): enough for a few steps of a large model.
MEMORY_EVENTS = 100_000


def check_profile_steps(profile_steps: list[int] | None, total_steps: int) -> None:
    """The range must lie within the run, known once the data is read (before the model is loaded)."""
    if profile_steps is not None and profile_steps[1] > total_steps:
        raise QShardError(f"train.profile_steps: {profile_steps} reaches past the run's last step ({total_steps})")


def profiled(fit_step: Callable, cfg: Config, env: DistEnv) -> Callable:
    """`fit_step(step, ...)` (0-based step), profiled over train.profile_steps on rank 0; unchanged where
    nothing is profiled, so that a run without profiling pays nothing per step."""
    steps = cfg.train.profile_steps
    if steps is None or not env.is_main:
        return fit_step
    return StepProfiler(steps[0], steps[1], Path(cfg.output.dir) / "profile", env.device).wrap(fit_step)


class StepProfiler:
    """Starts the profiler before step `first` (1-based), labels each step `ProfilerStep#N` as torch's own
    schedule does, and writes the files after step `last`. A run resumed past `first` profiles what is left."""

    def __init__(self, first: int, last: int, out_dir: Path, device: torch.device) -> None:
        self.first, self.last, self.out_dir = first, last, out_dir
        self.cuda = device.type == "cuda"
        self.prof: profile | None = None

    def wrap(self, fit_step: Callable) -> Callable:
        @functools.wraps(fit_step)
        def step(index: int, *args, **kwargs):
            number = index + 1
            if not self.first <= number <= self.last:
                return fit_step(index, *args, **kwargs)
            if self.prof is None:
                self._start()
            try:
                with record_function(f"ProfilerStep#{number}"):
                    result = fit_step(index, *args, **kwargs)
            except BaseException:
                self._stop(write=False)
                raise
            if number == self.last:
                self._stop(write=True)
            return result

        return step

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        with warnings.catch_warnings():
            # The trace is one cycle, written whole: torch's notice that cycles clear their events is moot.
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            self.prof = profile(activities=activities, record_shapes=True, with_stack=True)
            self.prof.start()

    def _stop(self, write: bool) -> None:
        prof, self.prof = self.prof, None
        if prof is None:
            return
        prof.stop()
        if write:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            trace = self.out_dir / TRACE_FILE
            with writing(trace):
                write_atomic(trace, lambda tmp: prof.export_chrome_trace(str(tmp)))
            if self.cuda:
                snapshot = self.out_dir / MEMORY_FILE
                with writing(snapshot):
                    write_atomic(snapshot, lambda tmp: torch.cuda.memory._dump_snapshot(str(tmp)))
            log.info("profile of steps %d-%d written to %s (open %s in https://ui.perfetto.dev%s)", self.first,
                     self.last, self.out_dir, TRACE_FILE,
                     f", {MEMORY_FILE} in https://pytorch.org/memory_viz" if self.cuda else "")
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
