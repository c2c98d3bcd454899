"""NaN and infinity: in the frozen weights a model is loaded from, in a training step's loss or gradients
(`train.nan_policy`), in the held-out loss. Never a run that finishes looking sound with NaN weights.

Every run goes through `qshard.cli.main` (argv to exit code and stderr, as the command): in this process,
the two-rank one in spawned ranks."""

from __future__ import annotations

import contextlib
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import run_on_ranks
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qshard import cli
from qshard.checkpoint import STATE_FILE, complete_checkpoints

DEMO_TRAIN = resources.files("qshard") / "demo_data" / "train.jsonl"
# Adapters moved by a learning rate this large hold values no fp32 forward survives: step 1 starts from the
# base model (LoRA's B is zero) and is finite, every later step's loss is NaN.
HUGE_LR = "1e30"


def run(capsys, model_dir: Path, out: Path, *extra: str) -> tuple[int, str]:
    args = ["train", "--model", str(model_dir), "--data", str(DEMO_TRAIN), "--output-dir", str(out),
            "--max-length", "32", "--train.precision", "fp32", "--data.eval_fraction", "0", *extra]
    capsys.readouterr()
    code = cli.main(args)
    return code, capsys.readouterr().err


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("qshard: error")]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved_steps(out: Path) -> list[int]:
    return [int(p.name.split("-")[-1]) for p in complete_checkpoints(out / "checkpoints")]


@contextlib.contextmanager
def nan_embeddings(when):
    """The embedding output becomes NaN at the embedding's calls (counted from 1, training and held-out alike)
    for which `when(call, module)` holds: what an overflow in one batch's forward leaves, without touching
    qshard's code (a global module hook of torch's)."""
    handle = _hook_embeddings(when)
    try:
        yield
    finally:
        handle.remove()


def _hook_embeddings(when):
    """nan_embeddings' hook, installed until its handle is removed."""
    calls = 0

    def hook(module, args, output):
        nonlocal calls
        if not isinstance(module, nn.Embedding):
            return None
        calls += 1
        return output * float("nan") if when(calls, module) else None

    return nn.modules.module.register_module_forward_hook(hook)


# --------------------------------------------------------------------------------------------- frozen weights


def _damaged_copy(tiny_models, dest: Path, edit) -> Path:
    shutil.copytree(tiny_models("llama"), dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    (dest / "model.safetensors").unlink()
    # Two shards, so that the message names the file that holds the tensor.
    names = sorted(tensors)
    weight_map = {}
    for i, half in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        fname = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in half}, dest / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, fname))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def _nan_in_quantized(tensors):
    """12 NaN in a block linear that qlora quantizes to NF4 (its block's absmax would carry them unseen)."""
    tensors["model.layers.1.mlp.up_proj.weight"].view(-1)[100:112] = float("nan")


def _inf_in_embedding(tensors):
    """An infinity in the embedding, which is stored as it is (no quantization), and in a norm's weight."""
    tensors["model.embed_tokens.weight"][3, 5] = float("inf")
    tensors["model.layers.0.input_layernorm.weight"][0] = float("-inf")


@pytest.mark.parametrize("edit,needle", [
    (_nan_in_quantized, "model.layers.1.mlp.up_proj.weight in {dir}/model-00002-of-00002.safetensors holds 12 NaN "
                        "values:"),
    (_inf_in_embedding, "model.embed_tokens.weight in {dir}/model-00001-of-00002.safetensors holds 1 infinite "
                        "values (1 more tensor(s) hold some too):"),
], ids=["nan-nf4", "inf-embedding"])
def test_non_finite_frozen_weight_is_one_error_naming_tensor_and_file(tiny_models, tmp_path, capsys, edit, needle):
    model_dir = _damaged_copy(tiny_models, tmp_path / "model", edit)
    out = tmp_path / "out"
    code, err = run(capsys, model_dir, out, "--max-steps", "1")
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and needle.format(dir=model_dir) in lines[0], err
    assert not out.exists()  # found while loading, before the output directory is made


