"""NF4 (4-bit NormalFloat) frozen linear layer with integer-only storage.

Why integer storage: FSDP2 casts every *floating* parameter to the MixedPrecisionPolicy's param_dtype
before all-gathering it. Packed 4-bit codes kept in a float dtype get mangled (bit patterns that read
as NaN are canonicalized, bnb issue #1945) and fp32 scales would be rounded to bf16. FSDP2 leaves
non-floating parameters alone, so we keep the codes as uint8 and each block's fp32 absmax as its raw
int32 bits: both are sharded and all-gathered byte for byte, about a quarter of bf16's traffic.

Layout: bitsandbytes' NF4 layout of the row-major flattened weight, reshaped so that dim 0 is the
output row. With `in_features % blocksize == 0` no quantization block straddles two rows, so FSDP2's
dim-0 shards always hold whole blocks and their own scales.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from bitsandbytes import functional as bnbf
from torch.distributed.tensor import DTensor


@functools.cache
def _nf4_code(device: torch.device) -> torch.Tensor:
    # Built once per device: creating it per call would be a host-to-device copy in every forward.
    return bnbf.get_4bit_type("nf4", device=device)


def quantize_nf4(weight: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight on its device; return (packed uint8 [out, in/2], absmax bits int32 [out, in/bs])."""
    out_features, in_features = weight.shape
    assert in_features % blocksize == 0, "caller checks quantizability"
    packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=blocksize, quant_type="nf4")
    absmax = state.absmax.to(torch.float32).view(torch.int32)
    return packed.view(out_features, in_features // 2), absmax.view(out_features, in_features // blocksize)


def dequantize_nf4(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_nf4` through bitsandbytes' kernels (CUDA) or its CPU path."""
    out_features, half_in = packed.shape
    in_features = half_in * 2
    blocksize = in_features // absmax_bits.shape[1]
    state = bnbf.QuantState(
        absmax=absmax_bits.view(torch.float32).reshape(-1),
        shape=torch.Size((out_features, in_features)),
        code=_nf4_code(packed.device),
        blocksize=blocksize,
        quant_type="nf4",
        dtype=dtype,
    )
    return bnbf.dequantize_4bit(packed.reshape(-1, 1), state)


def can_quantize(linear: nn.Linear, blocksize: int) -> bool:
    return linear.in_features % blocksize == 0


def _gathered(t: torch.Tensor) -> torch.Tensor:
    # Under FSDP2 the block's pre-forward all-gather has already put full tensors here; storage sharded
    # as DTensor buffers (torch versions whose FSDP2 refuses integer params) is gathered on use. A mesh
    # of one holds everything locally: skipping DTensor's dispatch there saves CPU time in every call.
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()


class _NF4Matmul(torch.autograd.Function):
    """y = x W^T with W dequantized on the fly; backward dequantizes again instead of saving W (or the
    gathered codes), so the activation memory of a frozen layer is its input only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ ctx.layer.dequantized_weight(grad_out.dtype)
        return grad_x, None


class NF4Linear(nn.Module):
    """A frozen linear layer stored in NF4. Parameters (not buffers) so that FSDP2 shards them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        blocksize: int,
        bias_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features % blocksize:
            raise ValueError(f"in_features {in_features} is not a multiple of the NF4 blocksize {blocksize}")
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        absmax = torch.empty(out_features, in_features // blocksize, dtype=torch.int32, device=device)
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.absmax = nn.Parameter(absmax, requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear, blocksize: int, bias_dtype: torch.dtype) -> NF4Linear:
        """An empty NF4Linear on `linear`'s device with its shape (weights are loaded later)."""
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            blocksize,
            bias_dtype=bias_dtype,
            device=linear.weight.device,
        )

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a full weight into this (unsharded) layer's storage."""
        packed, absmax = quantize_nf4(weight, self.blocksize)
        self.packed.copy_(packed)
        self.absmax.copy_(absmax)

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_nf4(_gathered(self.packed), _gathered(self.absmax), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _NF4Matmul.apply(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        bits = 4 + 32 / self.blocksize
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, blocksize={self.blocksize} ({bits:.2f} bits/weight)"
        )
