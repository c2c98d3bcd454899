"""Fill a sharded skeleton from a checkpoint, one tensor at a time.

The checkpoint is checked against the skeleton (every tensor present, every shape right, nothing
unexplained) before anything is read. Then each tensor is read into memory of its own (no long-lived
mapping of the file, see `weight_files`), moved to this rank's device, quantized there if its layer is
NF4, and only this rank's dim-0 slice is kept. Beyond its own shards a process holds at most two full
tensors: the one being stored and the next one, read meanwhile.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from qshard import expert_layout
from qshard.adapters import LoRALinear
from qshard.errors import QShardError
from qshard.parallel.mesh import local_piece
from qshard.quant import HQQLinear, NF4Linear, quantize_nf4
from qshard.quant.experts import NF4Experts
from qshard.weight_files import SafetensorsFile, TensorInfo, TorchBinFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"


class Checkpoint:
    """A single or sharded safetensors checkpoint (or a legacy PyTorch `.bin` one): which file holds each
    tensor, its shape and dtype from the file headers, and reads of one tensor at a time."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.files, self.index = self._tensor_files()
        if self.index is None:  # a single file holds every tensor
            single = self.dir / SINGLE_FILE
            paths = [single if single.is_file() else self.dir / BIN_FILE]
        else:
            paths = sorted(set(self.files.values()))
        self._readers = {p: (TorchBinFile if p.suffix == ".bin" else SafetensorsFile)(p) for p in paths}
        self._open_bin: TorchBinFile | None = None
        self._views: dict[str, expert_layout.Renamed | expert_layout.Stacked] = {}
        if self.index is None:
            self.files = dict.fromkeys(self._readers[paths[0]].tensors, paths[0])
        self._info: dict[str, TensorInfo] = {}
        for name, path in self.files.items():
            # The index is authoritative: a tensor that a shard holds but the index assigns elsewhere
            # (or nowhere) has no file to be read from.
            if name not in self._readers[path].tensors:
                raise QShardError(f"{path}: tensor '{name}' listed in {self.index.name} is absent")
            self._info[name] = self._readers[path].tensors[name]
        self._stored_files = dict(self.files)  # `files` lists what `adapt` shows; this, what is on disk

    def _tensor_files(self) -> tuple[dict[str, Path], Path | None]:
        for index_name in (INDEX_FILE, BIN_INDEX_FILE):
            index = self.dir / index_name
            if not index.is_file():
                continue
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {str(name): self.dir / fname for name, fname in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise QShardError(f"{index}: not a valid checkpoint index ({exc})") from None
            missing = sorted({p for p in files.values() if not p.is_file()})
            if missing:
                raise QShardError(f"{index}: shard file {missing[0].name} is missing from {self.dir}")
            return files, index
        if (self.dir / SINGLE_FILE).is_file() or (self.dir / BIN_FILE).is_file():
            return {}, None
        raise QShardError(f"{self.dir}: no {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name].dtype

    def adapt(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Show the tensors that an older layout stores differently (per-expert MoE tensors, renamed
        modules) under the names `expected` holds; the stored tensors they are made of are no longer listed."""
        found = expert_layout.views(expected, {n: (i.shape, i.dtype) for n, i in self._info.items()},
                                    lambda n: str(self.files[n]))
        for name, view in found.items():
            sources = view.sources()
            first = self._info[sources[0]]
            shape = expected[name] if isinstance(view, expert_layout.Stacked) else first.shape
            self.files[name] = self.files[sources[0]]
            self._info[name] = TensorInfo(first.dtype, shape, 0, first.dtype.itemsize * _numel(shape))
            self._views[name] = view
        for view in found.values():
            for source in view.sources():
                self._info.pop(source, None)
                self.files.pop(source, None)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor, in its stored dtype, in memory of its own (no mapping of the file stays)."""
        if name in self._views:
            return self._views[name].read(self._read_stored)
        return self._read_stored(name)

    def _read_stored(self, name: str) -> torch.Tensor:
        reader = self._readers[self._stored_files[name]]
        if isinstance(reader, TorchBinFile) and reader is not self._open_bin:
            if self._open_bin is not None:
                self._open_bin.close()  # at most one .bin mapping at a time
            self._open_bin = reader
        return reader.read(name)

    def close(self) -> None:
        if self._open_bin is not None:
            self._open_bin.close()
            self._open_bin = None


# ---------------------------------------------------------------------------------------------------------------
# Which checkpoint tensor feeds which parameter.


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def module_sources(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Yield (module, checkpoint prefix) for every module, where the prefix skips the `.base` hop that
    a LoRALinear adds, so the base layer reads the original linear's tensors."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[nn.Module, str]]:
        yield module, prefix
        if isinstance(module, NF4Experts):
            return  # its NF4 children hold the module's own 3-D tensors, read under the module's names
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
        if isinstance(module, NF4Experts):
            expected.update({join_name(prefix, name): shape for name, shape in module.shapes.items()})
            continue
        if isinstance(module, (NF4Linear, HQQLinear)):
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


class TensorSource(Protocol):
    """Where full tensors come from: a checkpoint, random values, or rank 0 over the network."""

    def read(self, name: str) -> torch.Tensor: ...


def load_plan(model: nn.Module) -> list[tuple[str, Callable[[torch.Tensor], None]]]:
    """(checkpoint name, how to store that full tensor) for every tensor the model needs, in module order."""
    plan: list[tuple[str, Callable[[torch.Tensor], None]]] = []
    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if isinstance(module, NF4Experts):
            for name in module.shapes:
                plan.append((join_name(prefix, name), functools.partial(_store_nf4_experts, getattr(module, name))))
        elif isinstance(module, (NF4Linear, HQQLinear)):
            store = _store_nf4 if isinstance(module, NF4Linear) else _store_hqq
            plan.append((join_name(prefix, "weight"), functools.partial(store, module)))
            if module.bias is not None:
                plan.append((join_name(prefix, "bias"), functools.partial(copy_full, module.bias)))
        elif not isinstance(module, LoRALinear):
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    plan.append((join_name(prefix, name), functools.partial(copy_full, param)))
    return plan


# glibc keeps freed buffers of a few MiB in its heap, where they count as resident and, interleaved with
# the shards a CPU rank keeps, cannot be reused for larger tensors: hand them back every so often.
TRIM_EVERY_BYTES = 256 << 20
try:
    _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def _release_freed_memory() -> int:
    if _malloc_trim is not None:
        _malloc_trim(0)
    return 0


def _quantized_rows(module: NF4Linear | HQQLinear, weight: torch.Tensor) -> torch.Tensor:
    """The weight rows whose codes this rank's shard keeps. Storage offloaded to host memory
    (parallel/offload.py) is a plain tensor per shard, so its sharding is asked of its `offloaded` record; the
    codes are then written below straight into that host tensor (a copy from the device, where they were
    quantized), so the quantized model never sits on the device whole."""
    if module.offloaded is not None:
        return module.offloaded.local_rows(weight)
    return local_rows(module.packed, weight)


def _store_nf4(module: NF4Linear, weight: torch.Tensor) -> None:
    """Quantize only the weight rows this rank's shard keeps. NF4Linear requires in_features to be a multiple
    of the blocksize, so no NF4 block straddles two rows and these rows' codes and scales are exactly those
    of the whole weight; quantizing the rest would be work every other rank repeats."""
    rows = _quantized_rows(module, weight)
    if rows.shape[0] == 0:  # more ranks than rows: this one keeps none
        return
    # Quantized from the stored dtype (fp32, fp16 or bf16) as is: no rounding through bf16 first.
    packed, absmax = quantize_nf4(rows, module.blocksize)
    for param, value in ((module.packed, packed), (module.absmax, absmax)):
        # .view: under FSDP2 the storage is a float carrier of the same bytes (parallel/fsdp.py).
        local = (param.to_local() if isinstance(param, DTensor) else param).view(value.dtype)
        assert tuple(local.shape) == tuple(value.shape), (local.shape, value.shape)
        local.copy_(value)


def _store_hqq(module: HQQLinear, weight: torch.Tensor) -> None:
    """As `_store_nf4`: HQQ groups never straddle rows either, so only this rank's rows are quantized."""
    rows = _quantized_rows(module, weight)
    if rows.shape[0] == 0:
        return
    for name, value in module.quantize(rows).items():
        param = getattr(module, name)
        # .view: under FSDP2 the storage is a float carrier of the same bytes (parallel/fsdp.py).
        local = (param.to_local() if isinstance(param, DTensor) else param).view(value.dtype)
        assert tuple(local.shape) == tuple(value.shape), (local.shape, value.shape)
        local.copy_(value)


def _store_nf4_experts(layer: NF4Linear, weight: torch.Tensor) -> None:
    _store_nf4(layer, weight.reshape(-1, weight.shape[-1]))  # [experts, out, in] -> experts' rows in turn


class _Done:
    """A read done in this thread, with the interface of a Future."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


def load_weights(model: nn.Module, source: TensorSource, device: torch.device) -> None:
    """Stream every tensor the model needs into its (sharded) parameters on `device`.

    The next tensor is read by a helper thread while this one is moved, quantized and sliced (file
    reads release the GIL), so at most two full tensors are held at once besides the rank's shards."""
    plan = load_plan(model)
    freed = 0
    workers = 1 if getattr(source, "prefetch", True) else 0
    with ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="qshard-read") as pool:
        def fetch(i: int):
            if i >= len(plan):
                return None
            return pool.submit(source.read, plan[i][0]) if workers else _Done(source.read(plan[i][0]))

        pending = fetch(0)
        for i, (_, store) in enumerate(plan):
            full = pending.result()
            pending = fetch(i + 1)
            with torch.no_grad():
                store(full.to(device))
            freed += full.nbytes
            del full
            if freed > TRIM_EVERY_BYTES:
                freed = _release_freed_memory()
    _release_freed_memory()
    if hasattr(source, "close"):
        source.close()


def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialize every LoRA adapter from one seeded generator, in module order, so the starting point
    is the same whatever the world size."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            a, b = module.init_adapter(generator)
            copy_full(module.lora_A, a.to(module.lora_A.device))
            copy_full(module.lora_B, b.to(module.lora_B.device))


# ---------------------------------------------------------------------------------------------------------------
# Sources other than this process's own files.


class RandomSource:
    """Random weights for a model with no checkpoint, generated tensor by tensor on `device` (so a 70B
    shape costs one tensor of host memory at most, none on a GPU run).

    Each tensor's values depend only on the seed and its name, so every rank, whatever the world size,
    generates the same full tensor and keeps its own slice; `random_model.write_random_checkpoint` writes
    the same values."""

    def __init__(self, model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.expected = expected_tensors(model)
        self.seed, self.device, self.dtype = seed, device, dtype

    def read(self, name: str) -> torch.Tensor:
        from qshard.random_model import random_tensor

        return random_tensor(name, self.expected[name], self.seed, self.device, self.dtype)


class BroadcastSource:
    """Rank 0 reads each tensor from its files and broadcasts it; the other ranks need no files.

    Every rank first gets rank 0's view of the checkpoint (names, shapes, dtypes, which file) or its
    error, so all of them run the same checks and raise the same QShardError."""

    prefetch = False  # collectives stay on the main thread, in plan order

    def __init__(self, model_dir: str | Path, is_main: bool, device: torch.device) -> None:
        self._ckpt: Checkpoint | None = None
        self.device = device
        self._share(lambda: setattr(self, "_ckpt", Checkpoint(model_dir)) if is_main else None)

    def adapt(self, expected: dict[str, tuple[int, ...]]) -> None:
        """`Checkpoint.adapt` on rank 0; every rank then gets the names it shows (a collective)."""
        self._share(lambda: self._ckpt.adapt(expected) if self._ckpt is not None else None)

    def _share(self, on_main: Callable[[], None]) -> None:
        """Run `on_main` (a no-op on the other ranks), then give every rank rank 0's view, or its error."""
        meta: list = [None]
        try:
            on_main()
            if self._ckpt is not None:
                ckpt = self._ckpt
                meta[0] = ("ok", str(ckpt.dir), ckpt.index and str(ckpt.index),
                           {n: (ckpt.shape(n), ckpt.dtype(n), str(ckpt.files[n])) for n in ckpt.names()})
        except Exception as exc:  # any failure on rank 0 must reach the others, which wait in the broadcast
            meta[0] = ("error", _one_line(exc))
        dist.broadcast_object_list(meta, src=0)
        if meta[0][0] == "error":
            raise QShardError(meta[0][1])
        _, directory, index, tensors = meta[0]
        self.dir, self.index = Path(directory), index and Path(index)
        self._info = {n: (tuple(shape), dtype) for n, (shape, dtype, _) in tensors.items()}
        self.files = {n: Path(p) for n, (_, _, p) in tensors.items()}

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name][1]

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self._info[name]
        if self._ckpt is not None:
            tensor = self._ckpt.read(name).to(self.device)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        # As bytes: every backend broadcasts uint8, not every one bf16 or bool.
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=0)
        return tensor

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


T = TypeVar("T")
# Files of a model directory that hold weights; every other file (config, tokenizer, generation config)
# is what a rank needs besides the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
SHARED_FILE_MAX_BYTES = 256 << 20  # larger non-weight files (an optimizer dump left in the directory) stay


def _one_line(exc: Exception) -> str:
    """A QShardError's own message; anything else (an OSError reading the files, ...) named by its type."""
    return str(exc) if isinstance(exc, QShardError) else f"on rank 0: {type(exc).__name__}: {exc}"


def from_rank0(compute: Callable[[], T], is_main: bool) -> T:
    """`compute()` run on rank 0 only, its result given to every rank; an error it raises is raised on
    every rank as a QShardError (a collective: no rank waits forever for a rank 0 that failed)."""
    box: list = [None]
    if is_main:
        try:
            box[0] = ("ok", compute())
        except Exception as exc:
            box[0] = ("error", _one_line(exc))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise QShardError(value)
    return value


def model_files_from_rank0(model_dir: str | Path | None, is_main: bool) -> Path:
    """Under broadcast loading: rank 0's model directory on rank 0; on every other rank, a local temporary
    directory holding copies of its config.json and tokenizer files, sent by rank 0 (a collective). The
    other ranks need no access to the model directory at all."""

    def read() -> dict[str, bytes]:
        from qshard.models import load_hf_config  # checks the directory and config.json, as every load does

        if model_dir is None:
            raise QShardError("model.path: no model directory given (and no model.shape)")
        load_hf_config(model_dir)
        return {f.name: f.read_bytes() for f in sorted(Path(model_dir).iterdir())
                if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size <= SHARED_FILE_MAX_BYTES}

    files = from_rank0(read, is_main)
    if is_main:
        return Path(model_dir)
    local = Path(tempfile.mkdtemp(prefix="qshard-model-files-"))
    atexit.register(shutil.rmtree, local, True)
    for name, data in files.items():
        (local / name).write_bytes(data)
    return local
