"""HQQ (half-quadratic quantization, Badri & Shaji 2023): a frozen linear layer at 4, 3 or 2 bits with
integer-only storage, quantized without calibration data.

Each row is cut into groups of `group_size` consecutive weights. A group maps its weights w to codes
q = clamp(round(w / s + z), 0, 2^bits - 1) and back to (q - z) * s. The scale s is min-max's,
(max - min) / (2^bits - 1); the zero z is then refined by HQQ's half-quadratic solver, which lowers the
l_p norm (p < 1) of the rounding error. An l_p objective with p < 1 lets a few outliers keep large
errors so that the bulk of the group is rounded better than min-max rounding manages, which matters
most at 3 and 2 bits.

Storage, all integer so that FSDP2 neither casts nor rounds it (see nf4.py for why): the codes packed
into uint8, 8 codes in `bits` bytes (2 per byte at 4 bits, 4 per byte at 2 bits, 8 in 3 bytes at 3 bits),
and each group's fp16 scale and fp16 zero as the two halves of one int32. That is bits + 32/group_size
bits per weight: 4.5, 3.5 and 2.5 at group_size 64. Dim 0 is the output row and groups never straddle
rows, so FSDP2's dim-0 shards hold whole groups with their scales and zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qshard.config import QuantConfig
from qshard.quant.linear import QuantizedLinear

BITS = (4, 3, 2)
# The solver's settings: HQQ's published defaults (p = 0.7, beta 10 growing by 1% per iteration, 20 rounds).
LP_NORM, BETA, KAPPA, ITERS = 0.7, 10.0, 1.01, 20
# Rows quantized at once: bounds the solver's fp32 temporaries (a few copies of the chunk) on large layers.
_CHUNK_ELEMENTS = 1 << 24


# ---------------------------------------------------------------------------------------------------------------
# Packing codes into bytes.


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [rows, n] (n a multiple of 8) -> uint8 [rows, n * bits / 8]."""
    rows, n = codes.shape
    if 8 % bits == 0:  # whole codes per byte, lowest code in the lowest bits
        per_byte = 8 // bits
        lanes = codes.view(rows, n // per_byte, per_byte)
        packed = lanes[..., 0].clone()
        for i in range(1, per_byte):
            packed |= lanes[..., i] << (bits * i)
        return packed
    # 3 bits: 8 codes make a 24-bit word, stored as 3 bytes (int32 holds it without touching the sign bit).
    lanes = codes.view(rows, n // 8, 8).to(torch.int32)
    word = torch.zeros(rows, n // 8, dtype=torch.int32, device=codes.device)
    for i in range(8):
        word |= lanes[..., i] << (bits * i)
    parts = [((word >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(bits)]
    return torch.stack(parts, dim=-1).view(rows, n * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 [rows, m] -> uint8 codes [rows, m * 8 / bits]."""
    rows, m = packed.shape
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        lanes = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
        return torch.stack(lanes, dim=-1).view(rows, m * 8 // bits)
    parts = packed.view(rows, m // bits, bits).to(torch.int32)
    word = parts[..., 0] | (parts[..., 1] << 8) | (parts[..., 2] << 16)
    lanes = [((word >> (bits * i)) & mask).to(torch.uint8) for i in range(8)]
    return torch.stack(lanes, dim=-1).view(rows, m * 8 // bits)


# ---------------------------------------------------------------------------------------------------------------
# Quantization.


def _to_fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """fp16 values no smaller than `x` (positive): a scale rounded down would stretch the group past the
    last code and clamp its extreme weights."""
    half = x.to(torch.float16)
    low = half.float() < x
    return torch.where(low, (half.view(torch.int16) + 1).view(torch.float16), half)


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    # The generalized soft-threshold HQQ uses as the l_p proximal step: small errors go to zero, large ones
    # (outliers) are kept almost whole. At x = 0 the threshold is infinite and the result 0, as it should be.
    return torch.sign(x) * F.relu(x.abs() - x.abs().pow(p - 1) / beta)


def _lp_error(u: torch.Tensor, q: torch.Tensor, z: torch.Tensor, p: float) -> torch.Tensor:
    return (u - (q - z)).abs().pow(p).mean(dim=-1, keepdim=True)


def _quantize_groups(w: torch.Tensor, bits: int, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [groups, group_size] fp32 -> (codes uint8, scale fp16 [groups, 1], zero fp16 [groups, 1])."""
    qmax = (1 << bits) - 1
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    absmax = torch.maximum(low.abs(), high.abs())
    # Floors: a constant group would get scale 0; one far from zero with a tiny range would get a zero
    # too large for fp16. 2^-12 of its magnitude keeps |zero| <= 4096 at a relative error below 2^-12.
    scale = torch.maximum((high - low) / qmax, absmax * 2.0**-12).clamp_min(2.0**-24)
    scale16 = _to_fp16_at_least(scale)
    s = scale16.float()
    u = w / s  # the weights in code units: the solver works there, so its l_p threshold is scale-free
    z = (-low / s).to(torch.float16).float()
    q = (u + z).round().clamp(0, qmax)
    best_z, best_err = z, _lp_error(u, q, z, LP_NORM)
    beta = BETA
    for _ in range(iters):
        # Half-quadratic splitting: an l_p step on the error, then the zero that best explains it (a mean),
        # then the codes for that zero. The zero is rounded to fp16 each time, so what is scored is stored.
        err = _shrink_lp(u - q + z, beta, LP_NORM)
        z = (q - u + err).mean(dim=-1, keepdim=True).to(torch.float16).float()
        q = (u + z).round().clamp(0, qmax)
        beta *= KAPPA
        # Per group, keep the best zero seen (min-max's included): the iteration is not monotone.
        current = _lp_error(u, q, z, LP_NORM)
        better = current < best_err
        best_z, best_err = torch.where(better, z, best_z), torch.where(better, current, best_err)
    codes = (u + best_z).round().clamp(0, qmax).to(torch.uint8)
    return codes, scale16, best_z.to(torch.float16)


def quantize_hqq(
    weight: torch.Tensor, bits: int, group_size: int, iters: int = ITERS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight on its device; return (packed uint8 [out, in * bits / 8], scale_zero int32
    [out, in / group_size]). `iters=0` is plain min-max round-to-nearest (the solver's starting point)."""
    assert bits in BITS and weight.shape[1] % group_size == 0 and group_size % 8 == 0, "caller checks"
    out_features, in_features = weight.shape
    n_groups = in_features // group_size
    chunk_rows = max(1, _CHUNK_ELEMENTS // in_features)
    packed, scale_zero = [], []
    for rows in torch.split(weight, chunk_rows):
        codes, scale, zero = _quantize_groups(rows.float().reshape(-1, group_size), bits, iters)
        packed.append(pack_codes(codes.view(rows.shape[0], in_features), bits))
        # Scale in the low half of each int32, zero in the high half (little-endian view of the pair).
        pair = torch.cat([scale, zero], dim=-1).contiguous().view(torch.int32)
        scale_zero.append(pair.view(rows.shape[0], n_groups))
    return torch.cat(packed), torch.cat(scale_zero)


def split_scale_zero(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [out, groups] -> (scale, zero) fp32 [out, groups]."""
    pair = scale_zero.contiguous().view(torch.float16).view(*scale_zero.shape, 2).float()
    return pair[..., 0], pair[..., 1]


def dequantize_hqq(packed: torch.Tensor, scale_zero: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_hqq`, on any block of whole rows; computed in fp32, returned in `dtype`."""
    packed, scale_zero = packed.view(torch.uint8), scale_zero.view(torch.int32)  # a float carrier, if one
    out_features, n_groups = scale_zero.shape
    codes = unpack_codes(packed, bits).view(out_features, n_groups, -1).float()
    scale, zero = split_scale_zero(scale_zero)
    return ((codes - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).view(out_features, -1).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# The layer.


class HQQLinear(QuantizedLinear):
    """A frozen linear layer stored in HQQ: packed codes and each group's fp16 scale and zero."""

    STORAGE = ("packed", "scale_zero")
    # Codes in bf16 elements of two bytes; each scale-and-zero pair as one fp32 element.
    CARRIERS = {"packed": torch.bfloat16, "scale_zero": torch.float32}
    BITS = BITS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group_size: int,
        bias_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        if bits not in BITS:
            raise ValueError(f"HQQ bits must be one of {BITS}, got {bits}")
        if in_features % group_size or group_size % 8:
            raise ValueError(f"in_features {in_features} is not a multiple of the HQQ group size {group_size}")
        storage = {"packed": (in_features * bits // 8, torch.uint8),
                   "scale_zero": (in_features // group_size, torch.int32)}
        super().__init__(in_features, out_features, bias, storage, bias_dtype=bias_dtype, device=device)
        self.bits, self.group_size = bits, group_size

    @classmethod
    def can_quantize(cls, in_features: int, quant: QuantConfig) -> bool:
        return in_features % quant.blocksize == 0

    @classmethod
    def from_config(cls, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                    bias_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> HQQLinear:
        return cls(in_features, out_features, bias, quant.bits, quant.blocksize, bias_dtype=bias_dtype, device=device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scale_zero = quantize_hqq(weight, self.bits, self.group_size)
        return {"packed": packed, "scale_zero": scale_zero}

    def dequantize(self, storage: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_hqq(*storage, self.bits, dtype)

    def extra_repr(self) -> str:
        bits = self.bits + 32 / self.group_size
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"bits={self.bits}, group_size={self.group_size} ({bits:.2f} bits/weight)"
        )
