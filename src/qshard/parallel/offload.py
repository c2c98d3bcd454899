"""CPU offload: FSDP2's parameter/gradient/optimizer-state offload, and activation offload to pinned memory.

Parameters: FSDP2's CPUOffloadPolicy keeps each rank's shards (and their gradients) on the CPU, copies a
block's shards to the GPU for its all-gather, and the optimizer then steps on the CPU. The model is still
materialized and loaded on the GPU (each rank's shards, as without offload); FSDP2 moves the shards to
pinned CPU memory when the first forward initializes it. A frozen untied embedding and head are not offloaded
(parallel/fsdp.py, resident_embedding_and_head). Quantized storage under `quant_sharding: dtensor` is outside
FSDP2 and offloaded by parallel/storage_offload.py.

Activations: tensors that autograd saves for backward are copied to pinned CPU memory on a side stream
while compute goes on, into host buffers of a pool reused from step to step (`HostPool`), and copied back
on that stream a block ahead of backward's need (`OffloadActivations`); what the last block and the head save,
which backward needs first, stays on the GPU. Parameters are left in place (copying a weight out and back would
only cost time). With activation checkpointing the checkpointed blocks save nothing but their inputs (and what
parallel.ac_save_projections keeps), and those move too (hidden size x dtype bytes per token per block), with
what blocks not checkpointed save. On a CPU-only machine activations already live in host memory: nothing to do.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from qshard.config import Config, ParallelConfig

log = logging.getLogger("qshard")


def offload_policy(parallel: ParallelConfig) -> OffloadPolicy:
    """FSDP2's offload policy for every unit: none, or parameters, gradients and optimizer state on the CPU."""
    if not parallel.cpu_offload:
        return OffloadPolicy()
    # Pinned host memory makes the host<->GPU copies asynchronous; there is nothing to pin without CUDA.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def optimizer_device(cfg: Config, device: torch.device) -> torch.device:
    """Where the optimizer's tensors live, and so which AdamW implementation suits them."""
    return torch.device("cpu") if cfg.parallel.cpu_offload else device


