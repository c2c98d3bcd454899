"""benchmarks/offload_70b.py --nproc: real worker processes through torch's launcher (gloo on CPU, dry run)."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

from conftest import cli_env

SCRIPT = str(Path(__file__).resolve().parents[1] / "benchmarks" / "offload_70b.py")


def _bench(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--dry-run", *args],
                          env=cli_env(), capture_output=True, text=True, timeout=300)


def test_two_workers_report_each_rank_and_match_one_process(tmp_path):
    """2 ranks x 1 micro-batch against 1 rank x 2 micro-batches: same global batch, same data, same losses."""
    two = _bench(tmp_path / "two", "--nproc", "2")
    assert two.returncode == 0, two.stderr
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["nproc"] == 2 and result["cpu_offload"] is True
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["world_size"] == 2 for r in result["ranks"])
    for r in (0, 1):
        assert json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) == result["ranks"][r]
    assert result["tokens_per_s"] > 0
    assert math.isclose(result["tokens_per_s_per_gpu"], result["tokens_per_s"] / 2)
    assert len(result["peak_cpu_rss_gib"]) == 2 and all(x > 0 for x in result["peak_cpu_rss_gib"])
    assert math.isclose(result["peak_cpu_rss_gib_sum"], sum(result["peak_cpu_rss_gib"]))
    assert result["peak_gpu_allocated_gib"] == [None, None]  # no CUDA here: no cap, no GPU peaks
    assert result["cap_gib"] is None and result["peak_gpu_reserved_gib_max"] is None
    assert result["num_alloc_retries"] == result["num_ooms"] == [None, None]  # the CUDA allocator's, per rank
    assert "--nproc 2" in result["command"] and result["worker_command"].endswith("--worker")
    assert "--parallel.cpu_offload true" in result["qshard_command"]
    losses = result["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

    # The one-process path in this process (the script's main, as `python offload_70b.py` runs it): it starts no
    # worker, so a Python start with torch's imports would be most of its time.
    runpy.run_path(SCRIPT)["main"](["--out", str(tmp_path / "one"), "--dry-run", "--grad-accum", "2"])
    single = json.loads((tmp_path / "one" / "result.json").read_text())
    assert single["nproc"] == 1 and isinstance(single["peak_cpu_rss_gib"], float)
    assert "num_alloc_retries" in single and single["num_alloc_retries"] is None and single["num_ooms"] is None
    assert len(single["losses"]) == 3
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses, single["losses"])), (losses, single["losses"])


def test_failing_workers_fail_the_benchmark(tmp_path):
    proc = _bench(tmp_path, "--nproc", "2", "--no-offload", "--qshard-args", "--nonsense.key 1")
    assert proc.returncode != 0
    assert "the 2-process run failed" in proc.stderr
    assert "rank(s) [0, 1] wrote no record" in proc.stderr
    assert "unknown option 'nonsense'" in proc.stderr  # the worker's own error reaches the caller
    assert not (tmp_path / "result.json").exists()


def test_no_offload_turns_cpu_offload_off(tmp_path):
    bench = runpy.run_path(SCRIPT)  # its functions, without running main
    for flags, value in (([], "true"), (["--no-offload"], "false")):
        args = bench["parse_args"](["--out", str(tmp_path), *flags])
        argv = bench["qshard_argv"](args, tmp_path / "data.jsonl", tmp_path / "run")
        assert argv[argv.index("--parallel.cpu_offload") + 1] == value
        assert args.nproc == 1 and args.seq == 2048 and args.cap_gib == 24.0
