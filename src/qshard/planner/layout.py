"""Where every tensor of the model lives on one rank, predicted from the meta-device skeleton by the rules that
shard the real model (parallel/fsdp.py, parallel/mesh.py, parallel/storage_offload.py): each parameter's shard, its
gradient and its AdamW state, in bytes, on the GPU or the host. Nothing is allocated and no process group is
needed, so any world size can be planned from one process.

FSDP2 cuts dim 0 as torch.chunk does (ceil(rows / shard ranks) rows per rank, the last ranks fewer or none) and
stores each rank's piece padded to the full chunk; DTensor buffers (quant_sharding dtensor) hold the piece
unpadded; blocks used in place (one device) hold everything.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import torch
import torch.nn as nn

from qshard.build import Skeleton
from qshard.config import Config
from qshard.parallel.fsdp import in_place_blocks, kept_embedding_and_head, resident_embedding_and_head
from qshard.parallel.mesh import replicate_degree
from qshard.parallel.storage_offload import _ALIGN, storage_groups
from qshard.precision import precision
from qshard.quant import QuantizedLinear

# AdamW keeps two tensors per trained parameter (exp_avg, exp_avg_sq) of its shape and dtype, and a scalar step.
ADAM_STATES = ("exp_avg", "exp_avg_sq")


_T = TypeVar("_T")
_PER_SKELETON: dict[Callable, weakref.WeakKeyDictionary] = {}


def per_skeleton(walk: Callable[[Skeleton], _T], model: Skeleton) -> _T:
    """`walk(model)`, computed once per skeleton: a --fit search estimates one skeleton for every candidate, and
    walking its modules again for each was most of the search's time."""
    cache = _PER_SKELETON.setdefault(walk, weakref.WeakKeyDictionary())
    found = cache.get(model.model)
    if found is None:
        found = cache[model.model] = walk(model)
    return found


@dataclass(frozen=True)
class TensorPlan:
    """One parameter (or quantized storage tensor) on one rank."""

    name: str
    part: str  # quantized | frozen | trained | embedding | head: what the breakdown adds it to
    holder: str  # fsdp | dtensor | in_place
    dtype: torch.dtype  # as stored before FSDP2 carries integer storage in floats (the bytes are the same)
    full_shape: tuple[int, ...]
    local_rows: int  # this rank's rows of dim 0
    stored_rows: int  # the rows its storage holds (FSDP2 pads to the chunk)
    trainable: bool
    on_host: bool  # cpu_offload: the shard (and gradient and optimizer state) lives in host memory; or the
    # embedding looked up on the host (model.embedding_on_host), whole, on every rank

    # Cached: a --fit search reads them for every tensor of every candidate it estimates.
    @cached_property
    def row_bytes(self) -> int:
        rest = 1
        for size in self.full_shape[1:]:
            rest *= size
        return rest * self.dtype.itemsize

    @cached_property
    def local_bytes(self) -> int:
        return self.local_rows * self.row_bytes

    @cached_property
    def stored_bytes(self) -> int:
        return self.stored_rows * self.row_bytes

    @cached_property
    def full_bytes(self) -> int:
        return (self.full_shape[0] if self.full_shape else 1) * self.row_bytes

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.full_shape[1:]) if self.full_shape else ()


@dataclass(frozen=True)
class Mesh:
    """The data-parallel mesh a strategy builds: `replicas` x `shard` ranks (parallel/mesh.py)."""

    world_size: int
    replicas: int

    @property
    def shard(self) -> int:
        return self.world_size // self.replicas

    def shard_index(self, rank: int) -> int:
        return rank % self.shard  # ranks are laid out (replica, shard), row-major