def test_broadcast_loading_names_the_tensor_too(tiny_models, tmp_path, dist_env):
    """Under `model.load_mode: broadcast` (rank 0 reads and sends each tensor; a world of one here) the bad
    tensor is counted from rank 0's files again and named the same way."""
    from qshard import models
    from qshard.config import Config
    from qshard.errors import QShardError
    from qshard.hf_config import load_hf_config
    from qshard.loading import BroadcastSource, check_checkpoint, load_weights

    model_dir = _damaged_copy(tiny_models, tmp_path / "model", _nan_in_quantized)
    model = models.build_skeleton(load_hf_config(model_dir), Config()).to_empty(device="cpu")
    source = BroadcastSource(model_dir, dist_env.is_main, dist_env.device)
    check_checkpoint(source, model)
    with pytest.raises(QShardError, match=r"^model\.layers\.1\.mlp\.up_proj\.weight in .*/model-00002-of-00002"
                                          r"\.safetensors holds 12 NaN values:"):
        load_weights(model, source, dist_env.device)


# --------------------------------------------------------------------------------------------- training steps


def test_nan_loss_ends_the_run_naming_the_step_before_its_metrics_and_checkpoint(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run(capsys, tiny_models("llama"), out, "--max-steps", "4", "--lr", HUGE_LR, "--save-every", "1",
                    "--checkpoint.keep_last", "4")
    assert code == 2, err
    assert [line.split(";")[0] for line in error_lines(err)] == ["qshard: error: step 2: the loss is nan"], err
    assert [r["step"] for r in metrics(out)] == [1]  # step 2 never looked done
    assert saved_steps(out) == [1]
    assert not (out / "summary.json").exists() and not (out / "adapter").exists()


def _state(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: the adapters (`model.`) and AdamW's state (`optim.`)."""
    flat = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=True)
    found = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            found[prefix] = value

    walk("", state)
    return found


def test_skip_step_leaves_the_weights_and_optimizer_state_unchanged(tiny_models, tmp_path, capsys):
    """A NaN in step 2's forward: the step is recorded as skipped, the adapters and AdamW's state saved after
    it equal those saved before it, and the run goes on to finish."""
    out = tmp_path / "out"
    with nan_embeddings(lambda call, module: call == 2):
        code, err = run(capsys, tiny_models("llama"), out, "--max-steps", "3", "--train.nan_policy", "skip_step",
                        "--save-every", "1", "--checkpoint.keep_last", "3")
    assert code == 0, err
    assert "step 2: the loss is nan and the gradient norm nan: the step's update was skipped" in err, err
    assert [(r["step"], r["skipped"]) for r in metrics(out)] == [(1, False), (2, True), (3, False)]
    assert (out / "summary.json").exists()
    first, second, third = (_state(c, tmp_path) for c in complete_checkpoints(out / "checkpoints"))
    assert any(k.startswith(".model.") for k in first) and any(k.startswith(".optim.") for k in first), first
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # no parameter, no optimizer state moved
    assert not all(torch.equal(second[k], third[k]) for k in first)  # the next step trained
    # The learning-rate schedule counts the skipped step.
    steps = [json.loads((c / STATE_FILE).read_text())["scheduler"]["last_epoch"]
             for c in complete_checkpoints(out / "checkpoints")]
    assert steps == [1, 2, 3]


def _nan_on_rank_1_at_step_2(rank: int) -> None:
    """In rank 1 only, for the rest of the process: NaN out of the embedding's second call, step 2's forward
    (the run evaluates nothing)."""
    if rank == 1:
        _hook_embeddings(lambda call, module: call == 2)


def test_nan_on_one_rank_is_skipped_on_every_rank(tiny_models, tmp_path):
    """Two ranks (gloo, set up as `--nproc 2` sets them up), a NaN in rank 1's forward of step 2 only: both ranks
    leave the update out, so the adapters and AdamW's state are those of step 1, and the run finishes."""
    out = tmp_path / "out"
    args = ["train", "--model", str(tiny_models("llama")), "--data", str(DEMO_TRAIN), "--output-dir", str(out),
            "--max-length", "32", "--train.precision", "fp32", "--data.eval_fraction", "0", "--max-steps", "3",
            "--nproc", "2", "--train.nan_policy", "skip_step", "--save-every", "1", "--checkpoint.keep_last", "3"]
    ranks = run_on_ranks({"run": args}, before=_nan_on_rank_1_at_step_2)["run"]
    for rank, run in enumerate(ranks):
        assert run.code == 0, (rank, run.stderr)
    stderr = "".join(run.stderr for run in ranks)  # what the launcher's stderr would hold
    assert stderr.count("step 2: the loss is nan") == 1, stderr  # rank 0's warning only
    assert [(r["step"], r["skipped"]) for r in metrics(out)] == [(1, False), (2, True), (3, False)]
    first, second, third = (_state(c, tmp_path) for c in complete_checkpoints(out / "checkpoints"))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(second[k], third[k]) for k in first)


