"""The training loss: summed next-token cross-entropy over the trained tokens, in fp32.

Two implementations of the same function, chosen once when the trainer is built:

- `FullLogitsLoss` asks the model for its logits, as any Hugging Face causal LM returns them. Over a
  128k vocabulary that is [tokens, 128k] in bf16, again in fp32 for the log-sum-exp, and once more for
  the gradient: about 2.5 GiB at 2,048 tokens and 10 GiB at 8,192.
- `ChunkedLoss` stops the model before its head (`logits_to_keep` with no positions), takes the final
  hidden states, and applies the head and cross-entropy a few hundred tokens at a time: never more than one
  chunk of logits exists. A frozen head (every adapter train type) has each chunk's gradient with respect to
  its hidden states computed in forward, beside its loss (`_FrozenHeadCE`); a head that trains has each chunk's
  logits recomputed in backward (`_ChunkedHeadCE`). Used for architectures whose head is a plain linear
  (optionally with Gemma's tanh soft-capping), which covers every family qshard lists; anything else keeps the
  full-logits path.

Both sum (not average) the loss: the trainer divides by the trained-token count of the global batch.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from qshard.data import IGNORE_INDEX, collate, model_inputs

log = logging.getLogger("qshard")

# Model types whose forward ends in `lm_head(hidden_states)` followed only by an optional
# `final_logit_softcapping` (Gemma 2/3); others may scale logits in ways this module does not know.
PLAIN_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2",
    "gemma3_text",
})


class FullLogitsLoss:
    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**model_inputs(batch), use_cache=False).logits
        labels = batch["labels"][:, 1:]
        # fp32: bf16 logits lose too much in the log-sum-exp over a large vocabulary.
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def token_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The log-prob of each trained next token, at `batch["loss_positions"]` (preference objectives)."""
        logits = model(**model_inputs(batch), use_cache=False).logits
        selected, targets = trained_positions(logits, batch)
        return -F.cross_entropy(selected.float(), targets, reduction="none")


