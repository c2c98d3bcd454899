"""Attention kept through a block's checkpoint (parallel.ac_keep_attention): the recompute does not run it again.

Why: a checkpointed block's backward reruns its forward to get back what the gradients need, attention included,
and at long context attention's forward is the block's largest kernel (its FLOPs grow with the square of the
sequence, the projections' linearly): at 128k tokens the recompute's attention is about a sixth of an 8B step.
Its backward needs q, k and v (cheap to recompute: a norm, three projections and the rotation), the output and
the row-wise log-sum-exp of the scores. Kept from the first forward, the output and log-sum-exp let the recompute
skip the attention kernel: tokens x heads x head_dim values of the compute dtype plus tokens x heads fp32 values
more memory per checkpointed block, held from its forward to its backward.

How: each checkpointed block's checkpoint is given two context managers (torch's `context_fn`), one around its
forward, one around its recompute, made anew for every forward and sharing one `_Kept` record. The attention
function of the block's attention modules (marked by `keep_attention_in`) records its kernel's output and
log-sum-exp under the first and takes them back under the second, so each recompute pairs with its own forward
whatever the order of backward. The kernel is called through SDPA's own forward and backward ops (cuDNN, flash,
memory-efficient on a GPU, flash on the CPU), as SDPA's autograd would call them, so gradients are those of
`scaled_dot_product_attention`. Plain Python context managers, not a dispatch mode, so compiled blocks stay
compiled; the attention call itself runs eagerly (a graph break in the block).

Only causal attention over the whole row without a mask or dropout takes this path (what long-context training
runs); any other call (a mask, packed rows, dropout, a shared preference batch) is transformers' own, recomputed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend

log = logging.getLogger("qshard")

# Set on the attention modules of the blocks that keep their attention (`keep_attention_in`).
KEEP_FLAG = "qshard_keep_attention"


@dataclass
class _Kept:
    """One block forward's attention results, in call order: recorded by the forward, taken by its recompute; None
    for a call that ran transformers' attention instead (no kernel of SDPA's takes it)."""

    results: list[tuple] = field(default_factory=list)
    taken: int = 0


class _State:
    # The record of the block pass running now and whether it records (forward) or takes (recompute); None outside.
    # The recompute runs in the autograd engine's thread while the thread that called backward waits, so one
    # slot serves both.
    current: _Kept | None = None
    recording: bool = False


@contextlib.contextmanager
def _pass(kept: _Kept, recording: bool) -> Iterator[None]:
    saved = _State.current, _State.recording
    _State.current, _State.recording = kept, recording
    try:
        yield
    finally:
        _State.current, _State.recording = saved
    if recording and not any(r is not None for r in kept.results) and torch.is_grad_enabled():
        _say_not_kept()


_said = False


def _say_not_kept() -> None:
    """Once per process: a checkpointed block's forward kept no attention (a padding mask in its micro-batch, a
    sliding window, ...), so its recompute runs attention again: the option costs nothing there, and gains nothing."""
    global _said
    if not _said:
        _said = True
        log.warning("parallel.ac_keep_attention: a checkpointed block's attention was not kept (a padding mask or "
                    "another attention than causal over whole rows); those blocks recompute it as without the option")


def kept_attention_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A checkpoint's `context_fn`: the (forward, recompute) pair of one block forward, sharing its record."""
    kept = _Kept()
    return _pass(kept, True), _pass(kept, False)


def keep_attention_in(block: nn.Module) -> None:
    """Mark the modules of `block` to keep their attention's results: transformers hands the attention function
    its attention module, whichever class that is, so every module of the block is marked."""
    for module in block.modules():
        setattr(module, KEEP_FLAG, True)


# SDPA's kernels as (forward, backward) through their aten ops, for causal attention without mask or dropout.
# Each forward returns (output, logsumexp, the rest its backward takes); each backward (dq, dk, dv).
def _cudnn_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(grad, q, k, v, out, lse, rest, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = rest
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)[:3]


def _flash_forward(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad, q, k, v, out, lse, rest, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = rest
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


def _efficient_forward(q, k, v, scale):
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale)
    return out, lse, (seed, offset)


def _efficient_backward(grad, q, k, v, out, lse, rest, scale):
    seed, offset = rest
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale)[:3]


