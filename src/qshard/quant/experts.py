"""Frozen mixture-of-experts weights, quantized per expert by any method whose layer says it can (`EXPERTS`).

transformers 5 stores a MoE layer's experts as fused 3-D parameters (`experts.gate_up_proj`
[experts, 2 * intermediate, hidden], `experts.down_proj` [experts, hidden, intermediate]) in one module
whose forward routes tokens to them. Each such parameter is kept here as one quantized linear layer whose
rows are the experts' output rows one after another: a method's rows are quantized on their own (see
quant/linear.py), so this is exactly each expert quantized on its own, and FSDP2's dim-0 shards hold whole
rows. The experts module's own forward runs unchanged on the dequantized weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

from qshard.config import QuantConfig
from qshard.quant.linear import QuantizedLinear


def fused_expert_params(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The module's own 3-D parameters (name -> shape): what makes it a fused-experts module."""
    return {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.ndim == 3}


class QuantizedExperts(nn.Module):
    """Wraps a fused-experts module: each 3-D weight becomes a `method` layer child of the same name."""

    def __init__(self, experts: nn.Module, method: type[QuantizedLinear], quant: QuantConfig) -> None:
        super().__init__()
        assert method.EXPERTS, f"{method.__name__} does not hold fused experts"
        self.shapes = fused_expert_params(experts)
        for name, (n_experts, out_features, in_features) in self.shapes.items():
            device = getattr(experts, name).device
            self.add_module(name, method.from_config(in_features, n_experts * out_features, False, quant,
                                                     device=device))
        # Kept out of the module tree (a plain list): its 3-D parameters stay on meta and are never
        # sharded, loaded or saved; only its forward code and settings are used.
        self._experts = [experts]

    @property
    def experts_class(self) -> str:
        return type(self._experts[0]).__name__

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # The whole layer's experts are dequantized at once (the block's storage is gathered anyway);
        # they are frozen, so autograd keeps them only as long as this block's activations.
        weights = {
            name: getattr(self, name).dequantized_weight(hidden_states.dtype).view(shape)
            for name, shape in self.shapes.items()
        }
        return functional_call(self._experts[0], weights, (hidden_states, *args), kwargs)

    def extra_repr(self) -> str:
        return f"{self.experts_class}, {', '.join(f'{n}={list(s)}' for n, s in self.shapes.items())}"
