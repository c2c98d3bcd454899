"""What autograd keeps for backward, per token, measured on the meta-device skeleton itself: the base model's
forward runs on meta tensors (no memory, no arithmetic) under `saved_tensors_hooks`, and every tensor saved
for backward is attributed to the block that saved it. Two sequence lengths give the bytes per token (the
slope), which leaves out what does not grow with the tokens (weights, their casts).

Attention is measured as a fused kernel (flash, memory-efficient, cuDNN, or the CPU's flash kernel) saves it:
query, key, value, output and the fp32 log-sum-exp per head, never a [seq, seq] matrix. On meta, torch's own
SDPA would take its math path, which does keep one; `_FusedAttention` stands in for it during the probe.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn as nn

from qshard.adapters import LoRALinear
from qshard.build import Skeleton
from qshard.precision import precision
from qshard.quant import QuantizedLinear

# Two lengths whose difference is the slope; long enough that no code path treats them as a decoding step.
_PROBE_LENGTHS = (16, 32)
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
# Probes already run in this process, by what decides their result (`_probe_key`): `qshard plan --fit` and a run's
# fit check estimate many settings of one skeleton, and a probe runs the whole model's forward (seconds for 70B).
_PROBED: dict[tuple, BlockActivations] = {}
_PROBES_KEPT = 16


class _FusedAttention(torch.autograd.Function):
    """Saves what a fused attention kernel saves; its output's values are never read (meta)."""

    @staticmethod
    def forward(ctx, q, k, v):
        # [batch, seq, heads, dim] in memory, as the kernels write it: the transpose transformers then makes
        # contiguous for the output projection is free, not a copy that the projection would save.
        batch, heads, length, _ = q.shape
        out = q.new_empty(batch, length, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the probe does no backward
        raise AssertionError("the planner's attention stand-in has no backward")


def _fused_sdpa(query, key, value, *args, **kwargs):
    return _FusedAttention.apply(query, key, value)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token of one sequence, for the model's blocks."""

    saved: list[float]  # each block's saved tensors without checkpointing
    outside: float  # saved outside the blocks (embedding, final norm), the head's loss apart
    block_input: int  # a checkpointed block keeps only its input: hidden size x compute dtype
    projections: list[int]  # ac_save_projections: the narrowing matmuls' outputs a traced block keeps
    mlp: list[float]  # of `saved`, what each block's MLP saves (parallel.mlp_tile_tokens holds one tile's)

    @property
    def widest(self) -> float:
        return max(self.saved)


def probe_activations(model: Skeleton, cfg) -> BlockActivations:
    """The per-token activation bytes of `model` (a skeleton with its module swaps) as `cfg` trains it."""
    dtype = precision(cfg).compute
    key = _probe_key(model, dtype)
    if key not in _PROBED:
        if len(_PROBED) >= _PROBES_KEPT:
            _PROBED.pop(next(iter(_PROBED)))
        _PROBED[key] = _probe(model, dtype)
    return _PROBED[key]


def _probe_key(model: Skeleton, dtype: torch.dtype) -> tuple:
    """What a probe's result depends on: the model's configuration, its modules as built (classes, shapes, the
    adapters' ranks: their printed form), which parameters train and in what dtype, and the compute dtype."""
    params = tuple((n, p.dtype, p.requires_grad) for n, p in model.model.named_parameters())
    return model.model.config.to_json_string(), repr(model.model), params, dtype


def _probe(model: Skeleton, dtype: torch.dtype) -> BlockActivations:
    totals = [_saved_bytes(model, length, dtype) for length in _PROBE_LENGTHS]
    span = _PROBE_LENGTHS[1] - _PROBE_LENGTHS[0]
    per_block = [(b - a) / span for a, b in zip(totals[0][0], totals[1][0])]
    outside = (totals[1][1] - totals[0][1]) / span
    mlp = [(b - a) / span for a, b in zip(totals[0][2], totals[1][2])]
    hidden = model.model.config.get_text_config().hidden_size
    return BlockActivations(per_block, outside, hidden * dtype.itemsize,
                            [_projection_bytes(block, dtype) for block in model.blocks], mlp)


def _saved_bytes(model: Skeleton, length: int, dtype: torch.dtype) -> tuple[list[int], int, list[int]]:
    """Bytes autograd saves in each block, outside them, and in each block's MLP (part of its block's), for one
    sequence of `length` tokens."""
    blocks = model.blocks
    saved = [0] * len(blocks)
    in_mlp = [0] * len(blocks)
    outside = 0
    current: list[int | None] = [None]
    mlp_running = [False]
    seen: set[int] = set()
    params = {id(p) for p in model.model.parameters()}

    def pack(t: torch.Tensor):
        nonlocal outside
        base = t._base if t._base is not None else t
        if id(base) in seen or id(base) in params or id(t) in params:
            return t
        seen.add(id(base))
        nbytes = base.untyped_storage().nbytes()
        if current[0] is None:
            outside += nbytes
        else:
            saved[current[0]] += nbytes
            in_mlp[current[0]] += nbytes if mlp_running[0] else 0
        return t

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)))
        handles.append(block.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None)))
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, nn.Module):
            handles.append(mlp.register_forward_pre_hook(lambda _m, _a: mlp_running.__setitem__(0, True)))
            handles.append(mlp.register_forward_hook(lambda _m, _a, _o: mlp_running.__setitem__(0, False)))
    base_model = model.model.get_decoder() if hasattr(model.model, "get_decoder") else model.model
    embed = model.model.get_input_embeddings()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _fused_sdpa))
            # Mask builders inspect values (packed sequences), which meta tensors have none of: one unpadded
            # causal sequence needs no mask.
            module = sys.modules[type(base_model).__module__]
            for name in _MASK_BUILDERS:
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, lambda *a, **k: None))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            ids = torch.zeros(1, length, dtype=torch.long, device="meta")
            # The blocks' first input requires grad only where the embedding trains (as in training).
            states = embed(ids).to(dtype).requires_grad_(embed.weight.requires_grad)
            # Trained weights kept in a wider master dtype compute in the compute dtype, cast by FSDP2's policy.
            cast = {n: w.to(dtype) for n, w in base_model.named_parameters()
                    if w.is_floating_point() and w.dtype != dtype}
            kwargs = {"inputs_embeds": states, "use_cache": False}
            torch.func.functional_call(base_model, cast, (), kwargs, strict=False)
    finally:
        for handle in handles:
            handle.remove()
    return saved, outside, in_mlp