def test_skip_step_stops_after_too_many_skips_in_a_row(tiny_models, tmp_path, capsys):
    """Adapters made NaN-producing at step 1: skipping cannot help, and the run stops after the limit."""
    from qshard.train.nan_policy import MAX_SKIPS_IN_A_ROW

    out = tmp_path / "out"
    code, err = run(capsys, tiny_models("llama"), out, "--max-steps", str(MAX_SKIPS_IN_A_ROW + 4), "--lr", HUGE_LR,
                    "--train.nan_policy", "skip_step")
    last = MAX_SKIPS_IN_A_ROW + 1
    assert code == 2, err
    assert len(error_lines(err)) == 1, err
    assert error_lines(err)[0].startswith(
        f"qshard: error: step {last}: {MAX_SKIPS_IN_A_ROW} steps in a row (from step 2) had a loss"), err
    assert [r["skipped"] for r in metrics(out)] == [False] + [True] * (MAX_SKIPS_IN_A_ROW - 1)
    assert not (out / "summary.json").exists()


# --------------------------------------------------------------------------------------------- held-out loss


def test_nan_held_out_loss_is_an_error(tiny_models, tmp_path, capsys):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(DEMO_TRAIN.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "out"
    with nan_embeddings(lambda call, module: not module.training):
        code, err = run(capsys, tiny_models("llama"), out, "--max-steps", "2", "--eval-data", str(eval_data))
    assert code == 2, err
    assert [line.split(";")[0] for line in error_lines(err)] == [
        "qshard: error: the held-out loss before training is nan"], err
    assert not (out / "summary.json").exists()


# --------------------------------------------------------------------------------------------- fp16's own skips


@pytest.mark.filterwarnings("ignore:Found a non-scalar tensor with numel=1",
                            "ignore:Detected call of `lr_scheduler.step")
@pytest.mark.parametrize("policy", ["error", "skip_step"])
def test_fp16_overflow_is_a_recorded_skip_under_either_policy(tiny_models, dist_env, policy):
    """fp16's loss scaler skips a step whose scaled gradients overflow and halves its scale: not an error under
    `error`, the same skip under `skip_step` (which leaves the update out itself), recorded as skipped."""
    from qshard.build import build_model
    from qshard.config import Config
    from qshard.data import Example
    from qshard.precision import precision
    from qshard.train.loop import Trainer

    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.nan_policy = str(tiny_models("llama")), "fp16_mixed", policy
    cfg.train.max_steps = 2
    cfg = cfg.validate()
    model, _ = build_model(cfg, dist_env, cfg.model.path)
    examples = [Example(list(range(3, 15)), list(range(3, 15)))] * 4
    trainer = Trainer(cfg, dist_env, model, examples, [], pad_id=0)
    trainer.scaler = precision(cfg).grad_scaler(dist_env.device, init_scale=2.0**100)  # finite in fp32 only
    before = [p.detach().clone() for p in trainer.params]
    record = trainer.step(0)
    assert record["skipped"] and record["loss_scale"] == 2.0**99, record
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.params, strict=True))
    assert not trainer.optimizer.state
    trainer.scaler.update(new_scale=1024.0)
    record = trainer.step(1)
    assert not record["skipped"] and trainer.optimizer.state, record
