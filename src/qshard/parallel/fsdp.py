"""Apply activation checkpointing and FSDP2 to a model skeleton (still on meta), block by block."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from qshard.config import Config, reshard_after_forward
from qshard.parallel.checkpointing import apply_activation_checkpointing
from qshard.parallel.compile import compile_blocks
from qshard.parallel.mesh import local_piece, shard_placements
from qshard.parallel.offload import offload_policy, offload_quantized_storage
from qshard.precision import precision
from qshard.quant import QUANTIZED_LINEARS


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


def shard_as_dtensor_buffers(layer: nn.Module, mesh: DeviceMesh) -> None:
    """Move a quantized layer's codes and scales (NF4 or HQQ) out of FSDP2's reach into dim-0-sharded DTensor buffers:
    each rank still stores 1/shard-group of them and gathers them, still 4-bit, when the layer runs.
    On a 2-D mesh (hybrid, none) they are replicated across the first dim, as FSDP2 places its params."""
    placements = shard_placements(mesh)
    # The integer parameters are the quantized storage (codes and scales); a float bias stays with FSDP2.
    for name in [n for n, p in layer.named_parameters(recurse=False) if not p.is_floating_point()]:
        param = layer._parameters.pop(name)
        piece = local_piece(param.data, mesh, placements)
        sharded = DTensor.from_local(piece, mesh, placements, run_check=False, shape=param.shape,
                                     stride=param.stride())
        layer.register_buffer(name, sharded)


def compute_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device for the mesh's device type (init_distributed has made it the current CUDA device)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def quant_sharding(cfg: Config, mesh: DeviceMesh) -> str:
    if cfg.parallel.quant_sharding != "auto":
        return cfg.parallel.quant_sharding
    return "fsdp" if fsdp_accepts_integer_params(mesh) else "dtensor"


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: Config) -> str:
    """Checkpointing first, then compilation, then one FSDP unit per block, the embedding and the head, then
    the root.
    Returns how the quantized storage is sharded ("fsdp" or "dtensor")."""
    mp = precision(cfg).mp_policy()
    how = quant_sharding(cfg, mesh)
    if how == "dtensor":
        for module in model.modules():
            if isinstance(module, QUANTIZED_LINEARS):
                shard_as_dtensor_buffers(module, mesh)
        if cfg.parallel.cpu_offload:
            # FSDP2's CPUOffloadPolicy moves only what FSDP2 manages: the quantized storage, the bulk of the
            # model, goes to host memory here (before materialization, so it never exists on the GPU whole).
            offload_quantized_storage(model, blocks, compute_device(mesh))
    apply_activation_checkpointing(model, blocks, cfg.parallel)
    if cfg.parallel.compile:
        compile_blocks(blocks, cfg.parallel.compile_backend)
    offload = offload_policy(cfg)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keeping them saves an all-gather.
        reshard = reshard_after_forward(cfg) and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is not embed.weight:  # a tied pair must stay in one unit (the root)
        # Units of their own, so neither holds a gathered copy for the whole step: the embedding is needed
        # in its forward only (and in backward only if it trains); the head stays gathered from forward
        # into backward, which begins with it, and the chunked loss reads its weight (train/loss.py).
        fully_shard(embed, mesh=mesh, mp_policy=mp, reshard_after_forward=True, offload_policy=offload)
        fully_shard(head, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    # The root (what is left: final norm, a tied embedding/head) is needed again at once by backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    return how


def reshard_all(model: nn.Module) -> None:
    """Free every gathered weight, leaving only the shards registered (e.g. after a forward-only pass)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
