"""Apply activation checkpointing and FSDP2 to a model skeleton (still on meta), block by block."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from qshard.config import Config, reshard_after_forward
from qshard.errors import QShardError
from qshard.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from qshard.parallel.compile import compile_blocks
from qshard.parallel.mesh import local_piece, shard_placements
from qshard.parallel.offload import offload_policy, offload_quantized_storage
from qshard.precision import precision
from qshard.quant import QUANTIZED_LINEARS

log = logging.getLogger("qshard")

# Float dtypes that carry the quantized storage's bytes where FSDP2 cannot hold integers: codes (uint8) two to a
# bf16 element, scales (fp32 bits kept as int32) as the fp32 values they are. Two dtypes in every quantized layer.
CARRIERS = {torch.uint8: torch.bfloat16, torch.int32: torch.float32}

_holds_integers: bool | None = None  # fsdp_holds_integers' answer, once per process


def fsdp_holds_integers(mesh: DeviceMesh) -> bool:
    """Whether the installed FSDP2 takes a frozen integer parameter: asked of `fully_shard` itself once per
    process, on a throwaway module whose one uint8 parameter lives on meta (no memory, no collective: sharding
    only slices). FSDP2 releases that wrap every sharded parameter in a new `nn.Parameter` requiring grad
    refuse it there ("only Tensors of floating point dtype can require gradients")."""
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


def carry_storage_in_float(layer: nn.Module) -> None:
    """Re-register a quantized layer's integer storage (codes, scales) as float parameters viewing the same
    bytes (`CARRIERS`), before FSDP2 takes the layer; the dequantizers view them back (quant/nf4.py, hqq.py).

    Why: an FSDP2 that cannot hold an integer parameter (`fsdp_holds_integers`) still takes these, and shards,
    groups and prefetches them with the rest of the block (DTensor buffers are gathered layer by layer on use).
    Two conditions keep the bytes intact, both arranged in `parallelize`: the block's unit casts nothing (a
    cast to bf16 would round the fp32 scales and turn NaN-looking code pairs into the canonical NaN), and its
    all-gather inputs are of mixed dtypes, for which FSDP2 copies them in and out as bytes (a single-dtype
    bf16 group is copied through fp32 arithmetic on CUDA, which canonicalizes NaNs too). Both are FSDP2's
    internals, so `check_storage_gather` verifies the bytes at build time."""
    for name in layer.STORAGE:
        param = layer._parameters[name]
        carrier = CARRIERS[param.dtype]
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
    layers = [m for m in block.modules() if isinstance(m, QUANTIZED_LINEARS)]
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


def check_storage_units(blocks: list[nn.Module], mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                        offload: OffloadPolicy, method: str) -> None:
    """`check_storage_gather` once for each kind of unit these quantized blocks form (one in the models qshard
    builds), each logged in one line when it passes."""
    kinds = {}
    for block in blocks:
        kinds.setdefault(_unit_kind(block), block)
    for (storage, _), block in kinds.items():
        nbytes = check_storage_gather(block, mesh, policy, offload)
        log.info("FSDP2 gathers the %s storage (as %s) byte for byte: checked on %s, %d rank(s), %d bytes of "
                 "NaN-looking patterns", method.upper(), "/".join(str(d).removeprefix("torch.") for d in storage),
                 compute_device(mesh).type, mesh.size(), nbytes)


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


def quant_sharding(cfg: Config) -> str:
    # FSDP2 by default on every torch (its gathers are grouped per block and prefetched). DTensor buffers only
    # when asked for: gathered layer by layer, and under `parallel.cpu_offload` kept in pinned host memory by
    # parallel/offload.py (faster than FSDP2's offload on one GPU, slower on two: docs/benchmarks.md).
    return cfg.parallel.quant_sharding


def storage_for_units(model: nn.Module, blocks: list[nn.Module], in_place: list[nn.Module], mesh: DeviceMesh) -> None:
    """Ready the quantized storage of the blocks FSDP2 units will hold: as it is where this FSDP2 holds integer
    parameters, else in float carriers (`carry_storage_in_float`). Storage used in place (`in_place` blocks)
    keeps its integer dtypes: a compiled graph that views the fp32 scale carrier back as int32 and again as
    fp32 (the views fold away) fails the compiler's partitioner when the checkpoint is traced into the graph."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    assert all(id(m) in in_blocks for m in model.modules() if isinstance(m, QUANTIZED_LINEARS)), \
        "quantized storage outside the blocks would join a unit that casts (embedding, head or root)"
    if fsdp_holds_integers(mesh):
        return
    kept = {id(m) for b in in_place for m in b.modules()}
    for module in model.modules():
        if isinstance(module, QUANTIZED_LINEARS) and id(module) not in kept:
            carry_storage_in_float(module)


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: Config) -> str:
    """Checkpointing first, then compilation, then one FSDP unit per block, the embedding and the head, then
    the root.
    Returns how the quantized storage is held: "fsdp", "dtensor", or "in_place" (see blocks_in_place)."""
    mp = precision(cfg).mp_policy()
    how = quant_sharding(cfg)
    quantized = [how == "fsdp" and any(isinstance(m, QUANTIZED_LINEARS) for m in b.modules()) for b in blocks]
    in_place_blocks = [b for b, q in zip(blocks, quantized) if q] if blocks_in_place(mesh, cfg) else []
    if how == "fsdp":
        storage_for_units(model, blocks, in_place_blocks, mesh)
    else:
        for module in model.modules():
            if isinstance(module, QUANTIZED_LINEARS):
                shard_as_dtensor_buffers(module, mesh)
        if cfg.parallel.cpu_offload:
            # FSDP2's CPUOffloadPolicy moves only what FSDP2 manages: the quantized storage, the bulk of the
            # model, goes to host memory here (before materialization, so it never exists on the GPU whole).
            offload_quantized_storage(model, blocks, compute_device(mesh))
    # Compiled blocks used in place have their checkpoint traced into the graph (parallel/checkpointing.py:
    # traced_checkpoint); the others keep hooks around the compiled forward. Traced with the float carriers
    # of a unit's storage, torch 2.13's partitioner fails as above (reproduced on CPU with inductor). Not
    # with LoRA dropout either: the traced checkpoint keeps every dropout's output and mask (6x the kept
    # bytes of hooks on a tiny Llama at dropout 0.1), where the hooks' recomputation redraws them exactly.
    in_place_ids = {id(b) for b in in_place_blocks}
    trace = cfg.parallel.compile and cfg.lora.dropout == 0
    traced = [b for b in checkpointed_blocks(blocks, cfg.parallel) if id(b) in in_place_ids and trace]
    if cfg.parallel.ac_save_projections and not traced:  # the config allowed it; the world size does not
        log.warning("parallel.ac_save_projections has no effect: no block is checkpointed inside its compiled "
                    "graph (world size %d)", mesh.size())
    apply_activation_checkpointing(model, blocks, cfg.parallel, traced)
    if cfg.parallel.compile:
        compile_blocks(blocks, cfg.parallel.compile_backend, traced, cfg.parallel.ac_save_projections)
    offload = offload_policy(cfg)
    uncast = storage_unit_policy(mp)  # for blocks whose quantized storage FSDP2 gathers
    in_place = set()  # parameters no unit manages (see blocks_in_place)
    for i, block in enumerate(blocks):
        if id(block) in in_place_ids:
            in_place.update(block.parameters())
            continue
        # The last block's weights are needed again at once by backward: keeping them saves an all-gather.
        reshard = reshard_after_forward(cfg) and i < len(blocks) - 1
        policy = uncast if quantized[i] else mp
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
    units = [b for b, q in zip(blocks, quantized) if q and id(b) not in in_place_ids]
    check_storage_units(units, mesh, uncast, offload, cfg.quant.method)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and head.weight is not embed.weight
    if untied and blocks_in_place(mesh, cfg):
        # One device: a frozen embedding or head that the policy would not cast is used in place as well;
        # as units they would be copied into a one-rank all-gather and back every step, and the head's copy
        # kept from forward into backward (1 GiB each for the 8B shape). A tied pair stays with the root:
        # materialized outside FSDP2, its two modules would get a parameter each.
        for module in (embed, head):
            if frozen_uncast(module, mp):
                in_place.update(module.parameters())
    if untied:  # a tied pair must stay in one unit (the root)
        # Units of their own, so neither holds a gathered copy for the whole step: the embedding is needed
        # in its forward only (and in backward only if it trains); the head stays gathered from forward
        # into backward, which begins with it, and the chunked loss reads its weight (train/loss.py).
        if not in_place.issuperset(embed.parameters()):
            fully_shard(embed, mesh=mesh, mp_policy=mp, reshard_after_forward=True, offload_policy=offload)
        if not in_place.issuperset(head.parameters()):
            fully_shard(head, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    # The root (what is left: final norm, a tied embedding/head) is needed again at once by backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload,
                ignored_params=in_place or None)
    return "in_place" if in_place_blocks else how


