"""The plan of a load: which checkpoint tensor feeds which parameter shard, and how it is stored there.

The checkpoint is checked against the skeleton (every tensor present, every shape right, nothing
unexplained) before anything is read (`check_checkpoint`). Each full tensor is then stored by its plan entry
(`load_plan`): only this rank's dim-0 slice is kept, and a weight of a quantized layer is quantized, on the
device it was moved to, from the rows that slice holds. LoRA adapters are not loaded but initialized
(`init_adapters`); those that start from their base weight (PiSSA, OLoRA) split it first, and the base keeps
the residual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from qshard.adapters import LoRALinear
from qshard.errors import QShardError
from qshard.loading.model_dir import Checkpoint
from qshard.parallel.mesh import local_piece
from qshard.quant import QuantizedExperts, QuantizedLinear
from qshard.vocab import VocabResize


def module_sources(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Yield (module, checkpoint prefix) for every module, where the prefix skips the `.base` hop that
    a LoRALinear adds, so the base layer reads the original linear's tensors."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[nn.Module, str]]:
        yield module, prefix
        if isinstance(module, QuantizedExperts):
            return  # its quantized children hold the module's own 3-D tensors, read under the module's names
        for name, child in module.named_children():
            child_prefix = prefix if isinstance(module, LoRALinear) and name == "base" else join_name(prefix, name)
            yield from walk(child, child_prefix)

    yield from walk(model, "")


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> full shape, for every tensor the skeleton needs from the checkpoint (a vocabulary
    tensor the model grows, with the rows the checkpoint stores: `VocabResize`)."""
    expected: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if isinstance(module, QuantizedExperts):
            expected.update({join_name(prefix, name): shape for name, shape in module.shapes.items()})
            continue
        if isinstance(module, QuantizedLinear):
            expected[join_name(prefix, "weight")] = (module.out_features, module.in_features)
            if module.bias is not None:
                expected[join_name(prefix, "bias")] = tuple(module.bias.shape)
            continue
        if isinstance(module, LoRALinear):
            continue  # lora_A / lora_B are initialized, not loaded
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # tied weights: loaded once, under their first name
            seen.add(id(param))
            expected[join_name(prefix, name)] = tuple(param.shape)
    resize = VocabResize.of(model)
    for name in resize.names if resize is not None else ():
        expected[name] = resize.stored_shape(expected[name])
    return expected


def check_checkpoint(ckpt: Checkpoint, model: nn.Module) -> None:
    """Every needed tensor present with the right shape, and no tensor left unexplained. Tensors stored in
    another layout than the model's (per-expert MoE tensors) are shown under the model's names first."""
    expected = expected_tensors(model)
    ckpt.adapt(expected)
    for name, shape in expected.items():
        if name not in ckpt.names():
            where = f" (none in {ckpt.index.name})" if getattr(ckpt, "index", None) is not None else ""
            raise QShardError(
                f"{ckpt.dir}: checkpoint has no tensor '{name}' needed by {type(model).__name__}{where}"
            )
        if ckpt.shape(name) != shape:
            raise QShardError(
                f"{ckpt.files[name]}: tensor '{name}' has shape {list(ckpt.shape(name))}, "
                f"but config.json implies {list(shape)}"
            )
    tied = _tied_names(model)
    extra = sorted(n for n in ckpt.names() - expected.keys() if n not in tied and "rotary_emb.inv_freq" not in n)
    if extra:
        raise QShardError(
            f"{ckpt.files[extra[0]]}: tensor '{extra[0]}' is not part of {type(model).__name__} "
            f"({len(extra)} unexpected tensor(s)); is this checkpoint for another architecture?"
        )


def _tied_names(model: nn.Module) -> set[str]:
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unique = {n for n, _ in model.named_parameters()}
    return all_names - unique


# ---------------------------------------------------------------------------------------------------------------
# Writing full tensors into (possibly sharded) parameters.


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's dim-0 slice of `full` into `param` (a DTensor sharded by FSDP2, or a plain tensor),
    converting to the parameter's dtype."""
    local = param.to_local() if isinstance(param, DTensor) else param
    piece = local_rows(param, full)
    assert tuple(local.shape) == tuple(piece.shape), (local.shape, piece.shape)
    local.copy_(piece)


