"""parallel.cuda_graphs: compiled blocks replayed as CUDA graphs. On the CPU: what the config and the build refuse,
the options handed to inductor, and the step marks the trainer makes; on a GPU, training with it against without."""

from __future__ import annotations

import copy
import json
import re
from importlib import resources

import numpy as np
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


GPU = torch.device("cuda")  # only a device's name here: nothing runs on it


def _auto(max_length=2048, micro_batch=1, **parallel) -> Config:
    cfg = _config(cuda_graphs="auto", **parallel)
    cfg.data.max_length, cfg.train.micro_batch_size = max_length, micro_batch
    return cfg.validate()


def _choice(cfg, lengths, device=GPU, world_size=1, triton=True, micro_batches=5000, traced=None):
    return compile_mod.cuda_graphs_choice(cfg, device, world_size, lambda: np.asarray(lengths), micro_batches, traced,
                                          triton=triton)


def test_auto_replays_graphs_where_rows_fill_a_short_max_length(monkeypatch):
    # As on a torch that caches graph-safe random state (2.13); the next test has the other case.
    monkeypatch.setattr(compile_mod, "_graph_safe_rng_cacheable", lambda: True)
    on, why = _choice(_auto(), [2048, 2048, 2000])
    assert on and "rows 99% full" in why, why
    assert _choice(_auto(micro_batch=2), [2048] * 4)[0]  # 4,096 tokens a micro-batch: still short
    # Rows a tenth short of max_length would be padded by more than graphs save.
    on, why = _choice(_auto(), [1843] * 3)
    assert not on and "fill 90% of data.max_length (2,048)" in why, why
    assert not _choice(_auto(), [])[0]
    # A short run: the graphs' start-up would cost more than they save.
    on, why = _choice(_auto(), [2048], micro_batches=199)
    assert not on and "the run's 199 micro-batches would not repay" in why and "from 200 they do" in why, why
    assert _choice(_auto(), [2048], micro_batches=200)[0] and _choice(_auto(), [2048], micro_batches=None)[0]
    # Long micro-batches: the host launches the kernels faster than they run, graphs save nothing.
    for cfg in (_auto(max_length=8192), _auto(micro_batch=3)):
        on, why = _choice(cfg, [cfg.data.max_length])
        assert not on and "a micro-batch of" in why and "tokens" in why, why


def test_auto_asks_more_micro_batches_where_the_blocks_would_compile_again_each_run(monkeypatch):
    """Where torch cannot cache graphs holding graph-safe random state (torch 2.11), blocks whose backward recomputes
    attention compile again in each run under CUDA graphs: a run needs 1,000 micro-batches to repay that. Kept
    projections keep attention's outputs, nothing random is recomputed, and 200 suffice, as where torch can cache."""
    for cacheable in (True, False):
        monkeypatch.setattr(compile_mod, "_graph_safe_rng_cacheable", lambda cacheable=cacheable: cacheable)
        for kept in (True, False):
            cfg = _auto(ac_save_projections=kept)
            least = 200 if cacheable or kept else 1000
            assert compile_mod.graph_min_micro_batches(cfg.parallel) == least
            assert not _choice(cfg, [2048], micro_batches=least - 1)[0] and _choice(cfg, [2048], micro_batches=least)[0]
    # `auto` not yet settled reads as off: as without kept projections.
    assert compile_mod.graph_min_micro_batches(_auto().parallel) == 1000


@pytest.mark.parametrize("setting, world_size, triton, says", [
    ({}, 1, False, "the blocks are not compiled here"),
    ({"compile": False}, 1, True, "the blocks are not compiled here"),
    ({}, 2, True, r"one process \(parallel.nproc 1\)"),
    ({"activation_checkpointing": False}, 1, True, "parallel.activation_checkpointing true"),
    ({"mlp_tile_tokens": 64}, 1, True, "parallel.mlp_tile_tokens 0"),
    ({"activation_offload": True}, 1, True, "not with parallel.activation_offload"),
])
def test_auto_is_off_where_blocks_cannot_replay_as_graphs(setting, world_size, triton, says):
    """Where `true` would be refused, `auto` is off and says why (the first reason)."""
    on, why = _choice(_auto(**setting), [2048], world_size=world_size, triton=triton)
    assert not on and why.startswith("parallel.cuda_graphs auto: off, ") and re.search(says, why), why
    on, why = _choice(_auto(), [2048], device=torch.device("cpu"))
    assert not on and "computes on cpu" in why
    # Settled before the rows are read (a large data set's lengths cost a pass over its packing).
    untouched = lambda: pytest.fail("lengths read")  # noqa: E731
    for device, world_size in ((torch.device("cpu"), 1), (GPU, 2)):
        assert not compile_mod.cuda_graphs_choice(_auto(), device, world_size, untouched, 5000, triton=True)[0]
    pairs = _auto()
    pairs.train.objective = "dpo"
    assert not _choice(pairs, [2048])[0]
    dropout = _auto()
    dropout.lora.dropout = 0.1
    assert "lora.dropout 0" in _choice(dropout, [2048])[1]