class HostPool:
    """Host buffers for offloaded activations, handed out again from step to step (the same tensors are saved
    every step), so the host memory they take stays at one step's worth.

    Why exact sizes: torch's pinned-memory allocator rounds each allocation up to a power of two, so a block
    input of 2.8 GB (342k tokens of an 8B model) would take 4 GiB, and the checkpoints of all blocks 1.4x
    what they hold. The pool instead page-locks plain host tensors of exactly the size asked for
    (cudaHostRegister). A buffer is reused for the smallest request it fits, once the last copy that used it
    has passed (its event); when none fits, the free buffers smaller than the request are dropped first, so
    the pool stays near one step's worth as lengths vary."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[int, list[_HostBuffer]] = {}
        self.sizes: list[int] = []  # the keys of `free` with buffers in them, ascending
        self.nbytes = 0  # held in all, in use or free
        self.in_use = 0
        self.allocations = 0

    def take(self, nbytes: int) -> _HostBuffer:
        i = bisect.bisect_left(self.sizes, nbytes)
        if i < len(self.sizes):
            size = self.sizes[i]
            buffer = self.free[size].pop()
            if not self.free[size]:
                del self.sizes[i]
        else:
            self._release_below(nbytes)
            buffer = _HostBuffer(host_bytes(nbytes, self.pin))
            self.nbytes += nbytes
            self.allocations += 1
        self.in_use += buffer.size
        return buffer

    def _release_below(self, nbytes: int) -> None:
        """Drop the free buffers smaller than `nbytes`: a request none fits means the tensors saved have grown
        (longer sequences), and keeping the smaller ones would let the pool grow with every new length."""
        while self.sizes and self.sizes[0] < nbytes:
            size = self.sizes.pop(0)
            for buffer in self.free.pop(size):
                if buffer.last_use is not None:  # its last copy must be done before its memory goes
                    buffer.last_use.synchronize()
                self.nbytes -= buffer.size

    def give(self, buffer: _HostBuffer) -> None:
        self.in_use -= buffer.size
        if not self.free.get(buffer.size):
            self.free[buffer.size] = []
            bisect.insort(self.sizes, buffer.size)
        self.free[buffer.size].append(buffer)


class _HostBuffer:
    def __init__(self, host: torch.Tensor) -> None:
        self.host, self.size = host, host.numel()
        self.last_use = None  # the event of the last copy into or out of it (CUDA)


def host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory, page-locked at exactly that size where `pin`; unlocked when the tensor goes."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if pin:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))
        weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
    return host


class _Offloaded:
    """A saved tensor's copy in a pool buffer, and once backward asks for it (or for the group after its own), the
    tensor back on the device; the buffer goes back to the pool when autograd drops this."""

    def __init__(self, pool: HostPool, buffer: _HostBuffer, host: torch.Tensor, device: torch.device,
                 group: int, strides: tuple[int, ...] | None) -> None:
        self.pool, self.buffer, self.host, self.device = pool, buffer, host, device
        self.group = group  # the last group whose forward saved it: it comes back with that group
        self.strides = strides  # the saved tensor's, where it comes back with them (None: contiguous)
        self.restored: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None  # the copy back's end, on the side stream
        self.used = False  # handed to backward, which waited for `ready` on the compute stream

    def __del__(self) -> None:
        # Brought back but never handed over (a node backward did not run): the device memory goes back to the
        # compute stream's pool, which must not reuse it before the side stream's copy into it is done.
        if self.ready is not None and not self.used:
            self.ready.synchronize()
        self.pool.give(self.buffer)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """The forward of one micro-batch of `tokens` tokens: the tensors of `device_type` it saves for backward go
    to host buffers of `pool` (through `stream`, a side CUDA stream, where given; else synchronously);
    backward brings them back (the unpack hooks travel with the saved tensors).

    The saved tensors are grouped by the block whose forward saved them (`end_block`, called by a hook at the end
    of each block's forward). Backward needs the groups in reverse: when it asks for a tensor of one group, the
    group before is copied back on the side stream while the compute stream runs this one's backward, and the last
    group is copied back as soon as the forward ends, so that backward waits for no copy it could have made
    earlier.

    What the last block and the head save stays on the device (`keep_the_rest`, called as the block before the last
    ends, before anything saves the last block's input): backward needs it first, so both its copy out and its
    copy back would be waited for, and it would be back on the device at backward's start anyway."""

    def __init__(self, pool: HostPool, stream: torch.cuda.Stream | None, device_type: str, tokens: int) -> None:
        self.pool, self.stream, self.device_type, self.tokens = pool, stream, device_type, tokens
        # The copies made in this forward, by the saved tensor's memory: one tensor that several ops save (a
        # norm's input and its scale, kept by two of its ops; a table every block keeps) is copied to the
        # host once.
        self.copies: dict[tuple, tuple[weakref.ref, _Offloaded]] = {}
        # Each group's copies, weakly: a copy belongs to autograd, which drops it once backward no longer needs it.
        self.groups: list[list[weakref.ref]] = [[]]
        self.brought: set[int] = set()  # the groups whose copies went back to the device
        self.asked: set[int] = set()  # the groups backward has asked for a copy of
        self.keeping = False  # from the end of the block before the last on: saved tensors stay where they are
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> OffloadActivations:
        global _packing
        _packing = self
        super().__enter__()
        return self

    def end_block(self) -> None:
        """A block's forward has ended: what is saved from now on belongs to the next group."""
        if self.groups[-1]:
            self.groups.append([])

    def keep_the_rest(self) -> None:
        """The block before the last has ended: the last block and the head keep what they save on the device."""
        self.keeping = True

    def _pack(self, tensor: torch.Tensor):
        # Model storage saved for backward stays put: parameters and views of them (a linear keeps its weight
        # transposed: the output head's alone is 1 GiB for an 8B model), and the DTensor buffers that hold the
        # quantized shards under quant_sharding: dtensor (copying those out and back each step is all cost).
        base = tensor if tensor._base is None else tensor._base
        if self.keeping or tensor.device.type != self.device_type or isinstance(tensor, DTensor) or \
                isinstance(base, (nn.Parameter, DTensor)) or not tensor.numel():
            return tensor
        if type(tensor) is not torch.Tensor:  # a subclass may have no storage of its own to key on
            return self._copy(tensor)
        key = _memory_key(tensor)
        known = self.copies.get(key)
        # Only while the tensor first copied still holds that memory, unchanged: once it has died, or been given
        # other memory (`.data =`, `set_`), the address may belong to another tensor.
        if known is not None and (first := known[0]()) is not None and _memory_key(first) == key:
            copy = known[1]
            if copy.group != len(self.groups) - 1:  # saved by a later block too: it comes back with that block's
                copy.group = len(self.groups) - 1
                self.groups[-1].append(weakref.ref(copy))
            return copy
        offloaded = self._copy(tensor)
        self.copies[key] = (weakref.ref(tensor), offloaded)
        return offloaded

    def _copy(self, tensor: torch.Tensor) -> _Offloaded:
        # A tensor comes back with its strides (a compiled backward checks the strides of what it saved), unless
        # its elements overlap (an expanded tensor: contiguous then). The host copy holds its elements only, strided
        # alike where they lie densely in some order (a transposed or permuted view: one memcpy each way), else
        # contiguous (a slice of a wider tensor: gathered on the device on its way out, scattered back into memory
        # that spans its first to last element).
        apart, dense = _layout(tensor)
        strides = tensor.stride() if apart else None
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self.pool.take(nbytes)
        flat = buffer.host[:nbytes].view(tensor.dtype)
        host = flat.as_strided(tensor.shape, strides) if dense else flat.view(tensor.shape)
        offloaded = _Offloaded(self.pool, buffer, host, tensor.device, len(self.groups) - 1, strides)
        self.groups[-1].append(weakref.ref(offloaded))
        if self.stream is None:
            host.copy_(tensor)
            return offloaded
        self.stream.wait_stream(torch.cuda.current_stream())  # the copy must see the finished values
        with torch.cuda.stream(self.stream):
            if buffer.last_use is not None:  # the copy back of the step before must have read it
                self.stream.wait_event(buffer.last_use)
            host.copy_(tensor, non_blocking=True)
            buffer.last_use = torch.cuda.Event()
            buffer.last_use.record(self.stream)
        # The allocator must not hand the device memory to another tensor before the copy has read it.
        tensor.record_stream(self.stream)
        return offloaded

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.group not in self.asked:  # backward has reached this group
            self.asked.add(packed.group)
            self._bring_back_group(packed.group)  # where no later group's backward brought it back ahead
            self._bring_back_group(packed.group - 1)  # the group whose backward comes next, while this one's runs
        if packed.restored is None:  # none the group's copy back missed should be left; if one were, it comes now
            self._bring_back([packed])
        if packed.ready is not None:
            torch.cuda.current_stream().wait_event(packed.ready)
        packed.used = True
        return packed.restored

    def _group(self, group: int) -> list[_Offloaded]:
        """The copies of `group` that autograd still holds (none for a group that does not exist)."""
        if group < 0 or group >= len(self.groups):
            return []
        return [c for ref in self.groups[group] if (c := ref()) is not None and c.group == group]

    def _bring_back_group(self, group: int) -> None:
        if group >= 0 and group not in self.brought:
            self.brought.add(group)
            self._bring_back(self._group(group))

    def _bring_back(self, copies: list[_Offloaded]) -> None:
        """`copies` back on the device, those not back yet, on the side stream if there is one."""
        waiting = [c for c in copies if c.restored is None]
        if not waiting:
            return
        if self.stream is None:
            for c in waiting:
                c.restored = _like(c).copy_(c.host)
            return
        compute = torch.cuda.current_stream()
        # The device memory comes from the compute stream's pool: its earlier users there must be done before the
        # side stream writes it.
        restored = [_like(c) for c in waiting]
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for c, r in zip(waiting, restored):
                r.copy_(c.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # No record_stream on the side stream: freed memory would then wait for whatever that stream has queued
        # by then (the next group's copy) before the compute stream could reuse it. Backward waits for `ready`
        # before it reads a copy; one never read waits for it when dropped (_Offloaded.__del__).
        for c, r in zip(waiting, restored):
            c.restored, c.ready, c.buffer.last_use = r, done, done

    def __exit__(self, *exc) -> None:
        global _packing
        _packing = None
        super().__exit__(*exc)
        self.copies.clear()  # autograd alone holds the copies now: each buffer returns once backward is done
        if exc[0] is None:  # what backward needs first of what went out (the last group), on its way now
            saved = [g for g in range(len(self.groups)) if self._group(g)]
            if saved:
                self._bring_back_group(saved[-1])
        _log_host_bytes(self.pool, self.tokens)


# The forward under way with activation offload, whose groups a block's end closes (`end_block`).
_packing: OffloadActivations | None = None


def group_saved_tensors_by_block(blocks: list[nn.Module]) -> None:
    """Hooks that close a group of offloaded tensors at the end of each block's forward (OffloadActivations): the
    unit in which backward brings them back ahead of need; and one that keeps what the last block and the head
    save on the device. Outside an offloaded forward (the recompute of a checkpointed block, evaluation) they do
    nothing."""
    for block in blocks:
        block.register_forward_hook(_end_block)
    if len(blocks) > 1:  # its end, not the last block's start: a checkpoint wrapper saves the input before that
        blocks[-2].register_forward_hook(_keep_the_rest)  # blocks: in the order they run (models.find_blocks)


def _end_block(*_) -> None:
    if _packing is not None:
        _packing.end_block()


def _keep_the_rest(*_) -> None:
    # Not in a gradient-free forward under the same hooks (a preference loss's reference, before the policy's).
    if _packing is not None and torch.is_grad_enabled():
        _packing.keep_the_rest()


def _layout(tensor: torch.Tensor) -> tuple[bool, bool]:
    """(whether no two of a tensor's elements share memory, what a copy into its strides needs; whether they
    also leave no gaps, lying densely in some order of its dims), from its strides, smallest first."""
    reach, dense = 1, True  # one past the last element the dims so far reach, from the first
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride()) if sz > 1):
        if stride < reach:
            return False, False
        dense = dense and stride == reach
        reach += (size - 1) * stride
    return True, dense


def _like(copy: _Offloaded) -> torch.Tensor:
    """Uninitialized device memory shaped and strided as the saved tensor `copy` holds."""
    host = copy.host
    strides = copy.strides or host.stride()
    return torch.empty_strided(host.shape, strides, dtype=host.dtype, device=copy.device)


def _memory_key(tensor: torch.Tensor) -> tuple:
    """What a saved tensor holds: its memory, layout and version (an in-place change makes another key)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor._version)


def _log_host_bytes(pool: HostPool, tokens: int) -> None:
    """Once per process: what the first micro-batch's forward offloaded, per token."""
    global _logged
    if _logged or not tokens or not pool.in_use:
        return
    _logged = True
    log.info("activation offload: %.2f GiB of host memory for a micro-batch of %d tokens, %.0f KiB per token",
             pool.in_use / 2**30, tokens, pool.in_use / tokens / 1024)


_logged = False


def activation_offload(cfg: Config, device: torch.device) -> Callable[[int], AbstractContextManager]:
    """A factory of the context each micro-batch's forward runs in, given the micro-batch's tokens
    (`OffloadActivations`). One pool of host buffers serves every micro-batch and step."""
    if not cfg.parallel.offloads_activations() or device.type != "cuda":
        return lambda tokens: contextlib.nullcontext()
    pool, stream = HostPool(pin=True), torch.cuda.Stream(device)
    return lambda tokens: OffloadActivations(pool, stream, device.type, tokens)


# ---------------------------------------------------------------------------------------------------------------
