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
        cfg.data.packing = True
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


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_config_refuses_cuda_graphs_for_preference_pairs(objective):
    cfg = _config()
    cfg.train.objective = objective
    with pytest.raises(QShardError, match=f"parallel.cuda_graphs: for train.objective sft only \\(not {objective}\\)"):
        cfg.validate()


@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_are_padded_to_max_length_and_lose_nothing(dist_env, tiny_models, packed):
    """Under cuda_graphs every micro-batch (training and held-out, the last held-out one of full size too) is padded
    to data.max_length and goes without an attention mask (right padding: no real token sees it), one set of graph
    inputs for the recorded graphs; the loss and its token counts are the unpadded batch's."""
    from qshard.data import Example, input_tokens

    model_dir = tiny_models("llama")
    plain = _config(cuda_graphs=False).validate()
    plain.data.max_length = 40
    model, _ = build_model(plain, dist_env, model_dir)

    def example(n):  # a packed row of two documents, or one plain example
        ids = list(range(3, 3 + n))
        return Example(ids, ids, list(range(n // 2)) + list(range(n - n // 2)) if packed else None)

    examples = [example(n) for n in (9, 17, 12, 30, 21)]
    padded = _config().validate()
    padded.data.max_length = 40
    losses = {}
    for cfg, width in ((plain, 17), (padded, 40)):
        cfg.train.micro_batch_size = 2
        trainer = Trainer(cfg, dist_env, model, examples, examples, 0)
        batch = trainer._collate([0, 1])
        assert batch["input_ids"].shape == (2, width)
        assert input_tokens(batch) == 9 + 17
        if packed:  # the padding is one more document: positions restart where the row's tokens end
            assert batch["position_ids"][0, 9:].tolist() == list(range(width - 9))
        prepared = trainer._to_device(batch)
        assert ("attention_mask" in prepared) is (width == 17 and not packed)
        with torch.no_grad():
            loss, _ = trainer.objective(model, prepared)
        losses[width] = (loss.item(), trainer.objective.units(batch))
        # The held-out set's last chunk (one of its five examples): two rows under fixed width, as wide as the rest
        shapes, eval_batch = [], trainer._eval_batch

        def seen(real, size, eval_batch=eval_batch, shapes=shapes):
            batch = eval_batch(real, size)
            shapes.append(tuple(batch["input_ids"].shape))
            return batch

        trainer._eval_batch = seen
        trainer.evaluate()
        assert shapes[-1] == ((2, 40) if width == 40 else (1, 21)), shapes
    assert losses[40][1] == losses[17][1] == 9 - 1 + 17 - 1
    assert losses[40][0] == pytest.approx(losses[17][0], rel=1e-5)


def test_the_dry_run_plan_names_it(tmp_path):
    from qshard.train.plan import RunPlan

    def parallel(cfg):
        return RunPlan(cfg.validate(), None, 1, [], [], 1, 1, tmp_path)._parallel()

    flags = parallel(_config()).split(", ")
    assert "compile auto" in flags and "cuda_graphs" in flags, flags
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
    assert [c["options"] for c in calls] == [compile_mod.INDUCTOR_OPTIONS] * 2
    assert functorch_config.graphsafe_rng_functionalization is cacheable
    calls.clear()
    compile_mod.compile_blocks(blocks, "inductor", [], cuda_graphs=True)
    assert [c["options"] for c in calls] == [{**compile_mod.INDUCTOR_OPTIONS, "triton.cudagraphs": True}] * 2
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
    plain.data.max_length = 32
    graphs = _config().validate()
    graphs.data.max_length = 32
    for cfg, want in ((plain, 0), (graphs, 4)):
        cfg.train.grad_accum = 2
        trainer = Trainer(cfg, dist_env, model, examples, examples[:2], 0)
        marks.clear()
        for step in range(3):
            trainer.step(step)
        trainer.evaluate()
        assert len(marks) == want


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("variant", ["packed", "accumulated_and_evaluated", "unpacked"])
def test_blocks_replayed_as_cuda_graphs_train_like_launched_ones(tiny_models, tmp_path, variant):
    """The same losses with the blocks replayed as CUDA graphs as launched, rows of one width (packed); also with two
    micro-batches a step (the gradients of the first survive the second's replay) and evaluations between steps
    (their own step marks). Unpacked rows of many lengths are padded to data.max_length under the option: the blocks
    compile one graph, never again for a new width, and train as the launched run of varying widths does, within
    what bf16 kernels of other shapes (and attention with a mask, or without) give."""
    model_dir = tiny_models("llama")
    losses = {}
    for on in (False, True):
        out = tmp_path / str(on)
        counters = torch._dynamo.utils.counters
        counters.clear()
        cfg = _config(model_dir, out, cuda_graphs=on)
        if variant == "accumulated_and_evaluated":
            cfg.train.grad_accum, cfg.train.eval_every, cfg.data.eval_fraction = 2, 2, 0.2
        cfg.data.packing = variant != "unpacked"
        try:
            run_training(cfg.validate())
            # With the option every block graph was replayed as a CUDA graph: none skipped; training compiled one
            # graph (the blocks share it), evaluation one more.
            assert not on or not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
            evaluated = variant == "accumulated_and_evaluated"
            assert not on or counters["stats"]["unique_graphs"] <= 1 + evaluated, dict(counters["stats"])
        finally:
            torch._dynamo.reset()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[on] = [r["loss"] for r in records] + [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(losses[True]) == (6 if evaluated else 4), losses[True]  # 4 steps, with evaluations at 2 and 4
    assert losses[True] == pytest.approx(losses[False], rel=2e-2 if variant == "unpacked" else 1e-3)
