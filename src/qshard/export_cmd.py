"""`qshard export adapter|merged`: rebuild a run's model from its base checkpoint, load the trained
weights from one of its checkpoints, and write a PEFT adapter or a merged Hugging Face model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qshard import checkpoint, export
from qshard import config as config_mod
from qshard.build import build_model, local_model_dir
from qshard.errors import QShardError
from qshard.parallel.distributed import init_distributed, shutdown
from qshard.train.run import base_fingerprint, base_model_name

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
    # How the run was sharded or offloaded does not matter to reading its weights back at this world size
    # (a hybrid run's replica count need not divide it).
    cfg.parallel.sharding, cfg.parallel.replicate_degree, cfg.parallel.cpu_offload = "full", 0, False
    out = out or run_dir / ("adapter" if kind == "adapter" else "merged")
    checkpoint.check_compatible(ckpt, state, cfg, base_fingerprint(cfg))
    if kind == "merged" and cfg.model.path is None:
        raise QShardError(f"{ckpt}: a model.shape run has no model directory to take a merged model's config and "
                          "tokenizer from; export the adapter instead")
    if kind == "adapter" and cfg.train.train_type in ("full", "llama_pro"):
        raise QShardError(f"{ckpt}: a {cfg.train.train_type} run has no adapter; use `qshard export merged`")
    env = init_distributed()
    try:
        model, report = build_model(cfg, env, local_model_dir(cfg, env))
        checkpoint.load(ckpt, model, optimizer=None)
        if kind == "adapter":
            tensors = export.gather_lora(model)
            if env.is_main:
                export.write_peft_adapter(out, tensors, cfg.lora, export.target_modules(model), base_model_name(cfg))
        else:
            weights = export.model_weights(model, torch.bfloat16, merge_adapters=True)
            export.write_merged(out, weights, Path(cfg.model.path), env.is_main, int(max_shard_gib * 2**30),
                                torch.bfloat16)
        if env.is_main:
            log.info("exported %s from %s to %s", kind, ckpt, out)
        return out
    finally:
        shutdown()
