"""FSDP2 for a model skeleton (still on meta): `parallelize`, the recipe, and its steps.

The recipe: ready the quantized storage for what holds it (FSDP2, as integers or in float carriers, checked
byte for byte; or DTensor buffers), tile each block's MLP along the sequence where asked, choose the blocks
whose checkpoint is traced into their compiled graph, checkpoint the others with hooks, compile the blocks,
then `fully_shard` each block, the embedding and the head, and the root. On one device the quantized blocks,
the blocks that train only adapters over a frozen base in the compute dtype (LoRA, DoRA), and a frozen embedding
and head get no unit: they are used in place (`blocks_in_place`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from qshard.adapters import LoRALinear
from qshard.config import Config, ParallelConfig, checkpoint_trace_unmet
from qshard.errors import QShardError
from qshard.host_embedding import host_modules
from qshard.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from qshard.parallel.compile import check_cuda_graphs, compile_blocks
from qshard.parallel.mesh import local_piece, shard_placements
from qshard.parallel.offload import group_saved_tensors_by_block, offload_policy
from qshard.parallel.storage_offload import offload_quantized_storage
from qshard.parallel.tiling import tile_mlps
from qshard.precision import Precision, precision
from qshard.quant import QuantizedLinear

log = logging.getLogger("qshard")


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: Config) -> str:
    """Shard `model` over `mesh` block by block, checkpointed and compiled as `cfg.parallel` says.
    Returns how the quantized storage is held: "fsdp", "dtensor", or "in_place" (see blocks_in_place)."""
    parallel, prec = cfg.parallel, precision(cfg)
    how = parallel.quant_sharding
    quantized = quantized_blocks(blocks) if how == "fsdp" else []
    in_place = in_place_blocks(model, blocks, mesh.size(), cfg)
    if how == "fsdp":
        storage_for_units(model, blocks, in_place, mesh)
        # FSDP2's copies must keep every byte of the storage: verified on this mesh before any weight is read.
        check_storage_units([b for b in quantized if b not in in_place], mesh, parallel, prec, cfg.quant.method)
    else:
        storage_in_dtensor_buffers(model, blocks, mesh, parallel)
    tile_mlps(model, blocks, parallel.mlp_tile_tokens)
    traced = traced_blocks(blocks, in_place, mesh, parallel, cfg.train.train_type, cfg.lora.dropout)
    log_adapter_blocks_in_place(blocks, in_place, traced)
    apply_activation_checkpointing(model, blocks, parallel, traced)
    if parallel.offloads_activations():  # backward brings the offloaded tensors back a block ahead
        group_saved_tensors_by_block(blocks)
    if parallel.replays_graphs():
        check_cuda_graphs(parallel, compute_device(mesh), len(traced), len(checkpointed_blocks(blocks, parallel)))
    if parallel.compile:
        compile_blocks(blocks, parallel.compile_backend, traced, parallel.saves_projections(),
                       parallel.replays_graphs())
    shard_blocks(blocks, quantized, in_place, mesh, parallel, prec, reshard_after_forward(parallel))
    kept = shard_embedding_and_head(model, mesh, parallel, prec)
    shard_root(model, [*in_place, *kept], mesh, parallel, prec)
    return "in_place" if in_place else how


def reshard_after_forward(parallel: ParallelConfig) -> bool:
    """Whether blocks free their gathered weights after forward: not under grad_op (ZeRO-2)."""
    return parallel.sharding != "grad_op"


def quantized_blocks(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks that hold quantized layers."""
    return [b for b in blocks if any(isinstance(m, QuantizedLinear) for m in b.modules())]


