"""Activation checkpointing of every k-th transformer block, reentrant or not, keeping parameter names.

Non-reentrant: torch's composable `checkpoint` (hooks on the block, no wrapper module, so checkpoints,
exports and loading see the original names). Reentrant: torch.utils.checkpoint(use_reentrant=True) needs
the block's forward wrapped; checkpoint_wrapper would do it with a wrapper module that renames every
parameter, so the block's own transformers mechanism (GradientCheckpointingLayer: a flag and a checkpoint
function per layer) is used instead. It wraps `forward`, not `__call__`, so FSDP2's hooks stay outside the
checkpointed region and the recompute does not gather weights twice.

Compiled blocks that no FSDP2 unit holds (quantized, or training only LoRA/DoRA adapters, on one device) are
checkpointed inside their graph instead where config.py's `checkpoint_trace_unmet` allows it (one device, no
LoRA dropout): `traced_checkpoint`. The compiler then builds one backward graph per block that recomputes only
what backward needs, under a policy that recomputes every op but random draws, so the block keeps its inputs
and the outputs of its random ops (none without dropout); with parallel.ac_save_projections also its narrowing
projections and the outputs of sdpa attention's kernels.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers.modeling_layers import GradientCheckpointingLayer

from qshard.attention import use_shared_prompt_attention
from qshard.config import ParallelConfig
from qshard.errors import QShardError
from qshard.host_embedding import HostEmbedding
from qshard.parallel.kept_attention import keep_attention_in, kept_attention_contexts


def checkpointed_blocks(blocks: list[nn.Module], p: ParallelConfig) -> list[nn.Module]:
    """Blocks 0, k, 2k, ... (k = parallel.ac_every), or none."""
    return blocks[:: p.ac_every] if p.activation_checkpointing else []


def apply_activation_checkpointing(
    model: nn.Module, blocks: list[nn.Module], p: ParallelConfig, traced: list[nn.Module] = ()
) -> None:
    """Checkpoint the chosen blocks with hooks around their forward, except those in `traced`, which
    compile_blocks checkpoints inside their compiled graphs (`traced_checkpoint`)."""
    skip = {id(b) for b in traced}
    chosen = [b for b in checkpointed_blocks(blocks, p) if id(b) not in skip]
    if not chosen:
        return
    if not p.ac_reentrant:
        if p.ac_keep_attention:
            use_qshard_sdpa(model)
        for block in chosen:
            if p.ac_keep_attention:
                keep_attention_in(block)
                checkpoint(block, context_fn=kept_attention_contexts)
            else:
                checkpoint(block)
        return
    plain = sorted({type(b).__name__ for b in chosen if not isinstance(b, GradientCheckpointingLayer)})
    if plain:
        raise QShardError(
            f"parallel.ac_reentrant: blocks of class {', '.join(plain)} are not transformers "
            "GradientCheckpointingLayers, so they cannot be checkpointed reentrantly without a wrapper that "
            "renames their parameters; use parallel.ac_reentrant false"
        )
    for block in chosen:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    # A reentrant checkpoint computes parameter gradients only if one of its inputs requires grad; the
    # first block's input comes from frozen embeddings (LoRA, QLoRA), so make it require grad. An embedding
    # looked up on the host (host_embedding.py) is not called in the step: the first block's input is made to.
    if HostEmbedding.of(model) is None:
        model.enable_input_require_grads()
    else:
        from qshard.parallel.compile import first_block_shares_the_graph  # compile.py imports this module

        first_block_shares_the_graph(blocks)


def use_qshard_sdpa(model: nn.Module) -> None:
    """parallel.ac_keep_attention: the model's attention through qshard's "sdpa" function (attention.py), which
    keeps it through the checkpoint; refused for a model that does not use transformers' sdpa attention."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise QShardError(f"parallel.ac_keep_attention: {type(model).__name__} runs {implementation} attention, and "
                          "only sdpa attention is kept through the checkpoint; set model.attn_implementation sdpa "
                          "or parallel.ac_keep_attention false")
    use_shared_prompt_attention()


