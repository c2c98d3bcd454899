"""Apply activation checkpointing and FSDP2 to a model skeleton (still on meta), block by block."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from qshard.config import Config
from qshard.models import DTYPES


def mixed_precision(cfg: Config) -> MixedPrecisionPolicy:
    """Compute in the model dtype (bf16 by default); reduce gradients in fp32 so that summing many
    ranks' contributions loses nothing. Trainable params are stored in fp32 (the master copy); FSDP2
    casts only floating params, so NF4 codes and scales pass through untouched."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.model.dtype], reduce_dtype=torch.float32)


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: Config) -> None:
    """Checkpointing first, then one FSDP unit per block, then the root (embeddings, final norm, head)."""
    mp = mixed_precision(cfg)
    for block in blocks:
        if cfg.parallel.activation_checkpointing:
            # The composable API keeps parameter names unchanged (a wrapper module would prefix them).
            checkpoint(block)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keeping them saves an all-gather.
        reshard = cfg.parallel.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