def in_place_blocks(model: nn.Module, blocks: list[nn.Module], world_size: int, cfg: Config) -> list[nn.Module]:
    """The blocks that get no FSDP2 unit on `world_size` ranks (`blocks_in_place`): the quantized ones and those
    that train adapters only (`adapter_block`); the planner (qshard/planner) asks the same question of a
    skeleton."""
    if not blocks_in_place(world_size, cfg.parallel):
        return []
    prec = precision(cfg)
    if prec.loss_scaling and trained_outside(model, blocks):
        return []
    quantized = {id(b) for b in quantized_blocks(blocks)}
    # quant_sharding dtensor keeps quantized storage in DTensor buffers, which blocks in place do not take; it
    # says nothing about blocks without quantized layers.
    in_place_quantized = cfg.parallel.quant_sharding == "fsdp"
    # The other blocks that train go in place all together or not at all: the optimizer's adapter group holds
    # their weights as one kind of tensor, plain or DTensor (train/optim.py).
    training = [b for b in blocks if id(b) not in quantized and any(p.requires_grad for p in b.parameters())]
    mp = prec.mp_policy()
    adapters = {id(b) for b in training} if all(adapter_block(b, mp) for b in training) else set()
    return [b for b in blocks if (in_place_quantized if id(b) in quantized else id(b) in adapters)]


def every_checkpoint_traced(model: nn.Module, blocks: list[nn.Module], world_size: int, cfg: Config) -> bool:
    """Whether every checkpointed block of `model` would be checkpointed inside its compiled graph (`traced_blocks`'
    rule), asked of a skeleton before the build: parallel.cuda_graphs auto turns on only then, where `true` would
    be refused at build time (compile.check_cuda_graphs)."""
    checkpointed = checkpointed_blocks(blocks, cfg.parallel)
    in_place = in_place_blocks(model, blocks, world_size, cfg)
    traced = _traced(blocks, in_place, world_size, cfg.parallel, cfg.train.train_type, cfg.lora.dropout)
    return bool(checkpointed) and len(traced) == len(checkpointed)


def adapter_block(block: nn.Module, mp: MixedPrecisionPolicy) -> bool:
    """Whether `block` trains adapters (LoRA, DoRA) and nothing else, over frozen weights already in the dtype its
    unit would gather them in. Its unit would cast only the adapters, which cast their fp32 masters to the compute
    dtype where they use them (adapters/lora.py, dora.py), as in a quantized block: used in place, it computes
    what its unit would. A block that trains full weights (full, llama_pro, lora.modules_to_save inside it)
    keeps its unit, whose policy casts them."""
    adapters = {id(p) for m in block.modules() if isinstance(m, LoRALinear)
                for name, p in m.named_parameters() if not name.startswith("base.")}
    params = list(block.parameters())
    return bool(adapters) and all(
        id(p) in adapters if p.requires_grad else mp.param_dtype in (None, p.dtype) for p in params
    )


def blocks_in_place(world_size: int, parallel: ParallelConfig) -> bool:
    """On one device, a block of quantized layers needs no FSDP2 unit: its gathers would copy the storage
    into a one-rank all-gather and back, three times a step (forward, recomputation, backward), and its
    gradient reduction is the identity; without the unit's hooks and copies the step is faster
    (docs/benchmarks-history.md). Such a block's unit would cast nothing (`storage_unit_policy`), so leaving
    its parameters as plain tensors, used in place, changes no numbers. The same holds for a block that trains
    only adapters over a frozen base in the compute dtype (`adapter_block`), and for a frozen embedding or head
    in the compute dtype (`frozen_uncast`). CPU offload needs FSDP2 (its policy moves them)."""
    return world_size == 1 and not parallel.cpu_offload