def _draws_random_numbers(op, args, kwargs) -> bool:
    """Whether this call of `op` is random. Ops that can be (dropout, attention with dropout) are tagged as
    seeded; they are random only when their dropout probability is non-zero: attention in training has
    dropout_p 0.0 in most models and is then deterministic, so cheaper recomputed than kept."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value)
            return not isinstance(value, (int, float)) or value != 0  # a tensor of probabilities: random
    return True


def _narrowing_matmul(op, args) -> bool:
    """Whether this is a matmul whose output has no more columns than its contraction dimension: a block's
    attention projections and LoRA's A factors, as opposed to the MLP's widening gate and up projections."""
    if op is torch.ops.aten.mm.default:
        weight = args[1]
    elif op is torch.ops.aten.addmm.default:
        weight = args[2]
    else:
        return False
    return weight.shape[-1] <= weight.shape[-2]


# The fused attention kernels torch's sdpa dispatches to: their outputs (the attention output and the softmax's
# log-sum-exp) are what their backward reads beside q, k and v.
_ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(torch.ops.aten, name)
)


class _RecomputePolicy:
    """Which ops a traced checkpoint keeps for backward. A module-level class, not a closure: the compiler's
    cache pickles it with the graph it belongs to, and cannot pickle a local function. The NF4 layers of these
    blocks save their dense weights for backward (quant/nf4.py, `_NF4MatmulInTracedCheckpoint`, or the weight widened
    by a LoRA B factor, `_NF4MatmulBesideLowRank`) on the promise that the dequantization is recomputed here, never
    kept: keeping it would keep every block's dense weights. A joined matmul contracts over in + rank columns, so
    `_narrowing_matmul` counts a layer with in < out <= in + rank as narrowing (no common model has one)."""

    def __init__(self, save_projections: bool) -> None:
        self.save_projections = save_projections

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        # Random draws keep their output: recomputed, they would draw another dropout mask in backward.
        if _draws_random_numbers(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        # Narrowing projections keep theirs when asked: the compiler keeps only those that backward reads
        # (attention's q, k and v, each adapter's low-rank input), not the outputs of o_proj and down_proj.
        # Attention then keeps its output and log-sum-exp: with q, k and v kept, those are all its backward
        # reads, so the recompute runs no attention kernel, and nothing random (attention takes a dropout
        # probability) is recomputed, which keeps CUDA graphs cacheable (compile.py, graph_min_micro_batches).
        if self.save_projections and (op in _ATTENTION_OPS or _narrowing_matmul(op, args)):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE


@functools.cache
def _checkpoint_context(save_projections: bool) -> functools.partial:
    """The context function of every traced checkpoint with this setting: one object, which the compiled graphs
    of all blocks of a class share (the compiler guards on its identity, and would compile a graph per block
    for one object each). Its `cache_hash` names the policy in torch's caches, which keep the compiled graphs of
    a selective checkpoint only when told what it decides: this module's code and the one setting, so that
    another version of the policy compiles anew."""
    context = functools.partial(create_selective_checkpoint_contexts, _RecomputePolicy(save_projections))
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    context.cache_hash = f"qshard-traced-checkpoint-{source}-{save_projections}"
    return context


def traced_checkpoint(forward, save_projections: bool = False):
    """`forward` checkpointed in a form the compiler traces into the block's graph.

    Why inside the graph: with the checkpoint around a compiled forward, backward re-runs that whole graph
    (the down projection's matmul too, whose output only the residual sum needs) and then a second graph for
    the gradients, and the host issues both. Traced, backward is one graph that recomputes just the
    tensors the gradients use, with each quantized weight dequantized once (docs/benchmarks-history.md).
    Why every op is forced to recompute: a plain checkpoint only marks ops as preferably recomputed, and
    the compiler's partitioner then keeps most of each block's activations for backward. `save_projections`
    (parallel.ac_save_projections) exempts the narrowing matmuls (`_narrowing_matmul`) and attention."""
    context = _checkpoint_context(save_projections)

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    return checkpointed