def _cpu_forward(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _cpu_backward(grad, q, k, v, out, lse, rest, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale)


_GPU_KERNELS: dict[SDPBackend, tuple[Callable, Callable]] = {
    SDPBackend.CUDNN_ATTENTION: (_cudnn_forward, _cudnn_backward),
    SDPBackend.FLASH_ATTENTION: (_flash_forward, _flash_backward),
    SDPBackend.EFFICIENT_ATTENTION: (_efficient_forward, _efficient_backward),
}
_CPU_KERNELS = (_cpu_forward, _cpu_backward)


def _kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
    """The (forward, backward) pair SDPA would run for causal attention of these inputs, or None where it would run
    another (the unfused math, which keeps its own intermediates; flash for a head size that is not a multiple of 8,
    which SDPA pads first): transformers' attention then runs as without the option."""
    if q.device.type not in ("cpu", "cuda"):
        return None
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale))
    if choice == SDPBackend.FLASH_ATTENTION and q.shape[-1] % 8:
        return None
    if q.device.type == "cpu":
        return _CPU_KERNELS if choice == SDPBackend.FLASH_ATTENTION else None
    return _GPU_KERNELS.get(choice)


class _KeptAttention(torch.autograd.Function):
    """Causal attention of [batch, heads, L, dim] q, k, v (as many heads each) whose kernel forward has run:
    `result` is its (output, logsumexp, rest), computed now or kept from the block's forward. Returns the output;
    backward runs the kernel's backward."""

    @staticmethod
    def forward(ctx, q, k, v, backward, scale, result):
        out, lse, rest = result
        ctx.backward_kernel, ctx.scale, ctx.rest = backward, scale, rest
        ctx.save_for_backward(q, k, v, out, lse)
        return out.detach()  # a tensor of its own, which autograd makes this node's output

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride() != out.stride():  # the kernels expect the output's layout
            grad_out = torch.empty_like(out).copy_(grad_out)
        dq, dk, dv = ctx.backward_kernel(grad_out, q, k, v, out, lse, ctx.rest, ctx.scale)
        return dq, dk, dv, None, None, None


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv_heads, L, dim] -> [batch, kv_heads * groups, L, dim], each head repeated `groups` times in place
    (transformers' repeat_kv; its gradient sums each group back)."""
    if groups == 1:
        return t
    b, h, length, d = t.shape
    return t[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


def takes(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, is_causal,
          kwargs: dict) -> bool:
    """Whether this attention call keeps its results through the checkpoint: a marked module, causal attention of
    the whole row (no mask, as many keys as queries, several of them), no dropout, no score cap or bias, in
    training."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return (getattr(module, KEEP_FLAG, False) and attention_mask is None and not dropout and bool(causal)
            and query.shape[2] > 1 and key.shape[2] == query.shape[2] and torch.is_grad_enabled()
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None)


@torch.compiler.disable  # records and takes Python-side state; the rest of the block stays compiled
def kept_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scaling: float | None) -> torch.Tensor | None:
    """Causal attention of query [batch, heads, L, dim] and key, value [batch, kv_heads, L, dim], the output as
    [batch, L, heads, dim] (transformers' layout), recorded in the block's forward and taken in its recompute; None
    where no kernel takes it (the caller runs transformers' attention)."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    kept, recording = _State.current, _State.recording
    if kept is not None and not recording:  # a recompute: the kernels its forward chose, and their results
        if kept.taken >= len(kept.results):
            raise RuntimeError("parallel.ac_keep_attention: a block's recompute ran more attention calls than its "
                               "forward recorded")
        record, kept.results[kept.taken] = kept.results[kept.taken], None  # its saved tensors hold it now
        kept.taken += 1
        if record is None:  # the forward's call ran transformers' attention: so does its recompute
            return None
        result, backward = record
    else:
        kernels = _kernels(query, key, value, scaling)
        if kernels is None:
            if kept is not None:
                kept.results.append(None)
            return None
        with torch.no_grad():  # the kernel's op alone, not its autograd (which would save q, k, v a second time)
            result = kernels[0](query, key, value, scaling)
        backward = kernels[1]
        if kept is not None:
            kept.results.append((result, backward))
    return _KeptAttention.apply(query, key, value, backward, scaling, result).transpose(1, 2)
