"""Quantized storage in host memory (`quant_sharding: dtensor`, `cpu_offload: true`), streamed to the GPU.

The quantized codes and scales are outside FSDP2, so its offload policy does not move them;
`offload_quantized_storage` does. Each rank's shards live in host memory (pinned when CUDA is present) from the
start, one flat buffer per transformer block, and are never materialized on the GPU as a whole: `StorageWindow`
copies one block's buffer to the GPU when the block runs and prefetches the next block's on a side stream (see
there; compiled blocks reach it through the operator `storage_to_device`), then each layer all-gathers its shard
over the shard group as without offload. The GPU holds at most two blocks' shards at a time, besides those of the
first `parallel.resident_blocks` blocks, whose buffers live on the GPU and are never copied.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from qshard.parallel.mesh import local_piece
from qshard.parallel.offload import host_bytes
from qshard.quant import QuantizedLinear

log = logging.getLogger("qshard")

# Quantized storage in host memory (quant_sharding: dtensor, cpu_offload: true).

# Byte offsets of the shards in a block's flat buffer: int32 scales need a multiple of 4 to be viewed as
# such, and a 128-byte boundary keeps every shard's device copy aligned for the dequantization kernels.
_ALIGN = 128

Layout = list[list[tuple[int, torch.dtype, torch.Size]]]  # per layer, per storage tensor: (offset, dtype, shape)


def _views(flat: torch.Tensor, layout: Layout) -> list[tuple[torch.Tensor, ...]]:
    return [
        tuple(flat[o : o + dtype.itemsize * shape.numel()].view(dtype).view(shape) for o, dtype, shape in tensors)
        for tensors in layout
    ]


class _BlockStorage:
    """The local shards of one block's quantized layers, as views of one flat host buffer.

    One buffer per block, not one tensor per shard: the block then reaches the GPU in a single copy. The buffer
    is page-locked at its exact size (parallel/offload.py, `host_bytes`), not taken from torch's pinned-memory
    allocator, which rounds each allocation up to a power of two: a 70B block's 0.45 GiB would take 0.5 GiB, 4 GiB
    over the 80 blocks."""

    def __init__(self, layout: Layout, nbytes: int, pin: bool, resident: torch.device | None = None) -> None:
        self.layout = layout
        # A resident block (parallel.resident_blocks) keeps its buffer on the compute device: no copy, ever.
        self.resident = resident is not None
        self.host = torch.empty(nbytes, dtype=torch.uint8, device=resident) if self.resident else \
            host_bytes(nbytes, pin)
        self.host_views = _views(self.host, layout)


class _Staged:
    """A block's storage on the compute device, and the event that says its copy has landed."""

    def __init__(self, flat: torch.Tensor, views: list[tuple[torch.Tensor, ...]], copied) -> None:
        self.flat, self.views, self.copied = flat, views, copied
        self.waited: set[int] = set()  # the streams already ordered after the copy
        self.given: set[tuple[int, int]] = set()  # (layer, tensor) handed to a compiled graph as its own

    def use(self, index: int) -> tuple[torch.Tensor, ...]:
        if self.copied is not None:
            stream = torch.cuda.current_stream(self.flat.device)
            if stream.cuda_stream not in self.waited:
                self.waited.add(stream.cuda_stream)
                stream.wait_event(self.copied)
                # Allocated on the copy stream but read on this one: the allocator must not hand the memory
                # to the next prefetch before this stream's kernels that read it have run.
                self.flat.record_stream(stream)
        return self.views[index]


