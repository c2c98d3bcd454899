"""Precision modes: the dtypes of parameters, gradients and optimizer state, asserted on the tensors after
a real step at world size 1 (this process) and 2 (gloo), and fp16 overflow handling."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import device_batch, free_port, spawn

from qshard.config import Config, from_dict
from qshard.errors import QShardError
from qshard.precision import precision

# ShardedGradScaler's overflow flag becomes a replicated DTensor, with a warning qshard silences (pytest resets it).
pytestmark = pytest.mark.filterwarnings("ignore:Found a non-scalar tensor with numel=1")

MODES = ("fp32", "bf16", "bf16_mixed", "fp16_mixed")
# Documented in qshard/precision.py: (trainable params = grads = AdamW state, frozen unquantized weights).
EXPECTED = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16_mixed": (torch.float32, torch.bfloat16),
    "fp16_mixed": (torch.float32, torch.float16),
}


def _examples(n: int = 8, length: int = 12):
    from qshard.data import Example

    g = torch.Generator().manual_seed(0)
    return [Example(ids := torch.randint(3, 300, (length,), generator=g).tolist(), ids) for _ in range(n)]


def _config(model_dir, mode: str, train_type: str) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.train_type, cfg.train.precision = str(model_dir), train_type, mode
    cfg.train.micro_batch_size, cfg.train.max_steps, cfg.optim.lr = 1, 2, 1e-2
    return cfg.validate()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _dtypes_after_step(env, model_dir, mode: str, train_type: str) -> dict:
    """One real optimizer step, then the dtype of every stored tensor kind (local shards)."""
    from qshard.build import build_model
    from qshard.train.loop import Trainer

    model, _ = build_model(_config(model_dir, mode, train_type), env, model_dir)
    trainer = Trainer(_config(model_dir, mode, train_type), env, model, _examples(), [], pad_id=0)
    # fp16: a scale this random model's first step cannot overflow at (the default 2**16 can, and the
    # skipped step would leave no optimizer state to look at).
    trainer.scaler = precision(trainer.cfg).grad_scaler(env.device, init_scale=64.0)
    record = trainer.step(0)
    assert record["loss"] == record["loss"] and record["loss"] > 0  # finite
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Gradients are freed after the step: run one more backward to look at them.
    batch = device_batch(trainer, [0])
    trainer.scaler.scale(trainer.loss_sum(model, batch)).backward()
    state = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"]
    return {
        "params": {_local(p).dtype for p in trainable},
        "grads": {_local(p.grad).dtype for p in trainable},
        "optim": {_local(t).dtype for t in state},
        # Quantized storage is left out: under FSDP2 it is bytes in a float carrier, not weights of a dtype.
        "frozen": {_local(p).dtype for n, p in model.named_parameters() if not p.requires_grad
                   and p.is_floating_point() and not n.endswith(("packed", "absmax", "scale_zero"))},
        "inv_freq": {b.dtype for n, b in model.named_buffers() if n.endswith("inv_freq")},
        "optim_tensors": len(state),
    }


def _check(found: dict, mode: str) -> None:
    trained, frozen = EXPECTED[mode]
    assert found["params"] == found["grads"] == found["optim"] == {trained}, (mode, found)
    assert found["frozen"] <= {frozen}, (mode, found)  # empty in full fine-tuning
    assert found["inv_freq"] == {torch.float32}, (mode, found)  # rotary frequencies stay fp32 in every mode
    assert found["optim_tensors"] > 0  # the step was taken


def test_precision_dtypes_world_size_1(dist_env, tiny_models):
    """Full fine-tuning: embeddings, norms and head train too, so every parameter follows the mode
    (world size 2 below covers QLoRA's frozen weights)."""
    for mode in MODES:
        found = _dtypes_after_step(dist_env, tiny_models("llama"), mode, "full")
        _check(found, mode)
        assert not found["frozen"]



def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    results = {mode: _dtypes_after_step(env, model_dir, mode, "qlora") for mode in MODES}
    results["overflow"] = _overflow(env, model_dir)
    torch.save(results, f"{result_dir}/rank{rank}.pt")
    shutdown()


def _overflow(env, model_dir) -> dict:
    """fp16: a loss scale so large that the fp16 backward overflows. The step must be skipped on every rank
    (the overflow is detected in each rank's gradient shard and agreed on) and the scale halved."""
    from qshard.build import build_model
    from qshard.train.loop import Trainer

    cfg = _config(model_dir, "fp16_mixed", "qlora")
    model, _ = build_model(cfg, env, model_dir)
    trainer = Trainer(cfg, env, model, _examples(), [], pad_id=0)
    # Finite in fp32, inf once the fp16 backward sees it.
    trainer.scaler = precision(cfg).grad_scaler(env.device, init_scale=2.0**100)
    before = [_local(p).detach().clone() for p in trainer.params]
    record = trainer.step(0)
    unchanged = all(torch.equal(b, _local(p)) for b, p in zip(before, trainer.params, strict=True))
    after_skip = {"unchanged": unchanged, "optim_state": len(trainer.optimizer.state), "scale": record["loss_scale"]}
    trainer.scaler.update(new_scale=1024.0)
    record = trainer.step(1)
    moved = not all(torch.equal(b, _local(p)) for b, p in zip(before, trainer.params, strict=True))
    return {
        **after_skip,
        "next_moved": moved,
        "next_scale": record["loss_scale"],
        "scaler_state": trainer.scaler.state_dict(),
    }


@pytest.fixture(scope="module")
def world_size_2(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("prec2")
    spawn(_worker, (2, free_port(), str(tiny_models("llama")), str(out)))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", MODES)
def test_precision_dtypes_world_size_2(world_size_2, mode):
    for rank_results in world_size_2:
        _check(rank_results[mode], mode)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(world_size_2):
    for res in (r["overflow"] for r in world_size_2):
        assert res["unchanged"] and res["optim_state"] == 0, res  # skipped on both ranks
        assert res["scale"] == 2.0**99, res
        assert res["next_moved"] and res["next_scale"] == 1024.0, res  # a finite step goes through
        assert res["scaler_state"]["scale"] == 1024.0  # what a checkpoint's trainer_state.json keeps


# ---------------------------------------------------------------------------------------------------- config


def test_precision_is_train_precision_with_bf16_mixed_by_default():
    def mode(tree):
        return precision(from_dict(tree).validate()).name

    assert mode({"train": {"precision": "fp32"}}) == "fp32"
    assert mode({}) == "bf16_mixed"
    assert mode({"train": {"precision": "bf16"}}) == "bf16"
    assert mode({"train": {"precision": "fp16_mixed"}}) == "fp16_mixed"
    with pytest.raises(QShardError, match="model.dtype: removed; use train.precision"):  # its older spelling
        from_dict({"model": {"dtype": "float32"}, "train": {"precision": "bf16_mixed"}}).validate()


def test_resume_restores_the_loss_scale(dist_env, tiny_models):
    """trainer_state.json's grad_scaler (JSON, as a checkpoint stores it) goes back into the scaler; a
    checkpoint of another mode has none, and fp16 then starts from the initial scale."""
    import json

    from qshard.build import build_model
    from qshard.train.loop import Trainer

    cfg = _config(tiny_models("llama"), "fp16_mixed", "qlora")
    model, _ = build_model(cfg, dist_env, cfg.model.path)
    trainer = Trainer(cfg, dist_env, model, _examples(), [], pad_id=0)
    trainer.step(0)
    state = json.loads(
        json.dumps(
            {
                "scheduler": trainer.scheduler.state_dict(),
                "grad_scaler": {**trainer.scaler.state_dict(), "scale": 512.0},
            }
        )
    )
    fresh = Trainer(cfg, dist_env, model, _examples(), [], pad_id=0)
    fresh.restore(state)
    assert fresh.scaler.get_scale() == 512.0 and fresh.scheduler.last_epoch == 1
    other = Trainer(cfg, dist_env, model, _examples(), [], pad_id=0)
    other.restore({"scheduler": state["scheduler"], "grad_scaler": {}})
    assert other.scaler.get_scale() == 2.0**16


def test_fp16_step_with_the_optimizer_cuda_would_get(dist_env, tiny_models):
    """On CUDA the optimizer is normally fused AdamW, which cannot take ShardedGradScaler's 1-element
    overflow flag (a real failure on the H200). The kernel choice for a CUDA device under loss scaling must
    still step; fused AdamW also runs on CPU, so the CUDA choice is exercised here on CPU tensors."""
    from qshard.build import build_model
    from qshard.train.host_step import build_update
    from qshard.train.loop import Trainer
    from qshard.train.optim import build_optimizer

    cfg = _config(tiny_models("llama"), "fp16_mixed", "qlora")
    model, _ = build_model(cfg, dist_env, cfg.model.path)
    trainer = Trainer(cfg, dist_env, model, _examples(), [], pad_id=0)
    cuda = torch.device("cuda")
    assert build_optimizer(model, cfg.optim, cuda).defaults["fused"]  # bf16 modes keep the fused kernel
    trainer.optimizer = build_optimizer(model, cfg.optim, cuda, loss_scaling=True)
    trainer.update = build_update(cfg, model, trainer.optimizer, dist_env)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    trainer.scaler = precision(cfg).grad_scaler(dist_env.device, init_scale=64.0)
    before = [_local(p).detach().clone() for p in trainer.params]
    record = trainer.step(0)
    assert record["loss"] > 0 and len(trainer.optimizer.state) > 0
    assert not all(torch.equal(b, _local(p)) for b, p in zip(before, trainer.params, strict=True))
