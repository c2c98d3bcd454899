"""The threaded read-ahead: stream every tensor of the plan onto the device, then check that all are finite.

Each tensor is read into memory of its own (no long-lived mapping of the file, see `weight_files`) and moved
to this rank's device, where its plan entry stores it. Several threads read ahead of the tensor being
stored, within a fixed byte budget (`ReadOptions`), so the memory a load adds grows with the model's largest
tensor at most, not with its size; on CUDA the reads go through a ring of reused pinned buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

from qshard.errors import QShardError
from qshard.host_embedding import HOST, host_tensor_names
from qshard.loading.plan import load_plan
from qshard.loading.weight_files import SafetensorsFile

log = logging.getLogger("qshard")


class TensorSource(Protocol):
    """Where full tensors come from: a checkpoint, random values, or rank 0 over the network."""

    def read(self, name: str) -> torch.Tensor: ...


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
# is far slower than reading: no budget, so exactly one tensor is read ahead (as many threads read its pieces);
# reading further ahead gained little and kept freed tensors interleaved with the shards in the heap.
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

    def __init__(self, source, names: list[str], device: torch.device, options: ReadOptions,
                 host: frozenset[str] = frozenset()) -> None:
        self.source, self.device, self.options, self.host = source, device, options, host
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
        return _Job(name, shape, dtype, math.prod(shape) * dtype.itemsize, pieces)

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
        """Plan tensor i, full, on the device (in host memory if named in `host`); call for i = 0, 1, ... in turn."""
        job = self.jobs[i]
        target = HOST if job.name in self.host else self.device
        self._start()  # nothing is ahead of job i any more: its reads can start, whatever their size
        if self._staged(job):
            full = torch.empty(job.shape, dtype=job.dtype, device=target)
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
            full = full.to(target)
        job.reads, job.slots, job.out = [], [], None
        return full


class _OneAhead:
    """Reads for a source with no `segments` (random values made on the device, rank 0's broadcasts), each
    tensor whole: the next one is read on a helper thread while this one is stored, or, when the source's reads
    must stay on this thread in plan order (collectives: `prefetch = False`), here."""

    def __init__(self, source: TensorSource, names: list[str], device: torch.device,
                 host: frozenset[str] = frozenset()) -> None:
        self.source, self.names, self.device, self.host = source, names, device, host
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
        return full.to(HOST if self.names[i] in self.host else self.device)


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
    host = host_tensor_names(model)  # model.embedding_on_host: read into host memory, never onto the device
    if hasattr(source, "segments") and getattr(source, "prefetch", True):
        reads = _ReadAhead(source, names, device, options or ReadOptions.for_device(device), host)
    else:
        reads = _OneAhead(source, names, device, host)
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