def test_auto_asks_the_model_last_and_is_off_where_a_block_keeps_its_unit():
    asked = []

    def traced(answer):
        return lambda: asked.append(answer) or answer

    on, why = _choice(_auto(), [2048], traced=traced(False))
    assert not on and "not every checkpointed block is checkpointed inside its compiled graph" in why, why
    assert _choice(_auto(), [2048], traced=traced(True))[0] and asked == [False, True]
    assert not _choice(_auto(), [100], traced=traced(True))[0] and asked == [False, True]  # rows decided it first


def test_every_checkpoint_traced_asks_the_skeleton_as_the_build_does(tiny_models):
    """The skeleton's answer for the cases the options alone do not settle: fp16's loss scaler with weights trained
    outside the blocks keeps every block in an FSDP2 unit (parallel/fsdp.py, in_place_blocks)."""
    from qshard.build import skeleton
    from qshard.parallel.fsdp import every_checkpoint_traced

    def traced(cfg, world_size=1):
        planned = skeleton(cfg.validate(), tiny_models("llama"), world_size, torch.device("cpu"))
        return every_checkpoint_traced(planned.model, planned.blocks, world_size, cfg)

    assert traced(_auto())
    assert not traced(_auto(), world_size=2)
    scaled = _auto()
    scaled.train.precision, scaled.lora.modules_to_save = "fp16_mixed", ["lm_head"]
    assert not traced(scaled)
    scaled.train.precision = "bf16_mixed"  # no loss scaler: the blocks stay in place beside the trained head
    assert traced(scaled)
    assert not traced(_auto(activation_checkpointing=False))


@pytest.mark.parametrize("setting", [{}, {"ac_every": 2}, {"fp16": True}])
def test_every_checkpoint_traced_agrees_with_the_build(dist_env, tiny_models, monkeypatch, setting):
    """The skeleton's answer is what parallelize then does: every checkpointed block traced into its graph, or not."""
    from qshard.build import skeleton
    from qshard.parallel import fsdp

    made, real = [], fsdp.traced_blocks

    def spy(blocks, *args):
        made.append((blocks, real(blocks, *args)))
        return made[-1][1]

    monkeypatch.setattr(fsdp, "traced_blocks", spy)
    cfg = _config(compile=True, compile_backend="aot_eager", cuda_graphs=False, ac_every=setting.get("ac_every", 1))
    if setting.get("fp16"):
        cfg.train.precision, cfg.lora.modules_to_save = "fp16_mixed", ["lm_head"]
    cfg = cfg.validate()
    planned = skeleton(cfg, tiny_models("llama"), 1, torch.device("cpu"))
    expected = fsdp.every_checkpoint_traced(planned.model, planned.blocks, 1, cfg)
    try:
        build_model(cfg, dist_env, tiny_models("llama"))
    finally:
        torch._dynamo.reset()
    (blocks, traced), = made
    checkpointed = fsdp.checkpointed_blocks(blocks, cfg.parallel)
    assert expected == (len(traced) == len(checkpointed) > 0) and expected == (not setting.get("fp16"))


def test_a_setting_given_is_kept_and_auto_is_settled_in_the_config(caplog):
    assert _choice(_config(), [10]) == (True, "parallel.cuda_graphs true")
    assert _choice(_config(cuda_graphs=False), [2048]) == (False, "parallel.cuda_graphs false")
    assert not _auto().parallel.replays_graphs()  # not yet settled: off for code that builds without deciding
    cfg = _auto()
    with caplog.at_level("INFO", logger="qshard"):
        compile_mod.decide_cuda_graphs(cfg, GPU, 1, lambda: np.array([2048]), 5000, None, log_it=True, triton=True)
    assert cfg.parallel.cuda_graphs is True and cfg.parallel.replays_graphs()
    assert [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()] == [
        "parallel.cuda_graphs auto: on, blocks replayed as CUDA graphs (rows 100% full, padded to data.max_length "
        "2,048)"]
    caplog.clear()
    cfg = _auto()
    with caplog.at_level("INFO", logger="qshard"):  # on the CPU: parallel.compile's line says the blocks run eagerly
        compile_mod.decide_cuda_graphs(cfg, torch.device("cpu"), 1, lambda: np.array([2048]), 5000, None,
                                       log_it=True)
    assert cfg.parallel.cuda_graphs is False and not caplog.records


