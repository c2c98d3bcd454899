"""The data-parallel device mesh of each sharding strategy, and where a rank's piece of a full tensor lies.

full / grad_op: a 1-D mesh, everything sharded over all ranks.
none:           a 2-D mesh (replicate = world, shard = 1): FSDP2's HSDP with nothing to shard, i.e. every
                rank holds every weight and gradients are all-reduced, like DDP, through the same code.
hybrid:         a 2-D mesh (replicate = nodes, shard = ranks per node): weights gathered within a node
                only (the fast links), gradients all-reduced across nodes.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from qshard.config import Config
from qshard.errors import QShardError
from qshard.parallel.distributed import DistEnv


def replicate_degree(cfg: Config, world_size: int) -> int:
    """How many replicas the strategy keeps (1: pure sharding)."""
    strategy = cfg.parallel.sharding
    if strategy == "none":
        return world_size
    if strategy != "hybrid":
        return 1
    degree = cfg.parallel.replicate_degree or world_size // _ranks_per_node(world_size)
    if world_size % degree:
        raise QShardError(
            f"parallel.replicate_degree: {degree} replicas do not divide world size {world_size} into equal "
            "shard groups; set parallel.replicate_degree to a divisor of it"
        )
    return degree


def _ranks_per_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE, or under srun SLURM_NTASKS_PER_NODE (e.g. "8" or "8(x2)")."""
    found = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if found.isdigit() and int(found) > 0:
        return min(int(found), world_size)
    if world_size == 1:
        return 1
    raise QShardError(
        "parallel.replicate_degree: the number of ranks per node is unknown here (neither LOCAL_WORLD_SIZE "
        "nor SLURM_NTASKS_PER_NODE is set); set parallel.replicate_degree to the number of nodes"
    )


def build_mesh(cfg: Config, env: DistEnv) -> DeviceMesh:
    """1-D for the sharding-only strategies (the process group's own mesh), else (replicate, shard)."""
    replicas = replicate_degree(cfg, env.world_size)
    if cfg.parallel.sharding not in ("none", "hybrid"):
        return env.mesh
    shape = (replicas, env.world_size // replicas)
    return init_device_mesh(env.device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))


def shard_placements(mesh: DeviceMesh) -> list[Placement]:
    """FSDP2's placements on this mesh: dim 0 sharded over the last mesh dim, replicated over the other."""
    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` as a plain tensor: a DTensor's local tensor, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_piece(full: torch.Tensor, mesh: DeviceMesh, placements: list[Placement] | tuple[Placement, ...]):
    """This rank's piece of `full` under `placements`, cut as FSDP2 cuts (torch.chunk; ranks past the last
    chunk get an empty piece)."""
    piece = full
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
        index = mesh.get_local_rank(mesh_dim)
        piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece
