"""The run directory: --overwrite moves the previous run aside whole, one qshard process holds a directory at a
time, metrics.jsonl survives a torn last line and a full disk (one error line), and `--resume auto` on a
finished run changes nothing. One finished run is made once and copied for each test; every run is
`qshard.cli.main` in this process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml
from conftest import SRC

from qshard.checkpoint import STATE_FILE, complete_checkpoints, find_latest
from qshard.cli import main
from qshard.errors import QShardError

DEMO = resources.files("qshard") / "demo_data"
PAGE = 4096


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_models) -> tuple[Path, Path]:
    """The tiny Llama and the first 24 of the demo's held-out examples (no test here needs more)."""
    eval_data = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    eval_data.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:24]))
    return tiny_models("llama"), eval_data


def _args(inputs, out: Path, *extra: str) -> list[str]:
    model, eval_data = inputs
    return ["train", "--model", str(model), "--data", str(DEMO / "train.jsonl"), "--eval-data", str(eval_data),
            "--output-dir", str(out), "--max-length", "48", "--batch-size", "2", "--train.precision", "fp32",
            "--max-steps", "4", "--save-every", "2", *extra]


def _run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished(inputs, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_args(inputs, out)) == 0
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-00000002", "step-00000004"]
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def _error_line(code: int, err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("qshard: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------------------------- overwrite


def test_overwrite_moves_the_previous_run_aside(finished, inputs, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    old = _files(out)
    code, err = _run(_args(inputs, out, "--overwrite", "--max-steps", "3", "--save-every", "1"), capsys)
    assert code == 0, err

    # Only the new run's checkpoints: the old step 4 neither survives nor makes keep_last delete new ones.
    saved = complete_checkpoints(out / "checkpoints")
    assert [p.name for p in saved] == ["step-00000002", "step-00000003"]
    assert all(json.loads((p / STATE_FILE).read_text())["config"]["train"]["max_steps"] == 3 for p in saved)
    assert find_latest(out / "checkpoints") == saved[-1]  # what `qshard export` and `--resume auto` take
    assert json.loads((out / "summary.json").read_text())["steps"] == 3 and _steps(out / "metrics.jsonl") == [1, 2, 3]
    assert (out / "notes.txt").read_text() == "mine"

    # The previous run, whole, in one place; nothing else moved.
    [previous] = out.glob(".previous-*")
    assert _files(previous) == {k: v for k, v in old.items() if k != "notes.txt"}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [previous.name, "adapter", "checkpoints", "config.yaml", "metrics.jsonl", "notes.txt", "samples.jsonl",
         "summary.json"])


# ------------------------------------------------------------------------------------------------------ lock

HOLD = """
import sys, time
from qshard.rundir import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_second_process_is_refused_and_a_dead_holders_lock_does_not_block(finished, inputs, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    before = _files(out)
    env = {**os.environ, "PYTHONPATH": SRC}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        exports = [["export", kind, "--run", str(out), "--out", str(tmp_path / kind)] for kind in ("adapter", "merged")]
        for args in [_args(inputs, out, *extra) for extra in ([], ["--resume", "auto"], ["--overwrite"])] + exports:
            line = _error_line(*_run(args, capsys))
            assert str(out) in line and f"pid {holder.pid} on " in line and "another qshard process" in line
        assert not (tmp_path / "adapter").exists() and not (tmp_path / "merged").exists()
        assert {k: v for k, v in _files(out).items() if k != ".qshard.lock"} == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / ".qshard.lock").is_file()  # left behind by the dead process

    code, err = _run(_args(inputs, out, "--resume", "auto"), capsys)
    assert code == 0 and "nothing to do" in err, err
    assert _files(out) == before  # and its lock file gone with this run's end


# ------------------------------------------------------------------------------------------------- metrics


def test_torn_last_metrics_line_is_dropped_on_resume(finished, inputs, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    (out / "summary.json").unlink()
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    args = _args(inputs, out, "--resume", "auto")

    (out / "metrics.jsonl").write_text(lines[0] + '{"step": 2, "loss"\n' + "".join(lines[2:]))
    before = _files(out)
    line = _error_line(*_run(args, capsys))
    assert f"{out / 'metrics.jsonl'}:2:" in line
    assert _files(out) == before

    (out / "metrics.jsonl").write_text("".join(lines[:3]) + lines[3][:25])  # killed (or a full disk) mid-line
    code, err = _run(args, capsys)
    assert code == 0, err
    assert f"{out / 'metrics.jsonl'}:4: dropping a torn last line" in err
    assert _steps(out / "metrics.jsonl") == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def test_resume_into_an_adapter_dir_qshard_did_not_write_is_refused_before_training(finished, inputs, tmp_path,
                                                                                    capsys):
    """The adapter written at the end would have to replace a user's file: said before any step is trained."""
    out = _copy(finished, tmp_path / "run")
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    (out / "summary.json").unlink()
    (out / "adapter" / "notes.txt").write_text("mine")
    before = _files(out)
    line = _error_line(*_run(_args(inputs, out, "--resume", "auto"), capsys))
    assert f"output.dir {out / 'adapter'}: holds files the qshard adapter export there did not write" in line
    assert "notes.txt" in line and _files(out) == before


# ------------------------------------------------------------------------------------------------ full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (mounting needs root, or CAP_SYS_ADMIN); unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)  # even while a failed test holds a file open


def _fill(disk: Path, leave_pages: int) -> None:
    """Fill `disk` but for `leave_pages` pages."""
    filler = disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        f.write(b"\0" * (2 << 20))
    os.truncate(filler, filler.stat().st_size - leave_pages * PAGE)


def test_metrics_lines_are_whole_on_a_full_disk(small_disk):
    from qshard.train.metrics import MetricsLog

    _fill(small_disk, leave_pages=1)
    log = MetricsLog(small_disk / "metrics.jsonl")
    expected = f"no space left on device while writing {small_disk / 'metrics.jsonl'}"
    with pytest.raises(QShardError, match=f"^{re.escape(expected)}$"):
        for step in range(1, 100):
            log.write({"step": step, "pad": "x" * 100})
    log.close()
    steps = _steps(small_disk / "metrics.jsonl")  # each line whole: the one that did not fit was taken back
    assert (small_disk / "metrics.jsonl").read_text().endswith("\n") and steps == list(range(1, len(steps) + 1))
    assert 20 < len(steps) < 40

    import torch
    from safetensors.torch import save_file

    from qshard.rundir import full_disk_error

    (small_disk / "filler").unlink()  # a library's wording of it: safetensors'
    _fill(small_disk, leave_pages=0)
    with pytest.raises(Exception) as raised:
        save_file({"w": torch.zeros(4096)}, small_disk / "w.safetensors")
    assert str(full_disk_error(raised.value, "w.safetensors")) == "no space left on device while writing w.safetensors"


def test_full_disk_during_a_run_is_one_line(inputs, small_disk, capsys):
    out = small_disk / "run"
    _fill(small_disk, leave_pages=3)  # the lock file, config.yaml and one page of metrics
    code, err = _run(_args(inputs, out, "--max-steps", "40", "--save-every", "0"), capsys)
    line = _error_line(code, err)
    assert line == f"qshard: error: no space left on device while writing {out / 'metrics.jsonl'}"
    steps = _steps(out / "metrics.jsonl")  # whole lines only
    assert 1 <= len(steps) < 40 and steps == list(range(1, len(steps) + 1))
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 40
    assert not (out / "summary.json").exists()


# ------------------------------------------------------------------------------------------- a finished run


def test_resume_auto_on_a_finished_run_changes_nothing(finished, inputs, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    before = _files(out)
    code, err = _run(_args(inputs, out, "--resume", "auto"), capsys)
    assert code == 0 and "run already finished" in err and "nothing to do" in err, err
    assert _files(out) == before

    shutil.rmtree(out / "checkpoints")  # finished, but nothing to continue from: not retrained over
    before = _files(out)
    line = _error_line(*_run(_args(inputs, out, "--resume", "auto"), capsys))
    assert "holds a finished run but no checkpoint" in line
    assert _files(out) == before


def test_resume_at_the_last_step_evaluates_the_trained_weights(finished, inputs, tmp_path, capsys):
    """A run that saved its last checkpoint but died before summary.json: resumed, it trains nothing and
    reports the held-out loss of its trained weights, not the one from before training."""
    out = _copy(finished, tmp_path / "run")
    (out / "summary.json").unlink()
    code, err = _run(_args(inputs, out, "--resume", "auto"), capsys)
    assert code == 0, err
    done, was = (json.loads((d / "summary.json").read_text()) for d in (out, finished))
    assert done["eval_loss_end"] == pytest.approx(was["eval_loss_end"], rel=1e-6)
    assert done["eval_loss_end"] != pytest.approx(was["eval_loss_start"], rel=1e-6)