class StorageWindow:
    """The blocks' offloaded storage, and its copies on the compute device: the block running now and the
    one expected next, nothing else, so GPU memory does not grow with the model.

    Why a side stream: copying a block's storage over PCIe takes about as long as the block's compute;
    issued on the compute stream it would stall every block for that long. Issued on a side stream as soon
    as the previous block starts, it runs under that block's compute; an event orders the first use after
    the copy. Forward visits blocks in order; backward, and with it the recomputation of checkpointed blocks
    (which runs inside backward), in reverse, so the next block is chosen by whether autograd's engine is
    running. At a turn (forward to backward, backward to the next forward) the next pass starts from the copy of
    the block the last one ended with; the first streamed block after resident ones is prefetched by the last
    resident block's forward (`_prefetch_after_resident`). Where no prefetch was made (the very first block) the
    copy is made on demand, on the side stream all the same.

    Compiled blocks use the window too, through the `qshard::storage_to_device` operator (`fetch_owned`), which
    the compiler does not trace into: the streams, events and Python state stay out of the graph. A tiled MLP's
    tiles (parallel/tiling.py) run eagerly where their storage is offloaded, so that they share this window's one
    copy per block and direction rather than copy it in every tile's graph."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.blocks: list[_BlockStorage] = []
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged: dict[int, _Staged] = {}
        self._position: tuple[int, int] | None = None  # (block, direction) of the last fetch
        # How `fetch_owned` served each call: the staged tensor itself, a device copy of it, or a new copy from
        # host memory on the compute stream (no prefetch: what the window exists to avoid).
        self.paths: Counter[str] = Counter()

    def fetch(self, block: int, index: int) -> tuple[torch.Tensor, ...]:
        """Layer `index` of `block`: its local shards on the compute device."""
        self._move(block)
        if any(given[0] == index for given in self.staged[block].given):
            # A compiled graph owns this layer's staged tensors (`fetch_owned`) and may have written over them.
            self._restage(block)
        return self.staged[block].use(index)

    def _move(self, block: int) -> int:
        """Make `block` the one running, in this pass's direction (returned), if it is not already."""
        step = -1 if torch._C._current_graph_task_id() != -1 else 1
        if self._position != (block, step):
            self._advance(block, step)
        return step

    def prefetch(self, block: int) -> None:
        """Start copying `block`'s storage if no clean copy of it is staged: the first streamed block, from the
        last resident block's forward (compiled resident blocks never ask the window for anything)."""
        if block not in self.staged or self.staged[block].given:
            self._restage(block)

    def _advance(self, block: int, step: int) -> None:
        self._position = (block, step)
        upcoming = block + step
        # Dropped before the prefetch is allocated, so the prefetch can reuse their memory once the
        # compute stream is done with them.
        for other in [b for b in self.staged if b not in (block, upcoming)]:
            del self.staged[other]
        # A copy whose tensors a compiled graph was given may have been written over since (`fetch_owned`).
        self.prefetch(block)
        if not self._last_of_pass(block, step):
            self.prefetch(upcoming)

    def _in_range(self, block: int) -> bool:
        return 0 <= block < len(self.blocks)

    def _restage(self, block: int) -> None:
        # The old copy goes first, so that at most two blocks' copies are held while the new one is allocated.
        self.staged.pop(block, None)
        self.staged[block] = self._stage(block)

    def _last_of_pass(self, block: int, step: int) -> bool:
        """Whether no streamed block follows `block` in this pass: the next pass (the turn from forward to
        backward, or the next micro-batch's forward) starts from this block's staged copy."""
        upcoming = block + step
        return not self._in_range(upcoming) or self.blocks[upcoming].resident

    def fetch_owned(self, block: int, index: int, which: int, backward: bool) -> torch.Tensor:
        """Storage tensor `which` of layer `index` of `block` on the compute device, for a compiled graph, which
        owns what it gets: its compiler may reuse a tensor's memory for another once the tensor's last use has
        passed. So a staged tensor is handed out at most once, and the staged copy is never handed out where
        the same pass will ask for it again: in the recomputation of a checkpointed block, which runs in
        backward before the block's backward graph (`backward`: this call is from a backward graph) asks for
        the same tensors; the recomputation gets a copy of it. Nor at the last streamed block of a pass, whose
        staged copy the next pass starts from (`_last_of_pass`). `paths` counts which way each call went."""
        step = self._move(block)
        staged = self.staged[block]
        views = staged.use(index)
        if (index, which) in staged.given:  # only where a pass asks twice for one tensor: copied again
            self.paths["host"] += 1
            return self.blocks[block].host_views[index][which].to(self.device, non_blocking=True, copy=True)
        if (step == -1 and not backward) or self._last_of_pass(block, step):
            self.paths["clone"] += 1
            return views[which].clone()
        self.paths["staged"] += 1
        staged.given.add((index, which))
        # On the CPU the staged tensor is the host shard itself, the operator's input, which it may not return.
        return views[which] if staged.copied is not None else views[which].clone()

    def _stage(self, block: int) -> _Staged:
        storage = self.blocks[block]
        if self.stream is None or storage.resident:  # already on the compute device: used where they are
            return _Staged(storage.host, storage.host_views, None)
        with torch.cuda.stream(self.stream):
            flat = torch.empty(storage.host.shape, dtype=torch.uint8, device=self.device)
            # From pinned memory: an asynchronous DMA, the host thread does not wait for it.
            flat.copy_(storage.host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return _Staged(flat, _views(flat, storage.layout), copied)


# The host shards of every offloaded block, by address: (window, block, layer, tensor). Looked up by the operator
# below from the tensor it is given, so that a compiled graph shared by all blocks needs no block number.
_SHARDS: dict[int, tuple[weakref.ref, int, int, int]] = {}


def _register_shards(window: StorageWindow, block: int) -> None:
    ref = weakref.ref(window)
    keys = []
    for index, views in enumerate(window.blocks[block].host_views):
        for which, view in enumerate(views):
            if view.numel():  # an empty tensor may share its address with the next one
                _SHARDS[view.data_ptr()] = (ref, block, index, which)
                keys.append(view.data_ptr())
    weakref.finalize(window, _forget_shards, keys, ref)


def _forget_shards(keys: list[int], ref: weakref.ref) -> None:
    for key in keys:
        if key in _SHARDS and _SHARDS[key][0] is ref:
            del _SHARDS[key]


@torch.library.custom_op("qshard::storage_to_device", mutates_args=())
def storage_to_device(host: torch.Tensor, device: torch.device, after: torch.Tensor | None) -> torch.Tensor:
    """A compiled block's copy of one offloaded host shard on `device`, through the shard's `StorageWindow`
    (`fetch_owned`), so that compiled blocks are prefetched as eager ones are. An operator, so that the compiler
    calls it rather than trace into it, and keeps the host shard (its input) for backward, not the copy.

    `after`: in a backward graph, the gradient the weight multiplies (its value is not read). The fetch then
    depends on the backward pass, so the compiler runs it there, not in the forward graph with its copy kept
    for backward (what it does with any computation of the forward's inputs that it may not recompute)."""
    ref, block, index, which = _SHARDS.get(host.data_ptr(), (None, 0, 0, 0)) if host.numel() else (None, 0, 0, 0)
    window = ref() if ref is not None else None
    if window is None or window.device != device or not _same(window.blocks[block].host_views[index][which], host):
        if device.type == "cuda" and host.numel():
            _warn_unstaged(host)
        return host.to(device, non_blocking=True, copy=True)  # a tensor no window holds: copied on this stream
    return window.fetch_owned(block, index, which, backward=after is not None)


def _warn_unstaged(host: torch.Tensor) -> None:
    """Once per process: compiled blocks fetched a tensor that is no block's shard, without the window's prefetch."""
    global _warned_unstaged
    if not _warned_unstaged:
        _warned_unstaged = True
        log.warning("qshard::storage_to_device: a host tensor %s %s that no offload window holds is copied as it "
                    "is (no prefetch)", tuple(host.shape), host.dtype)


_warned_unstaged = False


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


@storage_to_device.register_fake
def _(host: torch.Tensor, device: torch.device, after: torch.Tensor | None) -> torch.Tensor:
    return host.new_empty(host.shape, device=device)


class OffloadedStorage:
    """A quantized layer's storage kept in host memory: its `storage()` asks this for the full tensors.

    `host` holds this rank's shards in host memory (where loading writes them) as tensors, set once here: a
    compiled block reads them as graph inputs. Reaching them through the block's number instead would make the
    compiler guard on that number, and compile one graph per block rather than one per block class."""

    def __init__(self, window: StorageWindow, block: int, index: int, mesh: DeviceMesh,
                 placements: tuple[Placement, ...], shapes: list[torch.Size], strides: list[tuple[int, ...]]) -> None:
        self.window, self.block, self.index = window, block, index
        self.host: tuple[torch.Tensor, ...] = window.blocks[block].host_views[index]
        self.resident = window.blocks[block].resident  # on the compute device: used with no copy
        self.mesh, self.placements, self.shapes, self.strides = mesh, placements, shapes, strides

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """The rows of a full tensor (weight or storage) that this rank's shard holds."""
        return local_piece(full, self.mesh, self.placements)

    def full(self, after: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The whole storage on the compute device: this rank's shards brought over, then all-gathered.
        `after`: in a backward pass, the gradient the weight multiplies (`storage_to_device`)."""
        if not torch.compiler.is_compiling():
            local = self.window.fetch(self.block, self.index)
        elif self.resident:
            local = self.host
        else:
            # Inside a compiled block: the host shards are graph inputs (no block number to guard on), and the
            # operator finds their staged copies from them.
            local = tuple(storage_to_device(t, self.window.device, after) for t in self.host)
        if self.mesh.size() == 1:
            return local
        return tuple(
            DTensor.from_local(t, self.mesh, self.placements, run_check=False, shape=shape, stride=stride).full_tensor()
            for t, shape, stride in zip(local, self.shapes, self.strides)
        )


def storage_groups(model: nn.Module, blocks: list[nn.Module], resident: int = 0
                   ) -> list[tuple[list[QuantizedLinear], bool]]:
    """The quantized layers of each flat storage buffer, with whether the buffer is resident: one buffer per
    block that has any, resident for the first `resident` of `blocks` (parallel.resident_blocks counts blocks,
    as the planner does); then one per quantized layer outside the blocks, never resident."""
    in_blocks = [([m for m in block.modules() if isinstance(m, QuantizedLinear)], i < resident)
                 for i, block in enumerate(blocks)]
    seen = {id(m) for layers, _ in in_blocks for m in layers}
    # Quantized layers outside the blocks (none in the models qshard builds today) form units of their own.
    rest = [([m], False) for m in model.modules() if isinstance(m, QuantizedLinear) and id(m) not in seen]
    return [(layers, on_device) for layers, on_device in in_blocks + rest if layers]


def offload_quantized_storage(model: nn.Module, blocks: list[nn.Module], device: torch.device,
                              resident: int = 0) -> StorageWindow | None:
    """Move every quantized layer's DTensor-buffer shards (still on meta) into host memory, one flat buffer
    per block, and make the layer fetch them through a `StorageWindow`. The shards become plain attributes
    of the layer, outside its buffers: `model.to_empty(device=...)` then leaves them where they are, so the
    quantized model is never materialized on the GPU, and loading writes each shard straight to host memory.
    The first `resident` blocks' buffers are on `device` instead (parallel.resident_blocks)."""
    groups = storage_groups(model, blocks, resident)
    if not groups:
        return None
    window = StorageWindow(device)
    for block, (layers, on_device) in enumerate(groups):
        layout: Layout = []
        specs = []
        nbytes = 0
        for layer in layers:
            sharded = [layer._buffers[name] for name in layer.STORAGE]
            assert all(isinstance(t, DTensor) for t in sharded), "shard_as_dtensor_buffers runs first"
            entries = []
            for t in sharded:
                local = t.to_local()  # on meta: this rank's piece's shape
                nbytes = -(-nbytes // _ALIGN) * _ALIGN
                entries.append((nbytes, local.dtype, local.shape))
                nbytes += local.dtype.itemsize * local.numel()
            layout.append(entries)
            specs.append((sharded[0].device_mesh, tuple(sharded[0].placements),
                          [t.shape for t in sharded], [t.stride() for t in sharded]))
        window.blocks.append(_BlockStorage(layout, nbytes, pin=device.type == "cuda",
                                           resident=device if on_device else None))
        if not on_device:
            _register_shards(window, block)
        for index, (layer, spec) in enumerate(zip(layers, specs)):
            for name, host in zip(layer.STORAGE, window.blocks[block].host_views[index]):
                del layer._buffers[name]
                setattr(layer, name, host)  # a plain attribute now: this rank's shard, in host memory
            layer.offloaded = OffloadedStorage(window, block, index, *spec)
    _prefetch_after_resident(window, blocks, resident)
    return window


def _prefetch_after_resident(window: StorageWindow, blocks: list[nn.Module], resident: int) -> None:
    """Have the last resident block's forward start the copy of the first streamed block, which would otherwise
    be copied on demand: compiled resident blocks read their storage where it is and never reach the window.
    A module hook, so it runs outside the block's compiled graph."""
    first_streamed = sum(storage.resident for storage in window.blocks)
    if not 0 < resident <= len(blocks) or first_streamed >= len(window.blocks):
        return

    def prefetch(module: nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recomputation inside backward
            window.prefetch(first_streamed)

    blocks[resident - 1].register_forward_pre_hook(prefetch)
