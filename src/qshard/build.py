"""From a model directory to a sharded, loaded, trainable model, in the order FSDP2 wants:
skeleton on meta -> module swaps -> checkpoint check -> checkpointing + fully_shard -> materialize
this rank's shards -> stream weights -> initialize adapters."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.nn as nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qshard import loading, models
from qshard.config import Config
from qshard.errors import QShardError
from qshard.models import SwapReport
from qshard.parallel.distributed import DistEnv
from qshard.parallel.fsdp import parallelize

log = logging.getLogger("qshard")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise QShardError(f"{model_dir}: cannot load its tokenizer ({exc})") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise QShardError(f"{model_dir}: the tokenizer defines neither a pad nor an eos token")
    return tokenizer


def build_model(cfg: Config, env: DistEnv, model_dir: str | Path) -> tuple[nn.Module, SwapReport]:
    """Every check that can fail on user input runs before the first weight is read."""
    hf_config = models.load_hf_config(model_dir)
    model = models.build_skeleton(hf_config, cfg)
    blocks = models.find_blocks(model, cfg.model.block_class)
    report = models.prepare_modules(model, blocks, cfg)
    ckpt = loading.Checkpoint(model_dir)
    loading.check_checkpoint(ckpt, model)
    if report.kept:
        log.warning("%d block linear(s) kept in %s: in_features not a multiple of quant.blocksize (%s, ...)",
                    len(report.kept), cfg.model.dtype, report.kept[0])
    how = parallelize(model, blocks, env.mesh, cfg)
    if report.quantized and env.is_main:
        log.info("NF4 storage sharded by %s", "FSDP2" if how == "fsdp" else "DTensor buffers (this torch's FSDP2 "
                 "refuses integer parameters)")
    model.to_empty(device=env.device)
    loading.load_weights(model, ckpt, env.device)
    loading.init_adapters(model, cfg.train.seed)
    models.rebuild_buffers(model)
    return model, report


def describe(model: nn.Module, report: SwapReport, cfg: Config) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    # FSDP2 subclasses the model's class as FSDP<Name>; report the model's own class.
    name = next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    parts = [name, f"train_type={cfg.train.train_type}", f"{trainable:,} trainable params"]
    if report.quantized:
        parts.append(f"{len(report.quantized)} NF4 linears")
    if report.adapted:
        parts.append(f"LoRA r={cfg.lora.rank} on {len(report.adapted)} linears")
    parts.append(f"{total_params:,} stored elements")
    return ", ".join(parts)
