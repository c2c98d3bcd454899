"""`qshard train --nproc 2` under signals and failures: the real launcher and its two ranks (gloo on CPU),
each run signalled once it trains (its first metrics line is written), never after a fixed sleep.

Preemption signals reach the ranks, which save and exit 0; a killed launcher takes its ranks along; a
stopped rank makes the others time out with one line; a killed rank is named as the cause. The timeouts'
options are checked in this process, before anything is loaded."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import cli, cli_env

from qshard.checkpoint import complete_checkpoints
from qshard.cli import main as cli_main
from qshard.launcher import FORWARDED

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d qshard: ")  # the ranks' progress lines (rank 0 logs)
TIMEOUT_S = 4  # the stopped-rank run's collective timeout: far above a step here, even on a busy machine


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_models) -> tuple[Path, Path]:
    """A tiny Llama and 64 short records: steps of a few milliseconds, no held-out set to evaluate."""
    data = tmp_path_factory.mktemp("data") / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"add {i} and 3", "output": str(i + 3)}) + "\n"
                            for i in range(64)))
    return tiny_models("llama"), data


class Run:
    """A launcher started on many steps (it never ends by itself in a test) and its ranks, once training."""

    def __init__(self, inputs: tuple[Path, Path], out: Path, *extra: str) -> None:
        model, data = inputs
        self.out, self.stderr_file = out, out.with_name(out.name + ".stderr")
        args = cli("train", "--model", str(model), "--data", str(data), "--output-dir", str(out), "--nproc", "2",
                   "--batch-size", "1", "--max-steps", "100000", "--max-length", "32", "--train.precision", "fp32",
                   "--data.eval_fraction", "0", *extra)
        # stderr to a file: ranks left running (the bug under test) would hold a pipe open.
        with self.stderr_file.open("w") as stderr:
            self.proc = subprocess.Popen(args, env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr)
        self.ranks = self._wait_for_training()

    def _wait_for_training(self) -> dict[int, psutil.Process]:
        metrics, deadline = self.out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert self.proc.poll() is None, self.stderr_file.read_text()
            assert time.monotonic() < deadline, self.stderr_file.read_text()
            time.sleep(0.01)
        children = psutil.Process(self.proc.pid).children()
        return {int(child.environ()["RANK"]): child for child in children}

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """The launcher's exit code and stderr, once it exits (killed, with its ranks, if it outlives `timeout`)."""
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill_all()
        return code, self.stderr_file.read_text()

    def ranks_left(self, wait: float) -> list[int]:
        """The ranks still running after up to `wait` seconds (an exited one may linger as a zombie)."""
        deadline = time.monotonic() + wait
        while (left := [rank for rank, p in self.ranks.items() if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def kill_all(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for process in self.ranks.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _messages(stderr: str) -> list[str]:
    """Every line that is not a progress line of the ranks' log."""
    return [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]


def test_preemption_signals_are_relayed_alike():
    """SIGUSR1 (SLURM's --signal) takes the path SIGTERM takes below: the launcher relays both to the ranks, whose
    handling of SIGUSR1 test_checkpoint checks in one process."""
    assert {signal.SIGTERM, signal.SIGUSR1} <= set(FORWARDED)


def test_preemption_signal_to_the_launcher_saves_and_exits_0(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run")
    run.proc.send_signal(signal.SIGTERM)
    code, stderr = run.finish()
    assert code == 0, stderr
    assert _messages(stderr) == [], stderr  # no traceback, no launcher report
    [preempted] = [line for line in stderr.splitlines() if "preempted" in line]
    step = int(re.search(r"preempted: saved step (\d+); continue with the same command plus --resume auto",
                         preempted).group(1))
    [saved] = complete_checkpoints(run.out / "checkpoints")
    assert json.loads((saved / "trainer_state.json").read_text())["step"] == step
    assert run.ranks_left(wait=0) == []


def test_killed_launcher_takes_its_ranks_along(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run")
    run.proc.send_signal(signal.SIGKILL)
    try:
        assert run.ranks_left(wait=10) == []
    finally:
        run.kill_all()


def test_stopped_rank_times_out_the_others_with_one_line(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", "--parallel.timeout_s", str(TIMEOUT_S))
    run.ranks[1].suspend()  # SIGSTOP: alive, holding its connections, answering nothing
    stopped = time.monotonic()
    code, stderr = run.finish()
    # Rank 0 gives up after the timeout; the launcher does not wait for the stopped rank to obey a SIGTERM.
    assert time.monotonic() - stopped < TIMEOUT_S + 15, stderr
    assert code == 1, stderr
    assert "Traceback" not in stderr and "Warning" not in stderr, stderr
    timed_out, killed = _messages(stderr)
    assert re.fullmatch(
        rf"qshard: error: rank 0: (all-gather|reduce-scatter|all-reduce) at step \d+ timed out waiting for the "
        rf"other ranks \(parallel.timeout_s: {TIMEOUT_S} s\): one of them stopped or hung", timed_out), stderr
    assert killed.startswith("qshard: rank 1 was stopped"), stderr
    assert run.ranks_left(wait=0) == []


def test_killed_rank_is_named_as_the_cause(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run")
    run.ranks[1].kill()
    code, stderr = run.finish()
    assert code == 1, stderr
    # Only the dead rank, not rank 0, whose collectives failed because of it.
    assert _messages(stderr) == ["qshard: rank 1 died (SIGKILL)"], stderr
    assert run.ranks_left(wait=0) == []


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("parallel.timeout_s", "0", "parallel.timeout_s must be > 0, got 0.0"),
    ("parallel.load_timeout_s", "-5", "parallel.load_timeout_s must be > 0, got -5.0"),
    ("parallel.timeout_s", "1e12", "parallel.timeout_s must be in [0.0, 31536000.0]"),
    ("parallel.load_timeout_s", "inf", "parallel.load_timeout_s must be a finite number"),
])
def test_timeouts_are_checked_up_front(tmp_path, capsys, option, value, needle):
    code = cli_main(["train", "--output-dir", str(tmp_path / "run"), f"--{option}", value])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run").exists()
