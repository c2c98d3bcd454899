"""The training loss: summed next-token cross-entropy over the trained tokens, in fp32.

Two implementations of the same function, chosen once when the trainer is built:

- `FullLogitsLoss` asks the model for its logits, as any Hugging Face causal LM returns them. Over a
  128k vocabulary that is [tokens, 128k] in bf16, again in fp32 for the log-sum-exp, and once more for
  the gradient: about 2.5 GiB at 2,048 tokens and 10 GiB at 8,192.
- `ChunkedLoss` stops the model before its head (`logits_to_keep` with no positions), takes the final
  hidden states, and applies the head and cross-entropy a few hundred tokens at a time, recomputing each
  chunk's logits in backward: never more than one chunk of logits exists. Used for architectures whose
  head is a plain linear (optionally with Gemma's tanh soft-capping), which covers every family qshard
  lists; anything else keeps the full-logits path.

Both sum (not average) the loss: the trainer divides by the trained-token count of the global batch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
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
    def __init__(self, model: nn.Module, chunk_tokens: int) -> None:
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.chunk_tokens = chunk_tokens
        self.hidden: torch.Tensor | None = None
        # The decoder's output is the head's input; a hook hands it over without asking the model for logits.
        model.base_model.register_forward_hook(self._capture)

    def _capture(self, _module: nn.Module, _args, output) -> None:
        self.hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _ChunkedHeadCE.apply(*self._head_inputs(model, batch), self.chunk_tokens, self.softcap, "sum")

    def token_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The log-prob of each trained next token, in the order of `loss_positions` (preference objectives)."""
        return -_ChunkedHeadCE.apply(*self._head_inputs(model, batch), self.chunk_tokens, self.softcap, "none")

    def _head_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple:
        """(hidden states at the trained positions, their next tokens, the head's weight and bias)."""
        device = batch["input_ids"].device
        no_positions = torch.empty(0, dtype=torch.long, device=device)
        model(**model_inputs(batch), use_cache=False, logits_to_keep=no_positions)
        hidden, self.hidden = self.hidden, None
        # Prompt and padding positions need no logits at all. Positions rather than a mask: selecting by a
        # mask would wait for the device to count it, in forward and again in backward.
        states, labels = trained_positions(hidden, batch)
        # The head's weight as its FSDP unit gathered it (kept from the forward into backward, see
        # parallel/fsdp.py; unshard() is a no-op then). Still sharded, e.g. outside FSDP: gathered here.
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


class _ChunkedHeadCE(torch.autograd.Function):
    """Cross-entropy of the head's logits, chunk by chunk: summed ("sum"), or each token's ("none")."""

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


def build_loss(model: nn.Module, chunk_tokens: int):
    """The chunked loss where the architecture's head is known to be plain; the full-logits one otherwise
    (or when `train.loss_chunk_tokens` is 0)."""
    model_type = getattr(model.config, "model_type", None)
    if chunk_tokens <= 0:
        return FullLogitsLoss()
    if model_type not in PLAIN_HEAD_MODEL_TYPES or model.get_output_embeddings() is None:
        log.info("loss over full logits: %s's output head is not one qshard chunks", model_type)
        return FullLogitsLoss()
    return ChunkedLoss(model, chunk_tokens)


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
