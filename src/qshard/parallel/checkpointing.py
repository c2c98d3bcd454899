"""Activation checkpointing of every k-th transformer block, reentrant or not, keeping parameter names.

Non-reentrant: torch's composable `checkpoint` (hooks on the block, no wrapper module, so checkpoints,
exports and loading see the original names). Reentrant: torch.utils.checkpoint(use_reentrant=True) needs
the block's forward wrapped; checkpoint_wrapper would do it with a wrapper module that renames every
parameter, so the block's own transformers mechanism (GradientCheckpointingLayer: a flag and a checkpoint
function per layer) is used instead. It wraps `forward`, not `__call__`, so FSDP2's hooks stay outside the
checkpointed region and the recompute does not gather weights twice.
"""

from __future__ import annotations

import functools

import torch.nn as nn
import torch.utils.checkpoint
from torch.distributed._composable import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from qshard.config import ParallelConfig
from qshard.errors import QShardError


def checkpointed_blocks(blocks: list[nn.Module], p: ParallelConfig) -> list[nn.Module]:
    """Blocks 0, k, 2k, ... (k = parallel.ac_every), or none."""
    return blocks[:: p.ac_every] if p.activation_checkpointing else []


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module], p: ParallelConfig) -> None:
    chosen = checkpointed_blocks(blocks, p)
    if not chosen:
        return
    if not p.ac_reentrant:
        for block in chosen:
            checkpoint(block)
        return
    plain = sorted({type(b).__name__ for b in chosen if not isinstance(b, GradientCheckpointingLayer)})
    if plain:
        raise QShardError(
            f"parallel.ac_reentrant: blocks of class {', '.join(plain)} are not transformers "
            "GradientCheckpointingLayers, so they cannot be checkpointed reentrantly without a wrapper that "
            "renames their parameters; use parallel.ac_reentrant false"
        )
    for block in chosen:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    # A reentrant checkpoint computes parameter gradients only if one of its inputs requires grad; the
    # first block's input comes from frozen embeddings (LoRA, QLoRA), so make it require grad.
    model.enable_input_require_grads()
