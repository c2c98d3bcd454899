"""The matmul of a frozen quantized linear layer that saves nothing but the layer for backward."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RefetchingMatmul(torch.autograd.Function):
    """y = x W^T with W = layer.dequantized_weight(): backward asks the layer again rather than keep W (or
    its storage) alive, so a frozen layer's activation memory is its input only. For storage whose fetch
    is the layer's business (HQQ; NF4 kept in host memory by parallel.cpu_offload)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the layer's dense weight in x's dtype where the caller has it already (not kept either)."""
        ctx.layer = layer
        return F.linear(x, layer.dequantized_weight(x.dtype) if weight is None else weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ ctx.layer.dequantized_weight(grad_out.dtype, after=grad_out)
        return grad_x, None, None
