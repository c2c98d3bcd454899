"""benchmarks/speed.py's record of what a qshard run's `auto` options settled to, read from the run's config.yaml
(a benchmark row must say whether it ran with CUDA graphs, projections kept, double-quantized scales)."""

from __future__ import annotations

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