def plan_mesh(cfg: Config, world_size: int) -> Mesh:
    return Mesh(world_size, replicate_degree(cfg, world_size))


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(this piece's rows, the chunk's rows) of `rows` cut into `parts` as torch.chunk cuts."""
    chunk = -(-rows // parts) if rows else 0
    return max(0, min(chunk, rows - index * chunk)), chunk


def tensor_layout(model: Skeleton, cfg: Config, world_size: int, rank: int = 0) -> list[TensorPlan]:
    """Every parameter and quantized storage tensor of `model` on `rank` of `world_size` ranks."""
    mesh = plan_mesh(cfg, world_size)
    in_place = {id(p) for b in in_place_blocks(model.model, model.blocks, world_size, cfg) for p in b.parameters()}
    kept = kept_embedding_and_head(model.model, world_size, cfg.parallel, precision(cfg))
    in_place |= {id(p) for m in kept for p in m.parameters()}
    resident = {id(p) for m in resident_embedding_and_head(model.model, cfg.parallel) for p in m.parameters()}
    # model.embedding_on_host: whole. From the options, not the skeleton's mark: one skeleton serves every setting
    # --fit searches, each with `auto` settled for it.
    embed = model.model.get_input_embeddings() if cfg.model.looks_up_on_host() else None
    host = {id(p) for p in embed.parameters()} if embed is not None else set()
    in_place |= host
    groups = storage_groups(model.model, model.blocks, cfg.parallel.resident_blocks)  # as parallel/storage_offload.py
    resident |= {id(getattr(m, name)) for layers, kept in groups if kept for m in layers for name in m.STORAGE}
    storage = _storage_ids(model.model) if cfg.parallel.quant_sharding == "dtensor" else set()
    parts = _parts(model)
    plans = []
    for name, param in model.model.named_parameters():
        holder = "in_place" if id(param) in in_place else "dtensor" if id(param) in storage else "fsdp"
        rows = param.shape[0] if param.dim() else 1
        if holder == "in_place" or mesh.shard == 1:
            local = stored = rows
        else:
            local, chunk = chunk_rows(rows, mesh.shard, mesh.shard_index(rank))
            stored = chunk if holder == "fsdp" else local
        plans.append(TensorPlan(name, parts.get(id(param), "frozen"), holder, param.dtype, tuple(param.shape),
                                local, stored, param.requires_grad,
                                id(param) in host or
                                (cfg.parallel.cpu_offload and holder != "in_place" and id(param) not in resident)))
    return plans


def _storage_ids(model: nn.Module) -> set[int]:
    return {id(getattr(m, name)) for m in model.modules() if isinstance(m, QuantizedLinear) for name in m.STORAGE}


def _parts(model: Skeleton) -> dict[int, str]:
    """Each parameter's line of the breakdown: the embedding and head apart from the rest."""
    parts = {}
    for module in model.model.modules():
        if isinstance(module, QuantizedLinear):
            parts.update({id(getattr(module, name)): "quantized" for name in module.STORAGE})
    for p in model.model.parameters():
        if p.requires_grad:
            parts[id(p)] = "trained"
    embed, head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
    for label, module in (("head", head), ("embedding", embed)):  # a tied pair is the embedding
        if module is not None and not module.weight.requires_grad:
            parts[id(module.weight)] = label
    return parts


def storage_block_bytes(plans: list[TensorPlan], model: Skeleton) -> list[int]:
    """Under cpu_offload with quant_sharding dtensor: each block's flat host buffer of quantized shards, every
    shard aligned as parallel/storage_offload.py lays them out."""
    local = {p.name: p for p in plans}
    names = {id(m): n for n, m in model.model.named_modules()}
    sizes = []
    for layers, _ in storage_groups(model.model, model.blocks):
        nbytes = 0
        for module in layers:
            for name in module.STORAGE:
                plan = local[f"{names[id(module)]}.{name}"]
                if plan.on_host:  # not a resident block's (parallel.resident_blocks)
                    nbytes = -(-nbytes // _ALIGN) * _ALIGN + plan.local_bytes
        if nbytes:
            sizes.append(nbytes)
    return sizes


@dataclass(frozen=True)
class StateSizes:
    """Bytes of one rank's model state, by where it lives and what it is."""

    weights: dict[str, int]  # part -> bytes on the GPU
    host_weights: int
    grads: int
    optimizer: int
    on_host: bool  # gradients and optimizer state in host memory (cpu_offload)


def state_sizes(plans: list[TensorPlan]) -> StateSizes:
    """The weights (by part), gradients and AdamW state of one rank's layout."""
    weights: dict[str, int] = {}
    host = 0
    for p in plans:
        if p.on_host:
            host += p.stored_bytes
        else:
            weights[p.part] = weights.get(p.part, 0) + p.stored_bytes
    trained = [p for p in plans if p.trainable]
    grads = sum(p.stored_bytes for p in trained)
    optimizer = sum(p.local_bytes for p in trained) * len(ADAM_STATES) + 4 * len(trained)
    return StateSizes(weights, host, grads, optimizer, any(p.on_host for p in trained))