class ChunkedLoss:
    def __init__(self, model: nn.Module, chunk_tokens: int, compile_backend: str | None = None) -> None:
        """`compile_backend`: the torch.compile backend of a run whose blocks are compiled, which the frozen head's
        chunk arithmetic is compiled with too (its log-sum-exp, softmax and one-hot subtraction become one pass
        over the chunk's logits in the compute dtype, not several over fp32 copies); None: run eagerly."""
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.chunk_tokens = chunk_tokens
        self.frozen_chunk = _chunk_loss_and_gradient if compile_backend is None else _compiled_chunk(compile_backend)
        self.hidden: torch.Tensor | None = None
        # The decoder's output is the head's input; a hook hands it over without asking the model for logits.
        model.base_model.register_forward_hook(self._capture)

    def _capture(self, _module: nn.Module, _args, output) -> None:
        self.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._cross_entropy(self._head_inputs(model, batch), "sum")

    def token_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The log-prob of each trained next token, in the order of `loss_positions` (preference objectives)."""
        return -self._cross_entropy(self._head_inputs(model, batch), "none")

    def _cross_entropy(self, inputs: tuple, reduction: str) -> torch.Tensor:
        states, labels, weight, bias = inputs
        # fp16 keeps the path whose gradient is scaled (by the loss scale) before it is rounded to fp16: unscaled,
        # probabilities under fp16's smallest value would round to zero.
        if weight.requires_grad or (bias is not None and bias.requires_grad) or states.dtype == torch.float16:
            return _ChunkedHeadCE.apply(states, labels, weight, bias, self.chunk_tokens, self.softcap, reduction)
        with_gradient = states.requires_grad and torch.is_grad_enabled()
        loss = _FrozenHeadCE.apply(states, labels, weight, bias, self.chunk_tokens, self.softcap, reduction,
                                   self.frozen_chunk, with_gradient)
        if with_gradient and isinstance(self.head, FSDPModule):
            # The micro-batch's last forward (gradient-free ones, a preference reference, come before it): backward
            # never reads a frozen head's weight, so its gathered copy is freed now rather than at the end of
            # backward (per GPU: 1 GiB for an 8B model's head in bf16, 2 GiB for a 70B's).
            self.head.reshard()
        return loss

    def _head_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple:
        """(hidden states at the trained positions, their next tokens, the head's weight and bias)."""
        device = batch["input_ids"].device
        no_positions = torch.empty(0, dtype=torch.long, device=device)
        model(**model_inputs(batch), use_cache=False, logits_to_keep=no_positions)
        hidden, self.hidden = self.hidden, None
        # Prompt and padding positions need no logits at all. Positions rather than a mask: selecting by a
        # mask would wait for the device to count it, in forward and again in backward.
        states, labels = trained_positions(hidden, batch)
        # The head's weight as its FSDP unit gathered it: the model's forward calls the head (on no positions), whose
        # unit keeps it gathered after forward (parallel/fsdp.py), so unshard() is a no-op then; a frozen head is
        # resharded after the loss with gradient (`_cross_entropy`), a trained one at the end of backward. Still
        # sharded, e.g. outside FSDP: gathered here.
        if isinstance(self.head, FSDPModule):
            self.head.unshard()
        weight, bias = self.head.weight, self.head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        if isinstance(bias, DTensor):
            bias = bias.full_tensor()
        return states, labels, weight, bias


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into [batch x (length - 1)] of the next-token targets that count in the loss."""
    return (labels[:, 1:] != IGNORE_INDEX).flatten().nonzero().squeeze(1)


def trained_positions(outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's outputs [batch, length, ...] at the positions that predict a trained token, those tokens).
    A batch with `loss_targets` (pref.share_prompt's rows, whose tokens are not all predicted by the position
    before them) names its positions into [batch x length] and their targets; any other batch has them from its
    labels: each position predicts the next token."""
    if "loss_targets" in batch:
        return outputs.flatten(0, 1).index_select(0, batch["loss_positions"]), batch["loss_targets"]
    positions = batch.get("loss_positions")
    if positions is None:
        positions = loss_positions(batch["labels"])
    labels = batch["labels"][:, 1:].flatten().index_select(0, positions)
    return outputs[:, :-1].flatten(0, 1).index_select(0, positions), labels


def _chunk_loss(states, labels, weight, bias, softcap, reduction="sum") -> torch.Tensor:
    """The full-logits path's arithmetic on a slice of tokens: logits in the compute dtype, soft-capped
    there as the model would, then cross-entropy in fp32 (summed, or per token with reduction "none")."""
    logits = F.linear(states, weight.to(states.dtype), None if bias is None else bias.to(states.dtype))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


def _chunk_loss_and_gradient(states, labels, weight, bias, softcap, with_gradient: bool):
    """`_chunk_loss`'s per-token losses (reduction "none") and, `with_gradient`, their gradient with respect to
    `states`: (softmax - one-hot of the label) through the soft-cap (d/dz c tanh(z/c) = 1 - tanh(z/c)^2), in
    the compute dtype, times the head's weight. The logits are rounded to the compute dtype and soft-capped there,
    as the model computes them; the loss and the softmax in fp32."""
    weight = weight.to(states.dtype)
    logits = F.linear(states, weight, None if bias is None else bias.to(states.dtype))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    losses = lse - logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    if not with_gradient:
        return losses, None
    through_cap = None if softcap is None else 1 - (logits / softcap) ** 2
    # In place of the fp32 logits (no longer read): run eagerly, one [chunk, vocabulary] fp32 tensor is alive at once.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad[torch.arange(len(labels), device=labels.device), labels] -= 1
    if through_cap is not None:
        grad.mul_(through_cap)
    return losses, grad.to(states.dtype) @ weight


@functools.cache
def _compiled_chunk(backend: str):
    """`_chunk_loss_and_gradient` compiled, one object per backend for the process (a new one would compile again).
    Dynamic: a chunk's length is the count of trained tokens left, which changes from batch to batch."""
    return torch.compile(_chunk_loss_and_gradient, backend=backend, dynamic=True)


class _FrozenHeadCE(torch.autograd.Function):
    """Cross-entropy of a frozen head's logits, chunk by chunk: summed ("sum"), or each token's ("none").

    The loss is the end of the graph, so a token's gradient with respect to its logits (softmax - one-hot) needs
    nothing from backward but the factor backward brings (one for the sum, one per token): each chunk's gradient
    with respect to its hidden states is computed in forward beside its loss, and kept instead of the states.
    Backward only multiplies. Each chunk's logits are computed once, not again in backward as `_ChunkedHeadCE`
    must for a head whose own gradient is wanted. Without `with_gradient` (no grad: evaluation, a preference
    reference) only the losses are computed. `chunk_fn`: `_chunk_loss_and_gradient`, or its compiled form."""

    @staticmethod
    def forward(ctx, states, labels, weight, bias, chunk_tokens, softcap, reduction, chunk_fn, with_gradient):
        losses = states.new_empty(states.shape[0], dtype=torch.float32)
        grad_states = torch.empty_like(states) if with_gradient else None
        for start, end in _chunks(states.shape[0], chunk_tokens):
            losses[start:end], grad = chunk_fn(states[start:end], labels[start:end], weight, bias, softcap,
                                               with_gradient)
            if with_gradient:
                grad_states[start:end] = grad
        ctx.save_for_backward(grad_states)
        ctx.reduction, ctx.chunk_tokens = reduction, chunk_tokens
        return losses.sum() if reduction == "sum" else losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (grad_states,) = ctx.saved_tensors
        # Chunk by chunk into a new tensor: the product in fp32 of all of it at once would take 4 bytes a value more
        # at the step's peak; the saved tensor stays as it is (a backward with retain_graph runs this again).
        grad = torch.empty_like(grad_states)
        for start, end in _chunks(grad.shape[0], ctx.chunk_tokens):
            factor = grad_out if ctx.reduction == "sum" else grad_out[start:end].unsqueeze(1)
            grad[start:end] = grad_states[start:end].float() * factor
        return grad, None, None, None, None, None, None, None, None


def _chunks(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `n` tokens; a last chunk of one token joins the one before it, since a compiled
    chunk function (compiled for any length) is compiled again for a length of one."""
    bounds = [(start, min(start + chunk_tokens, n)) for start in range(0, n, chunk_tokens)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


class _ChunkedHeadCE(torch.autograd.Function):
    """Cross-entropy of the head's logits, chunk by chunk: summed ("sum"), or each token's ("none"), for a head
    that trains: each chunk's logits are computed again in backward, for the head's gradient and the states'."""

    @staticmethod
    def forward(ctx, states, labels, weight, bias, chunk_tokens, softcap, reduction="sum"):
        ctx.save_for_backward(states, labels, weight, bias)
        ctx.chunk_tokens, ctx.softcap, ctx.reduction = chunk_tokens, softcap, reduction
        if reduction == "none":
            out = states.new_empty(states.shape[0], dtype=torch.float32)
            for start in range(0, states.shape[0], chunk_tokens):
                end = start + chunk_tokens
                out[start:end] = _chunk_loss(states[start:end], labels[start:end], weight, bias, softcap, "none")
            return out
        total = states.new_zeros((), dtype=torch.float32)
        for start in range(0, states.shape[0], chunk_tokens):
            end = start + chunk_tokens
            total += _chunk_loss(states[start:end], labels[start:end], weight, bias, softcap)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        states, labels, weight, bias = ctx.saved_tensors
        need_states, _, need_weight, need_bias = ctx.needs_input_grad[:4]
        grad_states = torch.empty_like(states) if need_states else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        weight_leaf = weight.detach().requires_grad_(need_weight)
        bias_leaf = None if bias is None else bias.detach().requires_grad_(need_bias)
        for start in range(0, states.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            piece = states[start:end].detach().requires_grad_(need_states)
            inputs = [t for t, need in ((piece, need_states), (weight_leaf, need_weight), (bias_leaf, need_bias))
                      if need]
            grad = grad_total if ctx.reduction == "sum" else grad_total[start:end]
            with torch.enable_grad():
                loss = _chunk_loss(piece, labels[start:end], weight_leaf, bias_leaf, ctx.softcap, ctx.reduction)
                grads = iter(torch.autograd.grad(loss, inputs, grad))
            if need_states:
                grad_states[start:end] = next(grads)
            if need_weight:
                grad_weight += next(grads)
            if need_bias:
                grad_bias += next(grads)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_states, None, cast(grad_weight, weight), cast(grad_bias, bias), None, None, None


def chunks_loss(model: nn.Module, chunk_tokens: int) -> bool:
    """Whether `build_loss` chunks `model`'s loss: a chunk size, and a head known to be plain."""
    return (chunk_tokens > 0 and getattr(model.config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and model.get_output_embeddings() is not None)


def build_loss(model: nn.Module, chunk_tokens: int, compile_backend: str | None = None):
    """The chunked loss where the architecture's head is known to be plain; the full-logits one otherwise
    (or when `train.loss_chunk_tokens` is 0). `compile_backend`: see `ChunkedLoss`."""
    if chunks_loss(model, chunk_tokens):
        return ChunkedLoss(model, chunk_tokens, compile_backend)
    if chunk_tokens > 0:
        log.info("loss over full logits: %s's output head is not one qshard chunks",
                 getattr(model.config, "model_type", None))
    return FullLogitsLoss()


class TokenObjective:
    """train.objective sft, as the trainer uses an objective: (summed loss, the metrics' sums and counts: none
    here) of a micro-batch, normalized by the global batch's trained tokens (`units`)."""

    metrics: tuple[str, ...] = ()
    unit = "trained_tokens"
    collate = staticmethod(collate)

    def __init__(self, loss) -> None:
        self.loss = loss

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss(model, batch), batch["input_ids"].new_zeros(0, dtype=torch.float32)

    @staticmethod
    def start_step(_model: nn.Module, _batches: list[dict[str, torch.Tensor]]) -> None:
        """Nothing to prepare for an optimizer step's micro-batches (KTO's reference point does)."""

    @staticmethod
    def units(batch: dict[str, torch.Tensor]) -> int:
        return len(loss_positions(batch["labels"]))