def frozen_uncast(module: nn.Module, mp: MixedPrecisionPolicy) -> bool:
    """Whether every parameter of `module` is frozen and already in the dtype its unit would gather it in."""
    params = list(module.parameters())
    return bool(params) and all(not p.requires_grad and mp.param_dtype in (None, p.dtype) for p in params)


def blocks_in_place(mesh: DeviceMesh, cfg: Config) -> bool:
    """On one device, a block of quantized layers needs no FSDP2 unit: its gathers would copy the storage
    into a one-rank all-gather and back, three times a step (forward, recomputation, backward), and its
    gradient reduction is the identity. Measured on an H200 (8B shape, seq 2,048, compiled blocks): the
    hooks cost ~100 ms of host time and the copies ~50 ms of GPU time a step; without them the step is
    10% faster. Such a block's unit would cast nothing (see `uncast` above), so leaving its parameters as
    plain tensors, used in place, changes no numbers. The same holds for a frozen embedding or head in the
    compute dtype (`frozen_uncast`). CPU offload needs FSDP2 (its policy moves them)."""
    return mesh.size() == 1 and not cfg.parallel.cpu_offload


def reshard_all(model: nn.Module) -> None:
    """Free every gathered weight, leaving only the shards registered (e.g. after a forward-only pass)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
