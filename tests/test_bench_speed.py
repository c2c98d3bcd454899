"""benchmarks/speed.py's record of what a qshard run's `auto` options settled to, read from the run's config.yaml
(a benchmark row must say whether it ran with CUDA graphs, projections kept, double-quantized scales), and its
`qshard-baseline` system, which runs another version of qshard's code in the same sitting."""

from __future__ import annotations

import pytest
import speed  # benchmarks/, on the path (conftest.py)
import torch

from qshard import config as config_mod
from qshard.config import Config
from qshard.parallel.compile import decide_cuda_graphs


def test_the_settled_options_are_those_the_runs_config_says(tmp_path):
    cfg = Config()
    cfg.parallel.ac_save_projections, cfg.quant.double_quant = True, False
    decide_cuda_graphs(cfg, torch.device("cpu"), 1, lambda: [], 5000, None, log_it=False)  # off
    config_mod.save(cfg.validate(), tmp_path / "config.yaml")
    assert speed.settled_autos(tmp_path) == {"parallel.cuda_graphs": False, "parallel.ac_save_projections": True,
                                             "quant.double_quant": False}
    cfg.parallel.cuda_graphs = "auto"  # not settled: said as such
    config_mod.save(cfg.validate(), tmp_path / "config.yaml")
    assert speed.settled_autos(tmp_path)["parallel.cuda_graphs"] == "auto"


_STUB_MAIN = '''
import json, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--output-dir") + 1])
out.mkdir(parents=True)
(out / "metrics.jsonl").write_text("".join(json.dumps({"step_time_s": 0.5, "tokens": 1000, "peak_mem_gib": 1.5,
                                                       "loss": 42.0 + i}) + "\\n" for i in range(3)))
(out / "config.yaml").write_text("parallel: {ac_save_projections: true}\\n"
                                 "quant: {double_quant: true}\\n")
'''


def test_the_baseline_system_runs_the_package_of_its_source_directory(tmp_path):
    """`qshard-baseline` runs `python -m qshard train` with `--baseline-src` first on PYTHONPATH: here a stand-in
    package that writes a run of its own (losses 42, 43, 44), which is what the result reports, with the source."""
    import argparse

    package = tmp_path / "baseline" / "qshard"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(_STUB_MAIN)
    (tmp_path / "REV").write_text("abc1234\n")
    args = argparse.Namespace(out=tmp_path / "out", baseline_src=tmp_path / "baseline", warmup=1)
    args.out.mkdir()
    # A model that does not exist: were the working tree's qshard run instead, it would stop at once.
    base = ["-m", "qshard", "train", "--model", str(tmp_path / "none")]
    result = speed.run_system("qshard-baseline", args, base, tmp_path / "data.jsonl")
    assert result["losses"] == [42.0, 43.0, 44.0] and result["tokens_per_s"] == 2000
    assert result["system"] == "qshard-baseline" and result["baseline_src"] == str(tmp_path / "baseline")
    assert result["baseline_rev"] == "abc1234"
    # The stand-in's config.yaml has no cuda_graphs: an option of later code, reported as absent.
    assert result["settled"] == {"parallel.cuda_graphs": "absent", "parallel.ac_save_projections": True,
                                 "quant.double_quant": True}
    assert result["command"].startswith(f"PYTHONPATH={tmp_path / 'baseline'}")


def test_the_baseline_system_needs_its_source(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["speed.py", "--out", str(tmp_path), "--systems", "qshard,qshard-baseline"])
    with pytest.raises(SystemExit):
        speed.main()
    assert "--systems qshard-baseline needs --baseline-src DIR" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["speed.py", "--out", str(tmp_path), "--baseline-src", str(tmp_path)])
    with pytest.raises(SystemExit):
        speed.main()
    assert "no qshard package there" in capsys.readouterr().err
