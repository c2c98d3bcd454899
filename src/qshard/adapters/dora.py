"""DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) over a frozen base layer.

The adapted weight is W' = m * V / ||V||, V = W0 + (alpha/r) B A (or rsLoRA's alpha/sqrt(r)), with the norm
taken over the input dim of each output row and m a trainable magnitude per output row. As the paper
recommends (and peft does), ||V|| is a constant in backward: gradients reach m, A and B only through the
numerator, and the norm is computed under no_grad, in fp32.

The base is a frozen nn.Linear (`dora`) or QuantizedLinear (`qdora`: NF4, HQQ, ...). The forward never builds
W': y = base(x) + (m/||V|| - 1) (W0 x) + (m/||V||) (alpha/r) B A x, which reuses the base layer's own
matmul (and its memory-saving backward) and equals W' x + bias. With adapter dropout active, the
(m/||V|| - 1) W0 term is taken on the dropped-out input as well, as the reference implementation and
peft do; that costs one more base matmul in training.

A DoRALinear is a LoRALinear plus the magnitude, so loading, export and checkpointing treat its A and B
as they treat LoRA's. The magnitude starts at ||W0|| per row (B starts at zero, so V = W0): training
starts from the base model's function.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from qshard.adapters.lora import LoRALinear
from qshard.parallel.mesh import local_tensor
from qshard.quant import QuantizedLinear
from qshard.quant.linear import full_storage
from qshard.quant.matmul import RefetchingMatmul


def local_base_rows(base: nn.Module) -> torch.Tensor:
    """This rank's rows of the frozen base weight, dense, in fp32. FSDP2 (and the DTensor buffers of
    `parallel.quant_sharding: dtensor`) shard every one of them along dim 0, the output rows, into the
    same row ranges as the magnitude, so no gather is needed to compute the rows' norms."""
    if isinstance(base, QuantizedLinear):
        return base.dequantize(tuple(local_tensor(getattr(base, name)) for name in base.STORAGE), torch.float32)
    return local_tensor(base.weight).float()


def dense_base(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The whole base weight inside a forward (FSDP2 has gathered the block's parameters by then)."""
    if isinstance(base, nn.Linear):
        return base.weight.to(dtype)
    return base.dequantized_weight(dtype)


def dora_merge(weight: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """W' = m * V / ||V|| (row norms) for V = W0 + (alpha/r) B A: the weight a merged export holds."""
    return weight * (magnitude / torch.linalg.vector_norm(weight, dim=1)).unsqueeze(1)


class DoRALinear(LoRALinear):
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
        super().__init__(base, in_features, out_features, rank, alpha, dropout, dtype, use_rslora, init)
        self.magnitude = nn.Parameter(torch.empty(out_features, dtype=dtype, device=self.lora_A.device))

    @torch.no_grad()
    def init_adapter(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA's initial (A, B), returned for the caller to shard, with the same draws as LoRA; and the
        magnitude, set here in place from this rank's rows of the base, which must be loaded by now."""
        a, b = super().init_adapter(generator)
        magnitude = local_tensor(self.magnitude)
        if magnitude.numel():
            rows = local_base_rows(self.base)
            assert rows.shape[0] == magnitude.shape[0], "base and magnitude sharded alike"
            magnitude.copy_(torch.linalg.vector_norm(rows, dim=1))
        return a, b

    @torch.no_grad()
    def weight_norm(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """||W0 + (alpha/r) B A|| per output row, in fp32, outside autograd (the paper's constant norm);
        `base`: W0 in fp32 where the caller has it."""
        delta = self.lora_B.float() @ self.lora_A.float()
        base = dense_base(self.base, torch.float32) if base is None else base
        return torch.linalg.vector_norm(base + self.scaling * delta, dim=1)

    def join_base(self) -> None:
        """Nothing joins the base's matmul: DoRA scales the base's output by the magnitude over the norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return self.base(x)
        dropped = self.dropout(x) if self.training and isinstance(self.dropout, nn.Dropout) else None
        if isinstance(self.base, QuantizedLinear) and self.base.offloaded is not None:
            y, base_part, norm = self._offloaded_base(x, dropped)
        else:
            y, norm = self.base(x), self.weight_norm()
            base_part = y if dropped is None else self.base(dropped)
        scale = (self.magnitude.float() / norm).to(x.dtype)
        if self.base.bias is not None:
            base_part = base_part - self.base.bias.to(y.dtype)
        x = x if dropped is None else dropped
        update = F.linear(F.linear(x, self.lora_A.to(x.dtype)) * self.scaling, self.lora_B.to(x.dtype))
        return y + (scale - 1) * base_part + scale * update

    def _offloaded_base(self, x: torch.Tensor, dropped: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """base(x), base(dropped) (or base(x) again without dropout) and the weight's norm, from one fetch of the
        base's storage kept in host memory (parallel.cpu_offload): a compiled block's second fetch of a tensor in
        one pass would be a copy from host memory on the compute stream. Both inputs go through one matmul, so
        that its backward fetches the storage once too."""
        storage = full_storage(self.base)
        norm = self.weight_norm(self.base.dequantize(storage, torch.float32))
        inputs = x if dropped is None else torch.cat([x, dropped])
        out = RefetchingMatmul.apply(inputs, self.base, self.base.dequantize(storage, x.dtype))
        if self.base.bias is not None:
            out = out + self.base.bias.to(out.dtype)
        if dropped is None:
            return out, out, norm
        y, base_part = out.chunk(2)
        # Autograd saves base_part for the magnitude's gradient: in memory of its own, so that it does not keep
        # y's half of the matmul's output alive until backward.
        return y, base_part.clone(), norm