def trained_outside(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether weights outside the blocks train (lora.modules_to_save). Their units hold them as DTensor shards,
    beside the plain-tensor adapters of blocks used in place: the optimizer and clipping take the two kinds
    apart (train/optim.py), but the fp16 loss scaler unscales every gradient in one foreach call, which takes no
    such mix, so under fp16 the blocks keep their units."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    return any(p.requires_grad and id(p) not in inside for p in model.parameters())


def log_adapter_blocks_in_place(blocks: list[nn.Module], in_place: list[nn.Module], traced: list[nn.Module]) -> None:
    """One line naming the unquantized blocks used in place (those of quantized storage get build.py's line)."""
    quantized = {id(b) for b in quantized_blocks(blocks)}
    adapters = [b for b in in_place if id(b) not in quantized]
    if adapters:
        inside = sum(1 for b in adapters if b in traced)
        log.info("%d of %d LoRA/DoRA blocks used in place (one device: no FSDP2 units; the fp32 adapters cast where "
                 "used)%s", len(adapters), len(blocks), f", {inside} checkpointed inside their compiled graphs"
                 if inside else "")


def storage_in_dtensor_buffers(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh,
                               parallel: ParallelConfig) -> None:
    """Every quantized layer's storage sharded as DTensor buffers, outside FSDP2; under parallel.cpu_offload
    moved to host memory as well, since FSDP2's CPUOffloadPolicy moves only what FSDP2 manages and the storage
    is the bulk of the model (moved before materialization, it never exists on the GPU whole)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            shard_as_dtensor_buffers(module, mesh)
    if parallel.cpu_offload:
        offload_quantized_storage(model, blocks, compute_device(mesh), parallel.resident_blocks)


def traced_blocks(blocks: list[nn.Module], in_place: list[nn.Module], mesh: DeviceMesh, parallel: ParallelConfig,
                  train_type: str, dropout: float) -> list[nn.Module]:
    """The checkpointed blocks whose checkpoint is traced into their compiled graph (parallel/checkpointing.py:
    traced_checkpoint): where `checkpoint_trace_unmet` finds nothing unmet, the blocks used in place.
    The other checkpointed blocks keep hooks around their (compiled) forward."""
    traced = _traced(blocks, in_place, mesh.size(), parallel, train_type, dropout)
    if parallel.saves_projections() and not traced:  # the config allowed it; the world size does not
        log.warning("parallel.ac_save_projections has no effect: no block is checkpointed inside its compiled "
                    "graph (world size %d)", mesh.size())
    return traced


def _traced(blocks: list[nn.Module], in_place: list[nn.Module], world_size: int, parallel: ParallelConfig,
            train_type: str, dropout: float) -> list[nn.Module]:
    if checkpoint_trace_unmet(parallel, train_type, dropout, world_size):
        return []
    return [b for b in checkpointed_blocks(blocks, parallel) if b in in_place]


def shard_blocks(blocks: list[nn.Module], quantized: list[nn.Module], in_place: list[nn.Module], mesh: DeviceMesh,
                 parallel: ParallelConfig, prec: Precision, reshard: bool) -> None:
    """One FSDP2 unit per block not used in place; those whose quantized storage FSDP2 gathers cast nothing
    (`storage_unit_policy`). `reshard`: whether blocks free their gathered weights after forward."""
    mp, offload = prec.mp_policy(), offload_policy(parallel)
    uncast = storage_unit_policy(mp)
    for i, block in enumerate(blocks):
        if block in in_place:
            continue
        # The last block's weights are needed again at once by backward: keeping them saves an all-gather.
        last = i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=uncast if block in quantized else mp,
                    reshard_after_forward=reshard and not last, offload_policy=offload)


def shard_embedding_and_head(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig,
                             prec: Precision) -> list[nn.Module]:
    """Units of their own for an untied embedding and head, so that neither holds a gathered copy for the
    whole step; on one device, a frozen one that the policy would not cast is used in place instead, like the
    quantized blocks (`frozen_uncast`). An embedding looked up on the host (host_embedding.py) gets no unit
    either. Returns the modules used in place."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is embed.weight:
        # A tied pair stays in one unit, the root (materialized outside FSDP2, its two modules would get a
        # parameter each); an embedding on the host (never tied) in none, without a head too.
        return host_modules(model)
    mp, offload = prec.mp_policy(), offload_policy(parallel)
    kept = [*kept_embedding_and_head(model, mesh.size(), parallel, prec), *host_modules(model)]
    resident = resident_embedding_and_head(model, parallel)
    # The embedding is needed in its forward only (and in backward only if it trains); the head stays gathered
    # from forward into backward: the chunked loss reads a trained head's weight again there (train/loss.py), and
    # a preference step reads it several times (a frozen head, whose gradient the loss takes in forward, is
    # resharded by the loss after the micro-batch's forward with gradient).
    for module, reshard in ((embed, True), (head, False)):
        if module not in kept:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard,
                        offload_policy=OffloadPolicy() if module in resident else offload)
    return kept


