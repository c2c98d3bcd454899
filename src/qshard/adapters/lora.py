"""LoRA: y = base(x) + (alpha / r) * B A dropout(x), with A [r, in] and B [out, r] (rsLoRA: alpha / sqrt(r)).

The base is any frozen linear-shaped module (a QuantizedLinear or a bf16 nn.Linear). A and B are plain
parameters; their storage dtype is the master dtype (fp32 by default) and FSDP2's
MixedPrecisionPolicy hands the forward a bf16 copy, so the adapter computes in bf16 and its
gradients are reduced and stepped in fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from qshard.adapters.from_base import factors_from_base


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """The factor on B A: alpha / r, or rank-stabilized LoRA's alpha / sqrt(r) (Kalajdzievski 2023), which keeps
    the update's size from shrinking as the rank grows."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nn.Module):
    # False inside `adapters_disabled`: the layer is its base alone (the reference of preference tuning).
    adapter_enabled = True
    # Whether the base computes the B factor's matmul with its own (`join_base`): set at build time.
    joined_with_base = False

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float,
        dtype: torch.dtype = torch.float32,
        use_rslora: bool = False,
        init: str = "default",
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = lora_scaling(alpha, rank, use_rslora)
        device = next(base.parameters()).device
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, dtype=dtype, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # PiSSA/OLoRA (lora.init): the factors that split the base weight, set by `split_base` while it loads.
        self.factors_from_base = factors_from_base(init)
        self.initial: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def split_base(self, weight: torch.Tensor) -> torch.Tensor:
        """For an adapter that starts from its base (PiSSA, OLoRA): the full base `weight` -> the residual
        W - scaling B0 A0 that the base holds instead, in fp32. The full (A0, B0) are kept in host memory, plain
        attributes that neither FSDP2 nor a checkpoint sees, for the adapter's init and its export."""
        weight = weight.float()
        a0, b0 = self.factors_from_base(weight, self.rank, self.scaling)
        self.initial = (a0.cpu(), b0.cpu())
        return weight - self.scaling * (b0 @ a0)

    @torch.no_grad()
    def init_adapter(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-size initial (A, B), as in the LoRA paper: A Kaiming-uniform, B zero, so training starts
        from the base model's function. Returned on CPU: the caller shards them into place. An adapter that
        starts from its base returns the (A0, B0) that loading split off it, drawing nothing."""
        if self.factors_from_base is not None:
            assert self.initial is not None, "the base weight is loaded (and split) before adapters are initialized"
            return self.initial
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_ with a=sqrt(5) on fan_in
        a = torch.empty(self.rank, self.in_features).uniform_(-bound, bound, generator=generator)
        b = torch.zeros(self.out_features, self.rank)
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return self.base(x)
        # The scaling rides on B's cast to the compute dtype ([out, r] elements, not the [tokens, r]
        # intermediate): compiled blocks fuse the two into one kernel instead of launching a separate multiply.
        low_rank = F.linear(self.dropout(x), self.lora_A.to(x.dtype))
        b = (self.lora_B * self.scaling).to(x.dtype)
        if self.joined_with_base:
            return self.base.forward_beside_low_rank(x, low_rank, b)
        return self.base(x) + F.linear(low_rank, b)

    def join_base(self) -> None:
        """Called once at build time, after the base layer was told it is in a traced checkpoint
        (parallel/compile.py): where the base can (`joins_low_rank`), the adapter's B factor joins the base's matmul,
        which saves a matmul a layer in forward and one in backward (quant/nf4.py, `_NF4MatmulBesideLowRank`). Only
        for a rank that is a multiple of 8: the widened weight's rows, in + rank 16-bit values, then start 16 bytes
        apart, as the matmul and the kernel writing it need to run at full speed."""
        self.joined_with_base = getattr(self.base, "joins_low_rank", False) and self.rank % 8 == 0

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every LoRA/DoRA layer of `model` computes its frozen base alone inside the block: the base model's function
    from the same (sharded, quantized) weights, with no second copy of them. Modules trained in full
    (lora.modules_to_save) are not adapters and stay as trained."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True
