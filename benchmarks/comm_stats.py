"""Count the bytes of the collectives a piece of code really issues, and say whose data they carry.

`CommCounter` is a TorchDispatchMode: every c10d collective (FSDP2's `_allgather_base_` and
`_reduce_scatter_base_`, `dist.all_reduce`'s `allreduce_`, ...) and every functional collective (what
DTensor's `full_tensor()` issues: `_c10d_functional.all_gather_into_tensor`) passes through the
dispatcher, so the mode sees each call with its real tensors and records its kind, dtype and bytes.
torch's own CommDebugMode sees the same calls but only counts them; it reports no sizes.

FSDP2 packs all parameters of a unit into one flat buffer per all-gather (bytes viewed as uint8 when the
unit mixes dtypes), so the collective's dtype says nothing about what it carries. To attribute the bytes,
the mode also watches the two steps that fill that buffer, both dispatcher ops: `aten._foreach_copy_`
(FSDP2's cast of float parameters to the mixed-precision dtype) and `fsdp.all_gather_copy_in` (the
copy of every parameter's shard into the buffer). Each piece is traced by its storage back to a watched
parameter or buffer, so every gathered byte is charged to a tensor name and the dtype it travels in.
Bytes that cannot be traced (a torch whose FSDP2 fills the buffer another way) stay "unattributed":
the totals are still measured; only the split is lost, and callers can check for it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

UNATTRIBUTED = "<unattributed>"

# Op namespaces that hold collectives: in-place c10d ops (what torch.distributed's eager API and FSDP2
# call) and the functional ones (DTensor, funcol, compiled graphs).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# Checked in order: "reduce_scatter" before "all_reduce"/"reduce".
_KINDS = (
    ("allgather", "all_gather"), ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
)


def collective_kind(func) -> str | None:
    """The collective an op overload issues ("all_gather", ...), or None for anything else (waits, barriers,
    point-to-point sends, which move no tensor of interest here)."""
    if func.namespace not in _COLLECTIVE_NAMESPACES:
        return None
    name = func._schema.name.split("::")[-1]
    return next((kind for key, kind in _KINDS if key in name), None)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _where(t: torch.Tensor) -> tuple[int, int]:
    # A byte offset, not an element one: FSDP2 views float pieces as uint8 between the cast and the copy-in.
    return _storage(t), t.storage_offset() * t.element_size()


@dataclass
class Call:
    """One collective as issued: its output bytes (the gathered buffer for an all-gather), input bytes, and
    for all-gathers the output bytes charged to each (tensor name, dtype it travelled in)."""

    kind: str
    op: str
    dtype: torch.dtype
    out_bytes: int
    in_bytes: int
    parts: dict[tuple[str, torch.dtype], int] = field(default_factory=dict)


class CommCounter(TorchDispatchMode):
    """Records every collective issued while active (`with CommCounter() as c: ...`; `c.calls`).

    `watch(model)` first makes the bytes of all-gathers attributable to the model's parameters and buffers
    (sharded ones included: FSDP2's DTensor parameters and qshard's DTensor-buffer NF4 storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self._owner: dict[int, tuple[str, torch.dtype]] = {}  # storage -> (name, dtype) of a watched tensor
        self._cast: dict[tuple[int, int], tuple[str, torch.dtype]] = {}  # a cast copy's place -> its source
        self._filled: dict[int, list[tuple[tuple[str, torch.dtype], int]]] = {}  # buffer storage -> pieces

    def watch(self, model: nn.Module) -> CommCounter:
        """Remember which storage holds which of `model`'s tensors (their local shards). Call it after the
        model is built and loaded, as FSDP2 and loading may replace storages until then."""
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
        for name, t in named:
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.device.type != "meta" and _storage(local):
                self._owner.setdefault(_storage(local), (name, local.dtype))
        return self

    def _source(self, t: torch.Tensor) -> tuple[str, torch.dtype] | None:
        where = _where(t)
        if where in self._cast:
            return self._cast[where]
        return self._owner.get(where[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Tensor subclasses (DTensor) first turn themselves into ops on plain tensors, which come back
        # here; recording them now would count a DTensor op rather than the collective it turns into.
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented
        if func is torch.ops.aten._foreach_copy_.default:
            # FSDP2's cast of float shards to the gather dtype: each destination slice carries its source.
            for dst, src in zip(args[0], args[1]):
                owner = self._source(src)
                if owner is not None:
                    self._cast[_where(dst)] = (owner[0], dst.dtype)
        elif func.namespace == "fsdp" and func._schema.name == "fsdp::all_gather_copy_in":
            pieces = []
            for t in args[0]:
                owner = self._source(t)
                pieces.append(((owner[0], owner[1]) if owner else (UNATTRIBUTED, t.dtype), _nbytes([t])))
            self._filled[_storage(args[1])] = pieces
        out = func(*args, **kwargs)
        kind = collective_kind(func)
        if kind is not None:
            self._record(func, kind, args, kwargs, out)
        return out

    def _record(self, func, kind: str, args, kwargs, out) -> None:
        # The schema says which arguments the op writes (the c10d ops' outputs); functional ops return them.
        written, read = [], []
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = _tensors(value)
            mutable = arg.alias_info is not None and arg.alias_info.is_write
            # c10d's in-place ops declare no alias info: their first tensor argument(s) are the outputs,
            # except all-reduce and broadcast, whose one tensor list is both.
            first_of_c10d = func.namespace == "c10d" and i == 0
            (written if mutable or first_of_c10d else read).extend(tensors)
        if not (func.namespace == "c10d" or any(a.alias_info and a.alias_info.is_write
                                                for a in func._schema.arguments)):
            written = _tensors(out)
        if not read:  # all-reduce, broadcast: the same tensors in and out
            read = written
        dtypes = {t.dtype for t in written}
        call = Call(kind, func._schema.name, dtypes.pop() if len(dtypes) == 1 else torch.uint8,
                    _nbytes(written), _nbytes(read))
        if kind == "all_gather":
            call.parts = self._parts(read, call.out_bytes)
        self.calls.append(call)

    def _parts(self, inputs: list[torch.Tensor], out_bytes: int) -> dict[tuple[str, torch.dtype], int]:
        """Charge an all-gather's output bytes to what its inputs hold: a watched tensor's shard (DTensor
        buffers), or the pieces FSDP2's copy-in put into the buffer the input is a slice of."""
        in_bytes = _nbytes(inputs)
        world = out_bytes // in_bytes if in_bytes else 0
        parts: dict[tuple[str, torch.dtype], int] = defaultdict(int)
        for t in inputs:
            pieces = self._filled.pop(_storage(t), None)
            if pieces is None:
                owner = self._source(t)
                pieces = [((owner[0], owner[1]) if owner else (UNATTRIBUTED, t.dtype), _nbytes([t]))]
            for key, nbytes in pieces:
                parts[key] += nbytes * world
        return dict(parts)

    def clear(self) -> None:
        self.calls.clear()
        self._cast.clear()
        self._filled.clear()


# --------------------------------------------------------------------------------------------------------------
# Summaries


def category(name: str) -> str:
    """What a parameter is, from its name: the frozen base of an adapted linear (NF4 codes and scales, or a
    bf16 weight), a LoRA factor, or anything else (norms, embeddings, head)."""
    if name == UNATTRIBUTED:
        return UNATTRIBUTED
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return "lora"
    if "base" in parts[:-1]:
        return "base"
    return "other"


def block_prefixes(model: nn.Module, block_class: str | None = None) -> tuple[str, ...]:
    """The names of the transformer blocks, with a trailing dot. Matched on the class's MRO, as in
    models.find_blocks but after fully_shard, which subclasses each block as FSDP<Block>."""
    names = {block_class} if block_class else set(getattr(model, "_no_split_modules", None) or [])
    return tuple(name + "." for name, m in model.named_modules()
                 if any(c.__name__ in names for c in type(m).__mro__))


def summarize(calls: list[Call], prefixes: tuple[str, ...] = ()) -> dict:
    """Bytes per kind and dtype of the collectives, and the all-gather bytes per (where, category, dtype):
    where is "blocks" for tensors under one of `prefixes`, else "rest"."""
    per_kind: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    counts: dict[str, int] = defaultdict(int)
    gathered: dict[str, int] = defaultdict(int)
    base: set[str] = set()  # every frozen base tensor gathered, with the dtype it travelled in
    for c in calls:
        per_kind[c.kind][str(c.dtype).removeprefix("torch.")] += c.out_bytes
        counts[c.kind] += 1
        for (name, dtype), nbytes in c.parts.items():
            where = "blocks" if name.startswith(prefixes) else "rest"
            dtype_name = str(dtype).removeprefix("torch.")
            gathered[f"{where}/{category(name)}/{dtype_name}"] += nbytes
            if category(name) == "base":
                base.add(f"{name}:{dtype_name}")
    return {"bytes": {k: dict(v) for k, v in per_kind.items()}, "calls": dict(counts),
            "all_gather_parts": dict(sorted(gathered.items())), "base_tensors": sorted(base)}


def part_bytes(summary: dict, where: str | None = None, cat: str | None = None, dtype: str | None = None) -> int:
    """Sum of all-gather bytes whose key matches the given fields (None: any)."""
    total = 0
    for key, nbytes in summary["all_gather_parts"].items():
        w, c, d = key.split("/")
        if (where is None or w == where) and (cat is None or c == cat) and (dtype is None or d == dtype):
            total += nbytes
    return total


# --------------------------------------------------------------------------------------------------------------
# One training step, measured


def synthetic_examples(n: int, length: int, vocab: int, seed: int = 0) -> list:
    """Random token sequences, every token trained: collective sizes do not depend on the data, and this
    needs no tokenizer (a named shape has none)."""
    from qshard.data import Example

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(3, vocab, (n, length), generator=gen).tolist()
    return [Example(input_ids=r, labels=r) for r in rows]


def measure_train_step(cfg, env, model_dir=None, seq: int = 128, warmup_steps: int = 1) -> dict:
    """Build the model as `qshard train` does, run `warmup_steps` optimizer steps (FSDP2's lazy
    initialization), then one more under a CommCounter; returns `summarize`'s dict with the step's loss.
    Meant for eager blocks: FSDP2 issues its collectives from module hooks, outside any compiled graph, so
    parallel.compile changes none of them, and a Python dispatch mode inside compiled code is untested.
    Every rank must call it (the step is collective); every rank gets its own counts, which FSDP2 makes
    equal across ranks."""
    import gc

    from qshard.build import build_model
    from qshard.train.loop import Trainer

    model, _ = build_model(cfg, env, model_dir)
    vocab = model.get_input_embeddings().num_embeddings
    t = cfg.train
    per_step = t.micro_batch_size * t.grad_accum * env.world_size
    examples = synthetic_examples(per_step * (warmup_steps + 1), seq, vocab, seed=t.seed)
    trainer = Trainer(cfg, env, model, examples, [], pad_id=0)
    for step in range(warmup_steps):
        trainer.step(step)
    counter = CommCounter().watch(model)
    with counter:
        record = trainer.step(warmup_steps)
    summary = summarize(counter.calls, block_prefixes(model, cfg.model.block_class))
    summary["loss"] = record["loss"]
    del trainer, model, counter
    gc.collect()  # FSDP2's hooks make reference cycles: free this model before the caller builds the next
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary
