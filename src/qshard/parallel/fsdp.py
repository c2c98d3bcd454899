"""Apply activation checkpointing and FSDP2 to a model skeleton (still on meta), block by block."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from qshard.config import Config
from qshard.models import DTYPES
from qshard.quant import NF4Linear


def mixed_precision(cfg: Config) -> MixedPrecisionPolicy:
    """Compute in the model dtype (bf16 by default); reduce gradients in fp32 so that summing many
    ranks' contributions loses nothing. Trainable params are stored in fp32 (the master copy); FSDP2
    casts only floating params, so NF4 codes and scales pass through untouched."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.model.dtype], reduce_dtype=torch.float32)


def fsdp_accepts_integer_params(mesh: DeviceMesh) -> bool:
    """Whether this torch's FSDP2 can manage a frozen integer parameter (older releases try to make
    every sharded parameter require grad, which integer tensors cannot). Probed on a meta module."""
    probe = nn.Module()
    probe.codes = nn.Parameter(torch.empty(mesh.size(), 2, dtype=torch.uint8, device="meta"), requires_grad=False)
    try:
        fully_shard(probe, mesh=mesh)
    except RuntimeError:
        return False
    return True


def shard_as_dtensor_buffers(layer: NF4Linear, mesh: DeviceMesh) -> None:
    """Move an NF4 layer's codes and scales out of FSDP2's reach into dim-0-sharded DTensor buffers:
    each rank still stores 1/world of them and gathers them, still 4-bit, when the layer runs."""
    for name in ("packed", "absmax"):
        param = layer._parameters.pop(name)
        local = torch.chunk(param.data, mesh.size(), dim=0)
        index = mesh.get_local_rank()
        piece = local[index] if index < len(local) else param.data[:0]
        sharded = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                     stride=param.stride())
        layer.register_buffer(name, sharded)


def quant_sharding(cfg: Config, mesh: DeviceMesh) -> str:
    if cfg.parallel.quant_sharding != "auto":
        return cfg.parallel.quant_sharding
    return "fsdp" if fsdp_accepts_integer_params(mesh) else "dtensor"


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: Config) -> str:
    """Checkpointing first, then one FSDP unit per block, then the root (embeddings, final norm, head).
    Returns how the quantized storage is sharded ("fsdp" or "dtensor")."""
    mp = mixed_precision(cfg)
    how = quant_sharding(cfg, mesh)
    if how == "dtensor":
        for module in model.modules():
            if isinstance(module, NF4Linear):
                shard_as_dtensor_buffers(module, mesh)
    for block in blocks:
        if cfg.parallel.activation_checkpointing:
            # The composable API keeps parameter names unchanged (a wrapper module would prefix them).
            checkpoint(block)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keeping them saves an all-gather.
        reshard = cfg.parallel.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    return how


def reshard_all(model: nn.Module) -> None:
    """Free every gathered weight, leaving only the shards registered (e.g. after a forward-only pass)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
