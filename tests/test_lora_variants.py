"""LoRA variants: rsLoRA, LoRA+ and PiSSA/OLoRA initialization. Each trains a tiny Llama in this process, is
exported, and loads in peft on the original base with the logits qshard computes; LoRA+ and PiSSA resume exactly."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from qshard import export
from qshard.config import Config
from qshard.train.optim import build_optimizer, build_scheduler, lora_plus_params
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"
IDS = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    """The first 16 held-out examples: no test here asserts a held-out loss."""
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join((DEMO / "eval.jsonl").read_text().splitlines(keepends=True)[:16]))
    return path


def _config(model_dir, out, eval_data, train_type="lora", **lora) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision, cfg.train.train_type = str(model_dir), "fp32", train_type
    cfg.data.path, cfg.data.eval_path, cfg.data.max_length = str(DEMO / "train.jsonl"), str(eval_data), 40
    cfg.train.max_steps, cfg.train.micro_batch_size, cfg.optim.lr = 4, 2, 5e-3
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    cfg.checkpoint.every_steps, cfg.checkpoint.async_save = 2, False
    cfg.output.dir = str(out)
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    return cfg.validate()


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resumed_losses(cfg: Config, out, dist_env) -> list[float]:
    """The losses of steps 3-4 of `cfg`'s run, resumed from its step-2 checkpoint into a directory of its own."""
    again = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(out)),
                                checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(_checkpoint(cfg, 2))))
    train(again, dist_env)
    return _losses(out)


def _checkpoint(cfg: Config, step: int) -> Path:
    return Path(cfg.output.dir) / "checkpoints" / f"step-{step:08d}"


def _peft_on_original_base(model_dir, adapter_dir):
    """transformers' model from the base model directory itself, with the exported adapter loaded by peft."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapter_dir).eval()


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits.float()


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _check_merged(model, model_dir, ours, tmp_path, bound):
    """The merged export, loaded by transformers, computes what the trained model does."""
    weights = export.model_weights(model, torch.float32, merge_adapters=True)
    export.write_merged(tmp_path / "merged", weights, model_dir, is_main=True, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert _relative_error(ours, _logits(merged)) <= bound


# ---------------------------------------------------------------------------------------------------------------
# rsLoRA and LoRA+ in one run.


def test_rslora_and_lora_plus_export_to_peft_and_resume_exactly(tiny_models, tmp_path, eval_data, dist_env):
    model_dir = tiny_models("llama", num_hidden_layers=1)
    cfg = _config(model_dir, tmp_path / "run", eval_data, use_rslora=True, plus_lr_ratio=16.0)
    result = train(cfg, dist_env)
    model = result.model

    # rsLoRA: the adapter says so, and peft on the original base computes what qshard does (alpha/sqrt(r) = 4,
    # where alpha/r would be 2).
    adapter_config = json.loads((result.out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["use_rslora"] is True and adapter_config["r"] == 4
    ours = _logits(model)
    twin = _peft_on_original_base(model_dir, result.out / "adapter")
    assert _relative_error(ours, _logits(twin)) <= 1e-5
    with twin.disable_adapter():
        assert _relative_error(ours, _logits(twin)) > 1e-3
    _check_merged(model, model_dir, ours, tmp_path, 1e-5)

    # LoRA+: every B factor, and only those, in groups of their own at 16x the lr, after a scheduler step too.
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"), plus_lr_ratio=cfg.lora.plus_lr_ratio)
    b_factors = {id(p) for n, p in model.named_parameters() if n.endswith("lora_B")}
    assert lora_plus_params(model) == b_factors and len(b_factors) == 7
    scheduler = build_scheduler(optimizer, 10, cfg.optim)
    optimizer.step()
    scheduler.step()
    lrs = [(g["lr"], {id(p) for p in g["params"]}) for g in optimizer.param_groups]
    assert len(lrs) == 2 and lrs[1][1] == b_factors and not lrs[0][1] & b_factors
    assert lrs[0][0] < cfg.optim.lr and lrs[1][0] == pytest.approx(16 * lrs[0][0])

    # Resumed from step 2 (optimizer state in its groups, schedule), steps 3-4 are the same, bit for bit.
    assert _resumed_losses(cfg, tmp_path / "resumed", dist_env) == _losses(result.out)[2:]
