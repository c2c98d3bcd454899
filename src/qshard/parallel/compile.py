"""torch.compile for the transformer blocks.

Only each block's `forward` is compiled, not its `__call__`: FSDP2's hooks (all-gather, reshard) keep
running eagerly around the compiled graph, exactly as without compilation. Blocks of one class share one
compiled graph (modules are inlined, so their parameters are graph inputs rather than constants baked
into it). Activation checkpointing is traced into the graph of the blocks parallelize names
(parallel/checkpointing.py: traced_checkpoint); elsewhere its hooks run around the compiled forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qshard.parallel.checkpointing import traced_checkpoint

# Inductor's options for the blocks. Combo kernels launch independent small kernels of a graph as one (the
# casts of a block's fp32 LoRA weights to bf16, for one): fewer launches, where the step is bound by the host's.
INDUCTOR_OPTIONS = {"combo_kernels": True}


def compile_blocks(
    blocks: list[nn.Module], backend: str, checkpointed: list[nn.Module], save_projections: bool = False
) -> None:
    """Compile each block's forward; those in `checkpointed` with the checkpoint traced into the graph
    (keeping the outputs of narrowing projections with `save_projections`)."""
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    chosen = {id(b) for b in checkpointed}
    for block in blocks:
        forward = traced_checkpoint(block.forward, save_projections) if id(block) in chosen else block.forward
        block.forward = torch.compile(forward, backend=backend, options=options)