def test_train_decides_from_the_rows_the_micro_batches_left_and_the_model(tiny_models, tmp_path, monkeypatch):
    """What `qshard train` hands the decision: the training rows' lengths, the micro-batches the run has left (steps x
    grad_accum, less those of the checkpoint it resumes), and the model's answer on its blocks; after --auto-fit's
    settings (preflight), before the build."""
    import qshard.train.run as run_mod

    seen, order = [], []
    real = run_mod.decide_cuda_graphs

    def spy(cfg, device, world_size, lengths, micro_batches, traced, log_it):
        seen.append((lengths(), micro_batches, traced()))
        order.append("decide")
        real(cfg, device, world_size, lengths, micro_batches, traced, log_it)

    monkeypatch.setattr(run_mod, "decide_cuda_graphs", spy)
    for name in ("preflight", "_build"):
        original = getattr(run_mod, name)
        monkeypatch.setattr(run_mod, name, lambda *a, _o=original, _n=name, **k: order.append(_n) or _o(*a, **k))
    cfg = _config(tiny_models("llama"), tmp_path / "run", cuda_graphs="auto")
    cfg.train.max_steps, cfg.train.grad_accum = 3, 2
    run_training(cfg.validate())
    (lengths, micro_batches, traced), = seen
    assert micro_batches == 6 and traced and order == ["preflight", "decide", "_build"]
    assert len(lengths) > 6 and lengths.max() == 48 and lengths.mean() > 0.8 * 48  # rows packed up to max_length 48
    # Goes on from its checkpoint of step 3 (the run settled cfg's auto: asked again).
    cfg.train.max_steps, cfg.checkpoint.resume, cfg.parallel.cuda_graphs = 5, "auto", "auto"
    run_training(cfg.validate())
    assert seen[-1][1] == (5 - 3) * 2


def test_a_run_settles_auto_and_its_config_says_so_a_dry_run_leaves_it(tiny_models, tmp_path, capsys):
    """`qshard train` settles auto before building (off: on the CPU, and anywhere for a run of one micro-batch), and
    config.yaml records what ran; a dry run (no --auto-fit, perhaps not where the run will train) leaves it."""
    import yaml

    out = tmp_path / "run"
    cfg = _config(tiny_models("llama"), out, cuda_graphs="auto")
    cfg.train.max_steps = 1
    run_training(copy.deepcopy(cfg).validate(), dry_run=True)
    assert "cuda_graphs auto" in capsys.readouterr().out and not out.exists()
    run_training(cfg.validate())
    assert yaml.safe_load((out / "config.yaml").read_text())["parallel"]["cuda_graphs"] is False


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
            # graph for the blocks (they share it) and one for the loss's chunk (train/loss.py); evaluation, without
            # gradients, one more of each.
            assert not on or not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
            evaluated = variant == "accumulated_and_evaluated"
            assert not on or counters["stats"]["unique_graphs"] <= 2 * (1 + evaluated), dict(counters["stats"])
        finally:
            torch._dynamo.reset()
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[on] = [r["loss"] for r in records] + [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(losses[True]) == (6 if evaluated else 4), losses[True]  # 4 steps, with evaluations at 2 and 4
    assert losses[True] == pytest.approx(losses[False], rel=2e-2 if variant == "unpacked" else 1e-3)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_auto_turns_graphs_on_where_rows_are_full_and_trains_as_false_does(tiny_models, tmp_path, monkeypatch, caplog):
    """On a GPU, `auto` with rows that fill data.max_length replays the blocks as CUDA graphs (its log line, the run's
    config.yaml, no graph skipped) and trains as `false` does. The start-up rule's 200 or 1,000 micro-batches are
    lowered to this run's 4 (a tiny model's steps repay nothing anyway; the rule's own test is on the CPU)."""
    import yaml

    monkeypatch.setattr(compile_mod, "graph_min_micro_batches", lambda parallel: 4)
    model_dir = tiny_models("llama")
    rows = tmp_path / "rows.jsonl"  # every row exactly data.max_length tokens once tokenized and truncated
    rows.write_text("".join(json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 20}) + "\n"
                            for _ in range(16)))
    losses = {}
    for setting in ("auto", False):
        out = tmp_path / str(setting)
        cfg = _config(model_dir, out, cuda_graphs=setting)
        cfg.data.path, cfg.data.packing = str(rows), False
        counters = torch._dynamo.utils.counters
        counters.clear()
        try:
            with caplog.at_level("INFO", logger="qshard"):
                run_training(cfg.validate())
            assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        finally:
            torch._dynamo.reset()
        saved = yaml.safe_load((out / "config.yaml").read_text())["parallel"]["cuda_graphs"]
        assert saved is (setting == "auto"), saved
        losses[setting] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("parallel.cuda_graphs auto: on" in r.getMessage() for r in caplog.records)
    assert len(losses["auto"]) == 4 and losses["auto"] == pytest.approx(losses[False], rel=1e-3)