def _projection_bytes(block: nn.Module, dtype: torch.dtype) -> int:
    """Per token, the outputs of the narrowing matmuls a traced checkpoint keeps under ac_save_projections
    (parallel/checkpointing.py, _narrowing_matmul) that backward reads (`kept_projections`). Attention's output and
    log-sum-exp, which it keeps with them, are counted where the attention implementation is known
    (estimate.py, _kept_per_block)."""
    return sum(width for _, width, _ in kept_projections(block)) * dtype.itemsize


def kept_projections(block: nn.Module) -> list[tuple[str, int, int]]:
    """(name, output width, weights) of each matmul of `block` whose output ac_save_projections keeps: the
    narrowing ones (output no wider than the input: attention's q/k/v, every adapter's A factor), but not the
    projections back into the residual stream, whose outputs only a sum reads."""
    found = []
    for name, module in block.named_modules():
        if isinstance(module, LoRALinear):
            found.append((name, module.rank, module.rank * module.in_features))
        elif isinstance(module, (nn.Linear, QuantizedLinear)) and module.out_features <= module.in_features \
                and _leaf(name) not in _RESIDUAL_PROJECTIONS:
            found.append((name, module.out_features, module.out_features * module.in_features))
    return found


def adapts_attention_output(block: nn.Module) -> bool:
    """Whether an adapter trains on attention's output projection (o_proj and its kin) in `block`: its A factor's
    weight gradient needs that projection's input, attention's output laid out by token."""
    return any(isinstance(m, LoRALinear) and _leaf(n) in _RESIDUAL_PROJECTIONS and ("attn" in n or "attention" in n)
               for n, m in block.named_modules())


def _leaf(name: str) -> str:
    """A linear's own name in its block, for the frozen base inside an adapter too."""
    return name.removesuffix(".base").rsplit(".", 1)[-1]


# The leaf names of the projections back into the residual stream across the architectures transformers ships.
_RESIDUAL_PROJECTIONS = ("o_proj", "out_proj", "dense", "wo", "c_proj", "down_proj", "w2", "fc2", "dense_4h_to_h")