def resident_embedding_and_head(model: nn.Module, parallel: ParallelConfig) -> list[nn.Module]:
    """Under cpu_offload, an untied embedding or head that trains nothing stays on the GPU: used in place on one
    device (`kept_embedding_and_head`), else in a unit without offload policy. Offloaded, its whole weight (2 GiB
    each for a 128k vocabulary at hidden 8,192) would cross PCIe at every gather and take host memory, for no
    optimizer state to keep off the GPU."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not parallel.cpu_offload or head is None or head.weight is embed.weight:
        return []
    on_host = host_modules(model)  # never on the GPU
    return [m for m in (embed, head) if not any(p.requires_grad for p in m.parameters()) and m not in on_host]


def kept_embedding_and_head(model: nn.Module, world_size: int, parallel: ParallelConfig,
                            prec: Precision) -> list[nn.Module]:
    """Which of an untied embedding and head `shard_embedding_and_head` uses in place (`frozen_uncast`): on one
    device, with or without cpu_offload (which keeps them on the GPU all the same,
    `resident_embedding_and_head`; in place they are held once, not as a shard and its gathered copy)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is embed.weight or world_size != 1:
        return []
    on_host = host_modules(model)  # used in place too, but from host memory
    return [m for m in (embed, head) if frozen_uncast(m, prec.mp_policy()) and m not in on_host]


def frozen_uncast(module: nn.Module, mp: MixedPrecisionPolicy) -> bool:
    """Whether every parameter of `module` is frozen and already in the dtype its unit would gather it in."""
    params = list(module.parameters())
    return bool(params) and all(not p.requires_grad and mp.param_dtype in (None, p.dtype) for p in params)


def shard_root(model: nn.Module, in_place: list[nn.Module], mesh: DeviceMesh, parallel: ParallelConfig,
               prec: Precision) -> None:
    """The root unit: what no other unit holds (the final norm, a tied embedding and head), leaving out the
    parameters of the modules used in place."""
    ignored = {p for module in in_place for p in module.parameters()}
    # The root's weights are needed again at once by backward.
    fully_shard(model, mesh=mesh, mp_policy=prec.mp_policy(), reshard_after_forward=False,
                offload_policy=offload_policy(parallel), ignored_params=ignored or None)


# ---------------------------------------------------------------------------------------------------------------
# Quantized storage that FSDP2 units hold: as integers, or in float carriers.

_holds_integers: bool | None = None  # fsdp_holds_integers' answer, once per process


def fsdp_holds_integers(mesh: DeviceMesh) -> bool:
    """Whether the installed FSDP2 takes a frozen integer parameter: asked of `fully_shard` itself once per
    process, on a throwaway module whose one uint8 parameter lives on meta (no memory, no collective: sharding
    only slices). An FSDP2 that wraps every sharded parameter in a new `nn.Parameter` requiring grad refuses
    it there ("only Tensors of floating point dtype can require gradients")."""
    global _holds_integers
    if _holds_integers is None:
        probe = nn.Module()
        probe.codes = nn.Parameter(torch.empty(2 * mesh.size(), 2, dtype=torch.uint8, device="meta"),
                                   requires_grad=False)
        try:
            fully_shard(probe, mesh=mesh)
            _holds_integers = True
        except Exception as exc:  # any refusal: the float carriers are used, and checked (check_storage_gather)
            log.debug("FSDP2 refuses an integer parameter (%s: %s): float carriers", type(exc).__name__, exc)
            _holds_integers = False
    return _holds_integers


