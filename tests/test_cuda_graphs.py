"""parallel.cuda_graphs: compiled blocks replayed as CUDA graphs. On the CPU: what the config and the build refuse,
the options handed to inductor, and the step marks the trainer makes; on a GPU, training with it against without."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
import torch.nn as nn

from qshard.build import build_model
from qshard.config import Config
from qshard.errors import QShardError
from qshard.parallel import compile as compile_mod
from qshard.train.loop import Trainer
from qshard.train.run import run_training

CUDA = torch.cuda.is_available()


def _config(model_dir=None, out=None, **parallel) -> Config:
    cfg = Config()
    cfg.lora.rank = 8
    if model_dir is not None:
        cfg.model.path = str(model_dir)
        cfg.data.path = str(resources.files("qshard") / "demo_data" / "train.jsonl")
        cfg.data.eval_fraction = 0.0
        cfg.data.max_length = 48
        cfg.data.packing = True  # rows of one length: the blocks' graphs keep one shape
        cfg.train.max_steps, cfg.train.micro_batch_size = 4, 2
    if out is not None:
        cfg.output.dir = str(out)
    cfg.parallel.cuda_graphs = True
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize("setting, says", [
    ({"compile": False}, "needs parallel.compile"),
    ({"compile_backend": "aot_eager", "compile": True}, "compile_backend inductor"),
    ({"activation_checkpointing": False}, "parallel.activation_checkpointing true"),
    ({"cpu_offload": True, "quant_sharding": "dtensor"}, "parallel.cpu_offload false"),
    ({"nproc": 2}, r"one process \(parallel.nproc 1\)"),
    ({"mlp_tile_tokens": 64}, "parallel.mlp_tile_tokens 0"),
    ({"ac_reentrant": True}, "parallel.ac_reentrant false"),
    ({"activation_offload": True}, "not with parallel.activation_offload"),
])
def test_config_refuses_cuda_graphs_where_blocks_are_not_checkpointed_inside_their_graphs(setting, says):
    with pytest.raises(QShardError, match=f"parallel.cuda_graphs: .*{says}"):
        _config(**setting).validate()
    cfg = _config()
    cfg.lora.dropout = 0.1
    with pytest.raises(QShardError, match=r"parallel.cuda_graphs: .*lora.dropout 0"):
        cfg.validate()
    _config().validate()  # the defaults take it


def test_the_dry_run_plan_names_it(tmp_path):
    from qshard.train.plan import RunPlan

    def parallel(cfg):
        return RunPlan(cfg.validate(), None, 1, [], [], 1, 1, tmp_path)._parallel()

    assert "compile auto, cuda_graphs" in parallel(_config())
    assert "cuda_graphs" not in parallel(_config(cuda_graphs=False))


@pytest.mark.skipif(CUDA, reason="the CPU's refusal; on a GPU the option runs (test below)")
def test_build_on_the_cpu_refuses_it_in_one_line(dist_env, tiny_models):
    with pytest.raises(QShardError, match="parallel.cuda_graphs: needs a CUDA device; this run computes on cpu"):
        build_model(_config().validate(), dist_env, tiny_models("llama"))


@pytest.mark.parametrize("cacheable", [False, True])
def test_inductor_gets_the_cuda_graph_options_and_graph_safe_random_state(monkeypatch, cacheable):
    """With cuda_graphs the blocks' inductor options add CUDA graph trees (not for dynamic shapes) to the usual ones,
    and torch's graph-safe handling of random state stays on (CUDA graphs need it). Without the option qshard turns
    it off where torch's caches cannot keep graphs with it (torch 2.11's wrapper is not cacheable; 2.13's is, and
    then it is left as it is)."""
    from torch._functorch import config as functorch_config
    from torch._prims import rng_prims

    class Wrapper:
        @staticmethod
        def cacheable():
            return cacheable

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(rng_prims, "graphsafe_run_with_rng_state", Wrapper)
    monkeypatch.setattr(functorch_config, "graphsafe_rng_functionalization", True)
    blocks = [nn.Linear(4, 4) for _ in range(2)]
    compile_mod.compile_blocks(blocks, "inductor", [])
    assert [c["options"] for c in calls] == [{"combo_kernels": True}] * 2
    assert functorch_config.graphsafe_rng_functionalization is cacheable
    calls.clear()
    compile_mod.compile_blocks(blocks, "inductor", [], cuda_graphs=True)
    assert [c["options"] for c in calls] == [{"combo_kernels": True, "triton.cudagraphs": True,
                                              "triton.cudagraph_skip_dynamic_graphs": True}] * 2
    assert functorch_config.graphsafe_rng_functionalization is True


def test_export_and_generate_build_a_cuda_graph_run_without_it(dist_env, tiny_models):
    """A run trained with cuda_graphs has it in its config.yaml; export and generate read the run back in one
    process without compiling, where the option would be refused (here: on the CPU)."""
    from qshard.export_cmd import reading_config
    from qshard.generate_cmd import _one_process_config

    model_dir = tiny_models("llama")
    for clear in (reading_config, _one_process_config):
        cfg = _config()
        clear(cfg)
        build_model(cfg.validate(), dist_env, model_dir)
        torch._dynamo.reset()


def test_trainer_marks_each_step_and_evaluation_begin(dist_env, tiny_models, monkeypatch):
    """CUDA graph trees may overwrite a replay's outputs once a new step is marked: the trainer marks one at the start
    of each optimizer step (not of each micro-batch) and of each evaluation, and nowhere without the option. The
    model is built without it (this is the CPU); the trainer takes the option from its config."""
    from qshard.data import Example

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model_dir = tiny_models("llama")
    plain = _config(cuda_graphs=False).validate()
    model, _ = build_model(plain, dist_env, model_dir)
    examples = [Example(list(range(3, 27)), list(range(3, 27))) for _ in range(8)]
    for cfg, want in ((plain, 0), (_config().validate(), 4)):
        cfg.train.grad_accum = 2
        trainer = Trainer(cfg, dist_env, model, examples, examples[:2], 0)
        marks.clear()
        for step in range(3):
            trainer.step(step)
        trainer.evaluate()
        assert len(marks) == want


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_blocks_replayed_as_cuda_graphs_train_like_launched_ones(tiny_models, tmp_path):
    model_dir = tiny_models("llama")
    losses = {}
    for on in (False, True):
        out = tmp_path / str(on)
        counters = torch._dynamo.utils.counters
        counters.clear()
        try:
            run_training(_config(model_dir, out, cuda_graphs=on).validate())
            # With the option every block graph was replayed as a CUDA graph: none skipped.
            assert not on or not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        finally:
            torch._dynamo.reset()
        losses[on] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