def local_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The dim-0 slice of `full` that this rank's shard of `param` holds (all of it when not sharded).
    `full` may be any tensor with `param`'s row count: FSDP2 splits rows as `torch.chunk` does."""
    if not isinstance(param, DTensor):
        return full
    # On a 2-D mesh (hybrid or no sharding) the rows are split over the shard dim only.
    return local_piece(full, param.device_mesh, param.placements)


def load_plan(model: nn.Module) -> list[tuple[str, Callable[[torch.Tensor], None]]]:
    """(checkpoint name, how to store that full tensor) for every tensor the model needs, in module order; the
    vocabulary tensors the model grows (`VocabResize`) get their new rows first."""
    plan: list[tuple[str, Callable[[torch.Tensor], None]]] = []
    seen: set[int] = set()
    splits: dict[int, LoRALinear] = {}  # id of a base -> its adapter, where the adapter starts from that base
    for module, prefix in module_sources(model):
        if isinstance(module, QuantizedExperts):
            for name in module.shapes:
                plan.append((join_name(prefix, name), functools.partial(_store_experts, getattr(module, name))))
        elif isinstance(module, QuantizedLinear):
            store = functools.partial(_store_quantized, module)
            plan.append((join_name(prefix, "weight"), _split_first(splits.get(id(module)), store)))
            if module.bias is not None:
                plan.append((join_name(prefix, "bias"), functools.partial(copy_full, module.bias)))
        elif isinstance(module, LoRALinear):
            if module.factors_from_base is not None:  # module_sources yields the adapter before its base
                splits[id(module.base)] = module
        else:
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    store = functools.partial(copy_full, param)
                    if name == "weight":
                        store = _split_first(splits.get(id(module)), store)
                    plan.append((join_name(prefix, name), store))
    resize = VocabResize.of(model)
    if resize is not None:
        plan = [(name, _growing(resize, store) if name in resize.names else store) for name, store in plan]
    return plan


def _split_first(adapter: LoRALinear | None, store: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """`store`, or where `adapter` starts from this base weight (PiSSA, OLoRA), `store` of the residual the adapter
    leaves of it: the full weight, on the device it streamed to, split before only this rank's rows are kept (and
    quantized), the same on every rank."""
    if adapter is None:
        return store
    return lambda weight: store(adapter.split_base(weight))


def _growing(resize: VocabResize, store: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    return lambda full: store(resize.grow(full))


def _quantized_rows(module: QuantizedLinear, weight: torch.Tensor) -> torch.Tensor:
    """The weight rows whose codes this rank's shard keeps. Storage offloaded to host memory
    (parallel/storage_offload.py) is a plain tensor per shard, so its sharding is asked of its `offloaded` record; the
    codes are then written below straight into that host tensor (a copy from the device, where they were
    quantized), so the quantized model never sits on the device whole."""
    if module.offloaded is not None:
        return module.offloaded.local_rows(weight)
    return local_rows(getattr(module, module.STORAGE[0]), weight)


def _store_quantized(module: QuantizedLinear, weight: torch.Tensor) -> None:
    """Quantize only the weight rows this rank's shard keeps. A method's rows are quantized on their own (no
    block straddles two rows: quant/linear.py), so these rows' codes and scales are exactly those of the whole
    weight; quantizing the rest would be work every other rank repeats."""
    rows = _quantized_rows(module, weight)
    if rows.shape[0] == 0:  # more ranks than rows: this one keeps none
        return
    # Quantized from the stored dtype (fp32, fp16 or bf16) as is: no rounding through bf16 first.
    for name, value in module.quantize(rows).items():
        param = getattr(module, name)
        # .view: under FSDP2 the storage is a float carrier of the same bytes (parallel/fsdp.py).
        local = (param.to_local() if isinstance(param, DTensor) else param).view(value.dtype)
        assert tuple(local.shape) == tuple(value.shape), (local.shape, value.shape)
        local.copy_(value)


def _store_experts(layer: QuantizedLinear, weight: torch.Tensor) -> None:
    _store_quantized(layer, weight.reshape(-1, weight.shape[-1]))  # [experts, out, in] -> experts' rows in turn


def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA adapter from one seeded generator, in module order, so the starting point
    is the same whatever the world size."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            a, b = module.init_adapter(generator)
            copy_full(module.lora_A, a.to(module.lora_A.device))
            copy_full(module.lora_B, b.to(module.lora_B.device))