def storage_for_units(model: nn.Module, blocks: list[nn.Module], in_place: list[nn.Module], mesh: DeviceMesh) -> None:
    """Ready the quantized storage of the blocks FSDP2 units will hold: as it is where this FSDP2 holds integer
    parameters, else in float carriers (`carry_storage_in_float`). Storage used in place (`in_place` blocks)
    keeps its integer dtypes: a compiled graph that views the fp32 scale carrier back as int32 and again as
    fp32 (the views fold away) fails the compiler's partitioner when the checkpoint is traced into the graph."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    assert all(id(m) in in_blocks for m in model.modules() if isinstance(m, QuantizedLinear)), \
        "quantized storage outside the blocks would join a unit that casts (embedding, head or root)"
    if fsdp_holds_integers(mesh):
        return
    kept = {id(m) for b in in_place for m in b.modules()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and id(module) not in kept:
            carry_storage_in_float(module)


def carry_storage_in_float(layer: QuantizedLinear) -> None:
    """Re-register a quantized layer's integer storage (codes, scales) as float parameters viewing the same
    bytes (the layer's `CARRIERS`), before FSDP2 takes the layer; its `dequantize` views them back.

    Why: an FSDP2 that cannot hold an integer parameter (`fsdp_holds_integers`) still takes these, and shards,
    groups and prefetches them with the rest of the block (DTensor buffers are gathered layer by layer on use).
    Two conditions keep the bytes intact: the block's unit casts nothing (`storage_unit_policy`; a cast to
    bf16 would round the fp32 scales and turn NaN-looking code pairs into the canonical NaN), and its
    all-gather inputs are of mixed dtypes (the two carriers at least), for which FSDP2 copies them in and out
    as bytes (a single-dtype bf16 group is copied through fp32 arithmetic on CUDA, which canonicalizes NaNs
    too). Both are FSDP2's internals, so `check_storage_gather` verifies the bytes at build time."""
    for name in layer.STORAGE:
        param = layer._parameters[name]
        carrier = layer.CARRIERS[name]
        row_bytes = param.shape[-1] * param.element_size()
        if row_bytes % carrier.itemsize:
            raise QShardError(
                f"{type(layer).__name__} {tuple(param.shape)}: a row of its {name} ({row_bytes} bytes) cannot be "
                f"carried as {carrier} under FSDP2; set parallel.quant_sharding: dtensor"
            )
        layer._parameters[name] = nn.Parameter(param.data.view(carrier), requires_grad=False)


