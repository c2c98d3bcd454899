"""Fill a sharded skeleton from a safetensors checkpoint, one tensor at a time.

The checkpoint is checked against the skeleton (every tensor present, every shape right, nothing
unexplained) before anything is read. Then each tensor is read from the memory-mapped file, moved to
this rank's device, quantized there if its layer is NF4, and only this rank's dim-0 slice is kept.
No process ever holds more than one full tensor beyond its own shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from qshard.adapters import LoRALinear
from qshard.errors import QShardError
from qshard.quant import NF4Linear, quantize_nf4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """A single or sharded safetensors checkpoint: which file holds each tensor, and lazy reads."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self.files: dict[str, Path] = self._tensor_files()
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(self.files.values())):
            handle = self._open(path)
            for name in handle.keys():
                # The index is authoritative: a tensor that a shard holds but the index assigns elsewhere
                # (or nowhere) would have a shape here and no file to be read from.
                if self.files.get(name) == path:
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())
        absent = sorted(n for n, p in self.files.items() if n not in self._shapes)
        if absent:
            raise QShardError(f"{self.files[absent[0]]}: tensor '{absent[0]}' listed in {INDEX_FILE} is absent")

    def _tensor_files(self) -> dict[str, Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise QShardError(f"{index}: not a valid safetensors index ({exc})") from None
            files = {name: self.dir / fname for name, fname in weight_map.items()}
            missing = sorted({p for p in files.values() if not p.is_file()})
            if missing:
                raise QShardError(f"{index}: shard file {missing[0].name} is missing from {self.dir}")
            return files
        single = self.dir / SINGLE_FILE
        if single.is_file():
            return {name: single for name in self._open(single).keys()}
        if list(self.dir.glob("*.bin")):
            raise QShardError(f"{self.dir}: only PyTorch .bin weights found; qshard reads safetensors checkpoints")
        raise QShardError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise QShardError(f"{path}: cannot read safetensors file ({exc})") from None
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str) -> torch.Tensor:
        path = self.files[name]
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise QShardError(f"{path}: cannot read tensor '{name}' ({exc})") from None


# ---------------------------------------------------------------------------------------------------------------
# Which checkpoint tensor feeds which parameter.


def module_sources(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Yield (module, checkpoint prefix) for every module, where the prefix skips the `.base` hop that
    a LoRALinear adds, so the base layer reads the original linear's tensors."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[nn.Module, str]]:
        yield module, prefix
        for name, child in module.named_children():
            child_prefix = prefix if isinstance(module, LoRALinear) and name == "base" else join_name(prefix, name)
            yield from walk(child, child_prefix)

    yield from walk(model, "")


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> full shape, for every tensor the skeleton needs from the checkpoint."""
    expected: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if isinstance(module, NF4Linear):
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
    return expected


def check_checkpoint(ckpt: Checkpoint, model: nn.Module) -> None:
    """Every needed tensor present with the right shape, and no tensor left unexplained."""
    expected = expected_tensors(model)
    for name, shape in expected.items():
        if name not in ckpt.names():
            where = f" (none in {INDEX_FILE})" if (ckpt.dir / INDEX_FILE).is_file() else ""
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
    """Copy this rank's dim-0 slice of `full` into `param` (a DTensor sharded by FSDP2, or a plain tensor)."""
    if isinstance(param, DTensor):
        local = param.to_local()
        mesh = param.device_mesh
        chunks = torch.chunk(full, mesh.size(), dim=0)
        index = mesh.get_local_rank()
        piece = chunks[index] if index < len(chunks) else full[:0]
    else:
        local, piece = param, full
    assert tuple(local.shape) == tuple(piece.shape), (local.shape, piece.shape)
    local.copy_(piece)


def load_weights(model: nn.Module, ckpt: Checkpoint, device: torch.device) -> None:
    """Stream every checkpoint tensor the model needs into its (sharded) parameters on `device`."""
    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if isinstance(module, NF4Linear):
            weight = ckpt.read(join_name(prefix, "weight")).to(device)
            packed, absmax = quantize_nf4(weight, module.blocksize)
            del weight
            copy_full(module.packed, packed)
            copy_full(module.absmax, absmax)
            if module.bias is not None:
                copy_full(module.bias, ckpt.read(join_name(prefix, "bias")).to(device, module.bias.dtype))
            continue
        if isinstance(module, LoRALinear):
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            copy_full(param, ckpt.read(join_name(prefix, name)).to(device, param.dtype))


def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA adapter from one seeded generator, in module order, so the starting point
    is the same whatever the world size."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            a, b = module.init_adapter(generator)
            copy_full(module.lora_A, a.to(module.lora_A.device))
            copy_full(module.lora_B, b.to(module.lora_B.device))
