"""NF4 (4-bit NormalFloat) frozen linear layer with integer-only storage.

Why integer storage: FSDP2 casts every *floating* parameter to the MixedPrecisionPolicy's param_dtype
before all-gathering it, so packed 4-bit codes kept as bf16 *values* would be mangled (bit patterns that
read as NaN are canonicalized, bnb issue #1945) and fp32 scales rounded to bf16. The layer's own tensors
are therefore integers: codes as uint8 and each block's fp32 absmax as its raw int32 bits, sharded and
all-gathered byte for byte, about a quarter of bf16's traffic. FSDP2 holds them as they are where it
takes integer parameters, else as float *carriers* of the same bytes, in units that cast nothing; either
way a build-time probe checks that its gathers return every byte (parallel/fsdp.py). The dequantizers
below view whatever arrives back as uint8/int32 first.

Layout: bitsandbytes' NF4 layout of the row-major flattened weight, reshaped so that dim 0 is the
output row. With `in_features % blocksize == 0` no quantization block straddles two rows, so FSDP2's
dim-0 shards always hold whole blocks and their own scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bitsandbytes import functional as bnbf

from qshard.config import QuantConfig
from qshard.quant.linear import QuantizedLinear, gathered
from qshard.quant.matmul import RefetchingMatmul

# The 16 NF4 levels (bitsandbytes' table, as fp32 values).
_NF4_VALUES = bnbf.get_4bit_type("nf4", device="cpu")


def quantize_nf4(weight: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight on its device; return (packed uint8 [out, in/2], absmax bits int32 [out, in/bs])."""
    out_features, in_features = weight.shape
    assert in_features % blocksize == 0, "caller checks quantizability"
    packed, state = bnbf.quantize_4bit(weight.contiguous(), blocksize=blocksize, quant_type="nf4")
    absmax = state.absmax.to(torch.float32).view(torch.int32)
    return packed.view(out_features, in_features // 2), absmax.view(out_features, in_features // blocksize)


def dequantize_nf4(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_nf4`: bitsandbytes' kernel (CUDA) or its CPU path, called through its op directly
    (its Python wrapper builds a QuantState and validates it on every call: CPU time in every forward)."""
    packed, absmax_bits = packed.view(torch.uint8), absmax_bits.view(torch.int32)  # a float carrier, if one
    out_features, half_in = packed.shape
    in_features = half_in * 2
    blocksize = in_features // absmax_bits.shape[1]
    absmax = absmax_bits.view(torch.float32).reshape(-1)
    return torch.ops.bitsandbytes.dequantize_4bit.default(
        packed.reshape(-1, 1), absmax, blocksize, "nf4", [out_features, in_features], dtype
    )


# One table per device, the same tensor in every call, so that the two dequantizations of a weight in a
# checkpointed block's backward graph (the recomputed forward's and the input gradient's) are one expression,
# which the compiler computes once; a table built in each call was a graph constant of its own, and never merged.
# Copied to the device once: a host table moved there in every call was a blocking copy each time.
_NF4_TABLES: dict[torch.device, torch.Tensor] = {}


@torch.compiler.assume_constant_result  # compiled graphs take the table as it is, one input for every call
def _nf4_table(device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16 NF4 levels (fp32) on `device`, made there once."""
    table = _NF4_TABLES.get(device)
    if table is None:
        table = _NF4_TABLES[device] = _NF4_VALUES.to(device)
    return table


def dequantize_nf4_torch(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same function in plain torch ops (bit-identical: a table lookup, then one fp32 multiply per weight),
    for compiled blocks: the compiler fuses it into a single kernel, where bitsandbytes' op is opaque."""
    packed, absmax_bits = packed.view(torch.uint8), absmax_bits.view(torch.int32)  # a float carrier, if one
    out_features, half_in = packed.shape
    n_blocks = absmax_bits.shape[1]
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(out_features, n_blocks, -1)
    table = _nf4_table(packed.device)
    values = table[codes.long()] * absmax_bits.view(torch.float32).unsqueeze(-1)
    return values.view(out_features, half_in * 2).to(dtype)


def _dequantize(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return dequantize_nf4_torch(packed, absmax_bits, dtype)
    return dequantize_nf4(packed, absmax_bits, dtype)


class _NF4Matmul(torch.autograd.Function):
    """y = x W^T with W dequantized on the fly; backward dequantizes again instead of saving W, so the
    activation memory of a frozen layer is its input only. The storage saved for backward is the layer's own
    (sharded or FSDP-managed) tensors, not a gathered copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(packed, absmax)
        return F.linear(x, _dequantize(gathered(packed), gathered(absmax), x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            packed, absmax = ctx.saved_tensors
            grad_x = grad_out @ _dequantize(gathered(packed), gathered(absmax), grad_out.dtype)
        return grad_x, None, None


class NF4Linear(QuantizedLinear):
    """A frozen linear layer stored in NF4: packed codes and each block's absmax bits."""

    STORAGE = ("packed", "absmax")
    # Codes two to a bf16 element; scales (fp32 bits kept as int32) as the fp32 values they are.
    CARRIERS = {"packed": torch.bfloat16, "absmax": torch.float32}
    BITS = (4,)
    EXPERTS = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        blocksize: int,
        bias_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        if in_features % blocksize:
            raise ValueError(f"in_features {in_features} is not a multiple of the NF4 blocksize {blocksize}")
        storage = {"packed": (in_features // 2, torch.uint8), "absmax": (in_features // blocksize, torch.int32)}
        super().__init__(in_features, out_features, bias, storage, bias_dtype=bias_dtype, device=device)
        self.blocksize = blocksize

    @classmethod
    def can_quantize(cls, in_features: int, quant: QuantConfig) -> bool:
        return in_features % quant.blocksize == 0

    @classmethod
    def from_config(cls, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                    bias_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> NF4Linear:
        return cls(in_features, out_features, bias, quant.blocksize, bias_dtype=bias_dtype, device=device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, absmax = quantize_nf4(weight, self.blocksize)
        return {"packed": packed, "absmax": absmax}

    def dequantize(self, storage: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return _dequantize(*storage, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offloaded is None:
            y = _NF4Matmul.apply(x, self.packed, self.absmax)
        else:  # saving the host tensors would be free, but backward must fetch them again anyway
            y = RefetchingMatmul.apply(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        bits = 4 + 32 / self.blocksize
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, blocksize={self.blocksize} ({bits:.2f} bits/weight)"
        )