def storage_unit_policy(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of a unit that holds quantized storage: it casts nothing (see carry_storage_in_float), so its
    adapters travel as their fp32 masters and cast their weights where they use them (adapters/lora.py,
    dora.py); frozen weights are stored in the compute dtype already. Gradients are reduced as `mp` says."""
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=mp.reduce_dtype)


# ---------------------------------------------------------------------------------------------------------------
# The build-time check that a quantized block's unit gathers its storage byte for byte.

_PROBE_ROWS = 17  # uneven over 2, 4 and 8 ranks: shard boundaries inside the pattern, padding on the last rank
_PROBE_ROW_BYTES = 32


def _signed(bits: int, width: int) -> int:
    """A bit pattern of `width` bits as the signed integer torch stores for it."""
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


# bf16 bit patterns a float copy would alter: every NaN (quiet and signalling, both signs; canonicalized to one),
# the infinities, a denormal and -0 (flushed or kept, depending on the arithmetic).
_BF16_PATTERNS = [_signed(b, 16) for b in (*range(0x7F81, 0x8000), *range(0xFF81, 0x10000), 0x7F80, 0xFF80, 1, 0x8000)]
# fp32 ones: NaNs with and without payload (a signalling one is quieted by most arithmetic), infinities,
# denormals, -0, a value bf16 rounds, and pairs of fp16 NaNs (HQQ keeps an fp16 scale and zero per int32).
_FP32_PATTERNS = [_signed(b, 32) for b in (
    0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
    0x00000001, 0x007FFFFF, 0x80000001, 0x80000000, 0x3F800001, 0x7C017C01, 0xFE00FC01, 0x7FFF7E00,
)]


def _probe_bytes(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[rows, row bytes] uint8 of NaN-looking patterns for a storage tensor of `dtype` (uint8 codes or their
    bf16 carrier; int32 scales or their fp32 carrier), the whole list repeated to fill the rows."""
    if dtype.itemsize == 4:
        values = torch.tensor(_FP32_PATTERNS, dtype=torch.int32)
    else:
        values = torch.tensor(_BF16_PATTERNS, dtype=torch.int16)
    need = _PROBE_ROWS * _PROBE_ROW_BYTES // values.element_size()
    values = values.repeat(-(-need // values.numel()))[:need]
    return values.view(torch.uint8).view(_PROBE_ROWS, _PROBE_ROW_BYTES).to(device)


def _differing_bytes(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor | int:
    """How many bytes of `got` differ from `want` (uint8), counted on the device."""
    got = got.detach()
    if got.dtype.itemsize * got.numel() != want.numel():  # cast to another width: every byte is wrong
        return want.numel()
    return (got.contiguous().view(torch.uint8).reshape(-1) != want.reshape(-1)).sum()


UnitKind = tuple[tuple[torch.dtype, ...], tuple[tuple[torch.dtype, bool], ...]]


def _unit_kind(block: nn.Module) -> UnitKind:
    """A quantized block's storage dtypes (those of its first quantized layer), and the (dtype, requires_grad)
    kinds of its other parameters: what decides how FSDP2 copies the unit's all-gather inputs."""
    layers = [m for m in block.modules() if isinstance(m, QuantizedLinear)]
    storage = tuple(getattr(layers[0], name).dtype for name in layers[0].STORAGE)
    ids = {id(getattr(m, name)) for m in layers for name in m.STORAGE}
    others = sorted({(p.dtype, p.requires_grad) for p in block.parameters() if id(p) not in ids}, key=str)
    return storage, tuple(others)


def check_storage_gather(block: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                         offload: OffloadPolicy) -> int:
    """Verify, on this mesh and device, that a unit built like `block`'s (its mixed-precision and offload
    policies, its storage dtypes beside parameters of its other dtypes) all-gathers quantized storage byte for
    byte: storage full of NaN-looking bit patterns is sharded, gathered once and compared with what was
    written. Its cost: one all-gather of about 1.5 KiB (all ranks' shards together: 1 KiB of storage, the rest
    other parameters) and one device-to-host read of the count. Returns the bytes of storage checked.

    Why: whether float carriers (and integers) come back intact rests on FSDP2's internals (carry_storage_in_float);
    a torch release that changes them would otherwise corrupt every frozen weight silently."""
    device = compute_device(mesh)
    storage_dtypes, others = _unit_kind(block)
    unit = nn.Module()
    written = []
    for i, dtype in enumerate(storage_dtypes):
        data = _probe_bytes(dtype, device)
        written.append(data)
        unit.register_parameter(f"storage{i}", nn.Parameter(data.view(dtype).clone(), requires_grad=False))
    for i, (dtype, grad) in enumerate(others):
        values = torch.arange(_PROBE_ROWS * 4, device=device).view(_PROBE_ROWS, 4).to(dtype)
        unit.register_parameter(f"other{i}", nn.Parameter(values, requires_grad=grad))
    fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=offload)
    unit.unshard()  # the all-gather: FSDP2's copy-in, collective and copy-out, as in every forward
    differ = int(sum(_differing_bytes(getattr(unit, f"storage{i}"), want) for i, want in enumerate(written)))
    unit.reshard()
    total = sum(t.numel() for t in written)
    if differ:
        raise QShardError(
            f"FSDP2 in torch {torch.__version__} changes the bytes of the 4-bit storage it gathers ({differ} of "
            f"{total} bytes differ); set parallel.quant_sharding: dtensor"
        )
    return total


def check_storage_units(blocks: list[nn.Module], mesh: DeviceMesh, parallel: ParallelConfig, prec: Precision,
                        method: str) -> None:
    """`check_storage_gather` once for each kind of unit these quantized blocks form (one in the models qshard
    builds), with the policies `shard_blocks` gives them; each logged in one line when it passes."""
    policy, offload = storage_unit_policy(prec.mp_policy()), offload_policy(parallel)
    kinds = {}
    for block in blocks:
        kinds.setdefault(_unit_kind(block), block)
    for (storage, _), block in kinds.items():
        nbytes = check_storage_gather(block, mesh, policy, offload)
        log.info("FSDP2 gathers the %s storage (as %s) byte for byte: checked on %s, %d rank(s), %d bytes of "
                 "NaN-looking patterns", method.upper(), "/".join(str(d).removeprefix("torch.") for d in storage),
                 compute_device(mesh).type, mesh.size(), nbytes)


# ---------------------------------------------------------------------------------------------------------------
# Quantized storage outside FSDP2: DTensor buffers.

def shard_as_dtensor_buffers(layer: nn.Module, mesh: DeviceMesh) -> None:
    """Move a quantized layer's codes and scales out of FSDP2's reach into dim-0-sharded DTensor buffers:
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


def reshard_all(model: nn.Module) -> None:
    """Free every gathered weight, leaving only the shards registered (e.g. after a forward-only pass)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def block_units(model: nn.Module) -> list[nn.Module]:
    """The blocks that have FSDP2 units of their own, in forward order: every unit but the root's, the embedding's
    and the head's (`parallelize` makes no others)."""
    others = {id(model), id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return [m for m in model.modules() if isinstance(m, FSDPModule) and id(m) not in others]
