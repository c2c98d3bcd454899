"""Fill a sharded skeleton from a checkpoint, one tensor at a time.

The checkpoint is checked against the skeleton (every tensor present, every shape right, nothing
unexplained) before anything is read. Then each tensor is read into memory of its own (no long-lived
mapping of the file, see `weight_files`), moved to this rank's device, quantized there if its layer is
NF4, and only this rank's dim-0 slice is kept. Several threads read ahead of the tensor being stored,
within a fixed byte budget (`ReadOptions`), so the memory a load adds grows with the model's largest tensor
at most, not with its size.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from qshard import expert_layout
from qshard.adapters import LoRALinear
from qshard.errors import QShardError
from qshard.parallel.distributed import from_rank0, one_line
from qshard.parallel.mesh import local_piece
from qshard.quant import HQQLinear, NF4Linear, quantize_nf4
from qshard.quant.experts import NF4Experts
from qshard.weight_files import SafetensorsFile, TensorInfo, TorchBinFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"

log = logging.getLogger("qshard")


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
        self._bin_lock = threading.Lock()  # reads come from several threads (load_weights)
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
                files = {str(name): self._shard_path(index, name, fname) for name, fname in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise QShardError(f"{index}: not a valid checkpoint index ({exc})") from None
            missing = sorted({p for p in files.values() if not p.is_file()})
            if missing:
                raise QShardError(f"{index}: shard file {missing[0].name} is missing from {self.dir}")
            return files, index
        if (self.dir / SINGLE_FILE).is_file() or (self.dir / BIN_FILE).is_file():
            return {}, None
        raise QShardError(f"{self.dir}: no {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")

    def _shard_path(self, index: Path, name: str, fname) -> Path:
        """The file an index entry names: a path inside the model directory, spelled relative to it.
        (A file there may be a symlink to elsewhere, as in the Hugging Face cache, whose snapshot files
        all point into its blob store: the directory's owner put it there, the index cannot.)"""
        if not isinstance(fname, str):
            raise TypeError(f"entry for '{name}' is {fname!r}, not a file name")
        parts = PurePosixPath(fname).parts
        if not parts or PurePosixPath(fname).is_absolute() or ".." in parts:
            raise QShardError(f"{index}: entry '{name}' names {fname!r}, which is not a file inside {self.dir}")
        return self.dir / fname

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

    def segments(self, name: str) -> list[tuple[SafetensorsFile, str, int]] | None:
        """Where the tensor's bytes are, as (file, stored tensor, its byte count) whose bytes, one after the
        other, are the tensor's: the stored tensor itself, or for per-expert tensors stacked into a fused
        [experts, rows, cols] one, the experts' tensors in `sources()` order (each fills whole rows of its
        expert, so their bytes follow each other). Lets `load_weights` read a tensor in pieces, straight
        where it goes. None when a part is in a legacy .bin file, which is only read whole."""
        view = self._views.get(name)
        if view is not None and not isinstance(view, (expert_layout.Renamed, expert_layout.Stacked)):
            return None  # a layout not known to be a concatenation (none yet): read whole, through the view
        found = []
        for stored in view.sources() if view is not None else [name]:
            reader = self._readers[self._stored_files[stored]]
            if not isinstance(reader, SafetensorsFile):
                return None
            found.append((reader, stored, reader.tensors[stored].nbytes))
        # Stacked parts share the fused tensor's dtype (expert_layout checks it), so bytes add up to its bytes.
        assert sum(n for *_, n in found) == self._info[name].nbytes, (name, found)
        return found

    def _read_stored(self, name: str) -> torch.Tensor:
        reader = self._readers[self._stored_files[name]]
        if isinstance(reader, TorchBinFile):
            with self._bin_lock:
                if reader is not self._open_bin:
                    if self._open_bin is not None:
                        self._open_bin.close()  # at most one .bin mapping at a time
                    self._open_bin = reader
                return reader.read(name)
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


# How a checkpoint is read ahead of the tensor being stored (see `ReadOptions`, `_ReadAhead`).
#
# A piece of 16 MiB takes a few ms to copy out of the page cache, so what each read costs besides (a task
# handed to a thread, open, seek: tens of microseconds) stays below 1%, and the 1 GiB embedding of an 8B
# model becomes 64 reads spread over every thread.
PIECE_BYTES = 16 << 20
# CUDA: pieces go through 256 MiB of reused pinned buffers, 16 pieces, two per reader thread: each thread has
# a buffer to fill while the copy out of its previous one (under 1 ms for 16 MiB) drains. A fixed cost, whatever
# the model's size, well inside the ~1.5 GiB a load may add to a rank's resident memory.
CUDA_STAGING_BYTES = 256 << 20
# Elsewhere each tensor is read into host memory of its own and stored from there, on the CPU, where quantizing
# is far slower than reading: no budget, so exactly one tensor is read ahead (as many threads read its pieces).
# Measured on 2 cores: 32 MiB ahead loaded bf16 weights ~10% faster, NF4 no faster, and added ~25 MiB of
# resident memory (freed tensors interleaved with the kept shards in the heap until the next trim).
HOST_AHEAD_BYTES = 0
# Reads from the page cache scale over a few threads (memory copies that release the GIL); more only contend.
MAX_READ_THREADS = 8


@dataclass(frozen=True)
class ReadOptions:
    """How `load_weights` reads a checkpoint's safetensors files ahead of the tensor being stored.

    threads: reader threads.
    in_flight_bytes: the budget. Staged: the size of the staging ring. Otherwise: the bytes of the tensors read
        ahead of the one being stored; one tensor ahead is always allowed, however large (0: just that one).
    piece_bytes: the largest single read; a larger tensor is read in pieces, by several threads at once.
    staged: read the pieces into a ring of reused buffers (pinned on CUDA) and copy each from there into the
        tensor on the device, instead of reading whole tensors into host memory of their own."""

    threads: int
    in_flight_bytes: int
    piece_bytes: int = PIECE_BYTES
    staged: bool = False

    @staticmethod
    def for_device(device: torch.device) -> ReadOptions:
        try:
            cpus = len(os.sched_getaffinity(0))  # the cores this process may run on, not the machine's
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        threads = max(1, min(MAX_READ_THREADS, cpus))
        if device.type == "cuda":
            return ReadOptions(threads, CUDA_STAGING_BYTES, staged=True)
        return ReadOptions(threads, HOST_AHEAD_BYTES)


@dataclass(eq=False)
class _Job:
    """One tensor of the plan, as `_ReadAhead` reads it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    # (file, stored tensor, first byte in it, length, offset in this tensor's bytes) of each piece; None when
    # the source reads the tensor whole (a legacy .bin file).
    pieces: list[tuple[SafetensorsFile, str, int, int, int]] | None
    reads: list[Future] = field(default_factory=list)  # one per piece started, or the one whole read
    slots: list[int] = field(default_factory=list)  # staged: the staging buffer of each piece started
    out: torch.Tensor | None = None  # not staged: the host tensor the pieces are read into


class _StagingSlots:
    """`count` reused read buffers of `size` bytes each (one allocation), pinned on CUDA so that the copy of a
    piece to the device is an asynchronous DMA: it overlaps the next reads and the quantization, which this
    thread goes on to launch on the same stream meanwhile.

    A buffer must not be refilled before the copy out of it has finished: `release` records a CUDA event after
    the copy, and the read that next fills the buffer waits for that event, in its reader thread, so that this
    thread never waits for the GPU. Buffers are handed out in the order they were released, oldest copy first."""

    def __init__(self, count: int, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self._cuda = device.type == "cuda"
        self._buffer = None
        if self._cuda:
            try:
                self._buffer = torch.empty(count * size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:  # page-locked memory refused: plain memory, copies only synchronous
                log.warning("loading: no pinned staging memory (%s); copies to the GPU will not overlap reads", exc)
        if self._buffer is None:
            self._buffer = torch.empty(count * size, dtype=torch.uint8)
        self._free: deque[tuple[int, torch.cuda.Event | None]] = deque((slot, None) for slot in range(count))

    def acquire(self) -> tuple[int, torch.cuda.Event | None] | None:
        """A buffer and the event its refill must wait for; None while every buffer holds a piece not yet copied."""
        return self._free.popleft() if self._free else None

    def buffer(self, slot: int, length: int) -> torch.Tensor:
        return self._buffer[slot * self.size : slot * self.size + length]

    def release(self, slot: int) -> None:
        """Once the copy out of `slot` has been enqueued on the current stream."""
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._free.append((slot, event))

    def close(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()  # no copy reads the buffers any more
        self._buffer = None
        self._free.clear()
        if self._cuda and hasattr(torch._C, "_host_emptyCache"):
            # torch keeps freed pinned memory cached, and resident, once the events it records on freeing it
            # (just now, after the first synchronize) are done: wait for those too, then give the memory back.
            torch.cuda.current_stream(self.device).synchronize()
            torch._C._host_emptyCache()


def _read_piece(file: SafetensorsFile, stored: str, start: int, out, after: torch.cuda.Event | None) -> None:
    if after is not None:
        after.synchronize()  # the buffer's previous piece is on the device (waits without holding the GIL)
    file.read_range(stored, start, out)


class _ReadAhead:
    """Reads the plan's tensors on `options.threads` threads, ahead of the tensor being stored, within the byte
    budget of `options`, and hands them out in plan order (`take`), on `device`.

    A source for this has `segments(name)` (a `Checkpoint`), so that a tensor can be read in pieces straight
    into where it goes: a staging buffer, copied from there to the device (`options.staged`: CUDA), or else the
    host tensor that is then stored. Reads start in plan order, and only this thread starts them: before it
    waits for a tensor and after each it takes (no locks; the threads only read)."""

    def __init__(self, source, names: list[str], device: torch.device, options: ReadOptions) -> None:
        self.source, self.device, self.options = source, device, options
        self.jobs = [self._job(name) for name in names]
        self.staged = options.staged and any(job.pieces for job in self.jobs)
        self._pool = ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="qshard-read")
        count = max(1, options.in_flight_bytes // options.piece_bytes)
        self._slots = _StagingSlots(count, options.piece_bytes, device) if self.staged else None
        self._next = 0  # the first job whose reads have not all started
        self._ahead = 0  # bytes of unstaged jobs started and not yet taken
        self.peak_ahead = 0

    def _job(self, name: str) -> _Job:
        shape, dtype = tuple(self.source.shape(name)), self.source.dtype(name)
        segments = self.source.segments(name)
        pieces = None
        if segments is not None:
            pieces, offset, step = [], 0, self.options.piece_bytes
            for file, stored, size in segments:
                pieces += [(file, stored, start, min(step, size - start), offset + start)
                           for start in range(0, size, step)]
                offset += size
        return _Job(name, shape, dtype, _numel(shape) * dtype.itemsize, pieces)

    def __enter__(self) -> _ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        # On an error, reads not started are dropped and running ones finish before their buffers go.
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._slots is not None:
            self._slots.close()

    def _staged(self, job: _Job) -> bool:
        return self.staged and job.pieces is not None

    def _start_piece(self, job: _Job) -> bool:
        """Start the next piece of `job` (that of `self._next`) if a staging buffer is free."""
        got = self._slots.acquire()
        if got is None:
            return False
        slot, after = got
        file, stored, start, length, _ = job.pieces[len(job.reads)]
        out = memoryview(self._slots.buffer(slot, length).numpy())
        job.slots.append(slot)
        job.reads.append(self._pool.submit(_read_piece, file, stored, start, out, after))
        return True

    def _start(self) -> None:
        """Start reads, in plan order, until the budget is spent."""
        while self._next < len(self.jobs):
            job = self.jobs[self._next]
            if self._staged(job):
                if len(job.reads) < len(job.pieces) and not self._start_piece(job):
                    return  # every staging buffer holds a piece not yet copied
                if len(job.reads) == len(job.pieces):
                    self._next += 1
                continue
            if self._ahead and self._ahead + job.nbytes > self.options.in_flight_bytes:
                return
            self._ahead += job.nbytes
            self.peak_ahead = max(self.peak_ahead, self._ahead)
            if job.pieces is None:
                job.reads.append(self._pool.submit(self.source.read, job.name))
            else:
                job.out = torch.empty(job.shape, dtype=job.dtype)
                out = memoryview(job.out.reshape(-1).view(torch.uint8).numpy())
                job.reads += [self._pool.submit(_read_piece, file, stored, start, out[offset : offset + length], None)
                              for file, stored, start, length, offset in job.pieces]
            self._next += 1

    def take(self, i: int) -> torch.Tensor:
        """Plan tensor i, full, on the device; call for i = 0, 1, ... in turn."""
        job = self.jobs[i]
        self._start()  # nothing is ahead of job i any more: its reads can start, whatever their size
        if self._staged(job):
            full = torch.empty(job.shape, dtype=job.dtype, device=self.device)
            flat = full.reshape(-1).view(torch.uint8)
            for k, (*_, length, offset) in enumerate(job.pieces):
                if len(job.reads) == k:
                    # Not started for want of a buffer: every one is free by now (all pieces before this one are
                    # copied), if perhaps still being copied out of; the read waits for that, not this thread.
                    started = self._start_piece(job)
                    assert started and self._next == i
                job.reads[k].result()  # a reader's error is raised here
                flat[offset : offset + length].copy_(self._slots.buffer(job.slots[k], length), non_blocking=True)
                self._slots.release(job.slots[k])
                self._start()
        else:
            results = [read.result() for read in job.reads]  # a reader's error is raised here
            full = job.out if job.pieces is not None else results[0]
            del results
            self._ahead -= job.nbytes
            self._start()  # the next tensors are read while this one is stored
            full = full.to(self.device)
        job.reads, job.slots, job.out = [], [], None
        return full


class _OneAhead:
    """Reads for a source with no `segments` (random values made on the device, rank 0's broadcasts), each
    tensor whole: the next one is read on a helper thread while this one is stored, or, when the source's reads
    must stay on this thread in plan order (collectives: `prefetch = False`), here."""

    def __init__(self, source: TensorSource, names: list[str], device: torch.device) -> None:
        self.source, self.names, self.device = source, names, device
        threaded = getattr(source, "prefetch", True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qshard-read") if threaded else None
        self._pending = None

    def __enter__(self) -> _OneAhead:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None

    def _fetch(self, i: int):
        if i >= len(self.names):
            return None
        if self._pool is None:
            return _Done(self.source.read(self.names[i]))
        return self._pool.submit(self.source.read, self.names[i])

    def take(self, i: int) -> torch.Tensor:
        pending = self._fetch(i) if self._pending is None else self._pending
        full = pending.result()
        self._pending = self._fetch(i + 1)  # read while this one is stored
        return full.to(self.device)


def load_weights(model: nn.Module, source: TensorSource, device: torch.device,
                 options: ReadOptions | None = None) -> None:
    """Stream every tensor the model needs into its (sharded) parameters on `device`.

    From a source that can say where a tensor's bytes are (`segments`: a `Checkpoint`), several threads read
    ahead of the tensor being stored, large tensors in pieces, within the byte budget of `options` (by default
    `ReadOptions.for_device`); on CUDA through reused pinned buffers, so that copies to the device do not hold
    up this thread. Besides the rank's shards a process then holds the tensor being stored and the budget (or
    one tensor ahead, when larger). Other sources read each tensor whole, one ahead (`_OneAhead`)."""
    device = torch.device(device)
    plan = load_plan(model)
    names = [name for name, _ in plan]
    if hasattr(source, "segments") and getattr(source, "prefetch", True):
        reads = _ReadAhead(source, names, device, options or ReadOptions.for_device(device))
    else:
        reads = _OneAhead(source, names, device)
    freed = 0
    finite = _FiniteCheck(names, device)
    with reads:
        for i, (_, store) in enumerate(plan):
            full = reads.take(i)
            finite.record(i, full)  # the full tensor as stored in the file: quantizing could hide a NaN
            with torch.no_grad():
                store(full)
            freed += full.nbytes
            del full
            if freed > TRIM_EVERY_BYTES:
                freed = _release_freed_memory()
    _release_freed_memory()
    finite.raise_if_any(source)
    if hasattr(source, "close"):
        source.close()


class _FiniteCheck:
    """Which loaded tensors hold a NaN or an infinity. Each tensor's smallest and largest value (NaN when it
    holds one) is written on the device as the tensor is stored, and all of them are read once, after the
    load: reading each one at once would make the loader wait for the device at every tensor."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        # float64 holds any stored dtype's extremes exactly (a float32 copy would turn a large fp64 into inf).
        self.extremes = torch.zeros(len(names), 2, dtype=torch.float64, device=device)

    @torch.no_grad()
    def record(self, i: int, full: torch.Tensor) -> None:
        """Note the extremes of plan tensor i (`full`, on the device); nothing waits for them."""
        if full.is_floating_point() and full.numel():
            low, high = torch.aminmax(full)  # one pass, no temporary as large as the tensor
            self.extremes[i, 0], self.extremes[i, 1] = low, high

    def raise_if_any(self, source: TensorSource) -> None:
        """One QShardError naming the first tensor (in load order) with a NaN or an infinity, its file and its
        count of each: read again from `source` to count them (a collective under broadcast loading, where
        every rank got the same bytes, so every rank is here with the same tensor)."""
        finite = torch.isfinite(self.extremes).all(dim=1).tolist()  # the load's one wait for these
        bad = [name for name, ok in zip(self.names, finite, strict=True) if not ok]
        if not bad:
            return
        values = source.read(bad[0])
        counts = [(int(values.isnan().sum()), "NaN"), (int(values.isinf().sum()), "infinite")]
        what = " and ".join(f"{n} {kind}" for n, kind in counts if n)
        where = getattr(source, "files", {}).get(bad[0])
        more = f" ({len(bad) - 1} more tensor(s) hold some too)" if len(bad) > 1 else ""
        raise QShardError(
            f"{bad[0]}{f' in {where}' if where else ''} holds {what} values{more}: a damaged or diverged "
            "checkpoint; qshard does not train on it (re-download or re-convert the model)"
        )


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
            meta[0] = ("error", one_line(exc))
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


# Files of a model directory that hold weights; every other file (config, tokenizer, generation config)
# is what a rank needs besides the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
SHARED_FILE_MAX_BYTES = 256 << 20  # larger non-weight files (an optimizer dump left in the directory) stay


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
