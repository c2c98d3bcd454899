"""Shared fixtures: tiny random-weight models built on the spot (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import socket
import sys
import tempfile
import time
import typing
from pathlib import Path

import pytest

# Each test process (and each rank it spawns) uses one thread: two ranks spinning two OpenMP threads
# each on a two-core machine slow down by orders of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Measuring code shared with the benchmarks (comm_stats) lives there, outside the package. Appended: no
# benchmark module may shadow an installed one. Spawned ranks inherit this path.
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)


def cli_env() -> dict[str, str]:
    """Environment for running `python -m qshard` from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def nonzero_lora_b(model) -> None:
    """Give every LoRA B factor small random values: B starts at zero, which would hide A's gradient (and any wrong
    input of A's). For a model on one rank (an FSDP2 parameter's shard is then the whole), on any device."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "qshard", *args]


def spawn(fn, args: tuple, nprocs: int = 2, join: bool = True):
    """`torch.multiprocessing.spawn(fn, args, nprocs)` (the context, unjoined, with join=False), but forked
    from a server process that has imported qshard's training stack once (importing it costs each fresh
    process ~7 s of CPU on a 2-core machine, more than most ranks here then run), and whose processes exit
    without the interpreter's final garbage collections (they walk every object torch and transformers made,
    ~2 s of CPU per process; a rank has written its results by then)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return mp.start_processes(_then_freeze, args=(fn, *args), nprocs=nprocs, join=join, start_method="forkserver")


# What the fork server imports before it forks any rank: the modules every rank's work imports (bitsandbytes too,
# which qshard imports at its first quantization: ~3 s of CPU a process). Nothing here may run a parallel region in
# the server (forked processes would inherit a dead OpenMP pool).
FORKSERVER_PRELOAD = ["torch.distributed.checkpoint", "transformers", "bitsandbytes", "qshard.train.run",
                      "qshard.export"]


class RankRun(typing.NamedTuple):
    """One rank's end of one command line run by `run_on_ranks`."""

    code: int  # what qshard.cli.main returned
    stderr: str  # what the rank wrote to sys.stderr meanwhile (its log, its error lines)


def run_on_ranks(runs: dict[str, list[str]], nprocs: int = 2, before=None, timeout_s: float = 300
                 ) -> dict[str, list[RankRun]]:
    """Run each of `runs` (name -> a `qshard` command line) through `qshard.cli.main` on `nprocs` ranks, in turn,
    in one group of spawned processes set up as torchrun sets up the processes `qshard train --nproc N` starts
    (each run on a port of its own): one process start serves every run, where `--nproc` would pay Python's and
    torch's imports again for the launcher and each rank of each run. `before(rank)`, a module-level function,
    runs first in each rank. Returns {name: [each rank's RankRun]}; kills the ranks and fails the test if they
    have not finished `timeout_s` seconds per run after the start."""
    with tempfile.TemporaryDirectory(prefix="qshard-ranks-") as results:
        context = spawn(_cli_rank, (nprocs, runs, _free_ports(len(runs)), before, results), nprocs=nprocs,
                        join=False)
        deadline = time.monotonic() + timeout_s * len(runs)
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the ranks did not finish {list(runs)} in time; finished: {_rank_results(results)}")
        found = _rank_results(results)
    return {name: [RankRun(**found[rank][name]) for rank in range(nprocs)] for name in runs}


def _cli_rank(rank: int, nprocs: int, runs: dict[str, list[str]], ports: list[int], before, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs))
    if before is not None:
        before(rank)
    from qshard.cli import main

    done = {}
    for (name, argv), port in zip(runs.items(), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main(argv)
        done[name] = {"code": code, "stderr": stderr.getvalue()}
        # Rewritten after each run: a test that runs out of time still shows what finished.
        Path(results, f"rank{rank}.json").write_text(json.dumps(done))


def _rank_results(results: str) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(results).glob("rank*.json")}


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:  # all bound at once: n different ports
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def device_batch(trainer, indices: list[int]) -> dict:
    """The trainer's training examples `indices`, collated and on its device as its step sends them."""
    return trainer._to_device(trainer._collate(indices))


def _then_freeze(rank: int, fn, *args) -> None:
    fn(rank, *args)
    gc.freeze()  # what is left is only freed at exit; frozen objects are never collected again



class LogLines(logging.Handler):
    """The messages of the log records it is attached to, at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build each architecture's tiny model once per session: `tiny_models("qwen2")` -> directory."""
    from qshard.demo import write_tiny_model

    cache: dict[str, Path] = {}

    def get(model_type: str = "llama", **overrides) -> Path:
        key = model_type + repr(sorted(overrides.items()))
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"tiny-{model_type}")
            cache[key] = write_tiny_model(dest, model_type, **{"num_hidden_layers": 2, **overrides})
        return cache[key]

    return get


@pytest.fixture
def dist_env():
    """A world of one in this process (FSDP2 needs a process group even then)."""
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    yield env
    shutdown()
