"""benchmarks/step_phases.py on a tiny random model on the CPU: the preference objectives' steps are timed whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

SCRIPT = str(Path(__file__).resolve().parents[1] / "benchmarks" / "step_phases.py")


# KTO's reference point needs 2 examples a micro-batch.
@pytest.mark.parametrize("objective, batch", [("dpo", "1"), ("kto", "2")])
def test_preference_steps_are_timed_whole(objective, batch):
    run = subprocess.run([sys.executable, SCRIPT, "--shape", "llama-tiny", "--seq", "32", "--steps", "1", "--warmup",
                          "1", "--parallel.compile", "false", "--train.micro_batch_size", batch,
                          "--train.objective", objective],
                         env=cli_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["step_s"] > 0 and result["step_issue_host_s"] > 0
    assert result["phases_host_wall_s"] == {}  # the token objective's phases do not split a preference step
    assert result["overrides"][-1] == objective
    assert result["top_host_ops_ms"]  # the profiled step ran
