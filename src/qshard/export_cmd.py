"""`qshard export adapter|merged`: rebuild a run's model from its base checkpoint, load the trained
weights from one of its checkpoints, and write a PEFT adapter or a merged Hugging Face model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qshard import checkpoint, export
from qshard import config as config_mod
from qshard.build import build_model
from qshard.errors import QShardError
from qshard.parallel.distributed import init_distributed, shutdown

log = logging.getLogger("qshard")


def find_checkpoint(run_dir: Path, explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit)
        checkpoint.read_state(path)
        return path
    if not run_dir.is_dir():
        raise QShardError(f"--run: {run_dir} is not a directory")
    latest = checkpoint.find_latest(run_dir / "checkpoints")
    if latest is None:
        raise QShardError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    return latest


def run_export(kind: str, run_dir: Path, ckpt_arg: str | None, out: Path | None, max_shard_gib: float) -> Path:
    ckpt = find_checkpoint(run_dir, ckpt_arg)
    state = checkpoint.read_state(ckpt)
    cfg = config_mod.resolve(str(ckpt / "config.yaml"), [])
    out = out or run_dir / ("adapter" if kind == "adapter" else "merged")
    checkpoint.check_compatible(ckpt, state, cfg, checkpoint.base_fingerprint(cfg.model.path))
    if kind == "adapter" and cfg.train.train_type == "full":
        raise QShardError(f"{ckpt}: a full fine-tuning run has no adapter; use `qshard export merged`")
    env = init_distributed()
    try:
        model, report = build_model(cfg, env, cfg.model.path)
        checkpoint.load(ckpt, model, optimizer=None)
        if kind == "adapter":
            tensors = export.gather_lora(model)
            if env.is_main:
                base = str(Path(cfg.model.path).resolve())
                export.write_peft_adapter(out, tensors, cfg.lora, export.target_modules(model), base)
        else:
            weights = export.model_weights(model, torch.bfloat16, merge_adapters=True)
            export.write_merged(out, weights, Path(cfg.model.path), env.is_main, int(max_shard_gib * 2**30),
                                torch.bfloat16)
        if env.is_main:
            log.info("exported %s from %s to %s", kind, ckpt, out)
        return out
    finally:
        shutdown()
