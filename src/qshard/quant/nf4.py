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

Double quantization (`quant.double_quant`, `NF4DoubleQuantLinear`): each block's absmax kept as one byte, a
step on a geometric scale below its row's largest absmax, which is kept as fp32 bits. Per weight that is
4 + 8/blocksize bits plus 32 bits per row (4.13 at blocksize 64 and 4,096 inputs) instead of 4 + 32/blocksize
(4.5): 8% less memory and PCIe traffic for the base, at a scale error of at most 2.2% per block (for blocks
down to 2^-15.9 of the row's largest). Rows stay independent (one row's codes and scales depend on that row only).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from qshard.config import QuantConfig
from qshard.quant import nf4_triton
from qshard.quant.linear import QuantizedLinear, gathered
from qshard.quant.matmul import RefetchingMatmul


@functools.cache
def _bitsandbytes() -> types.ModuleType:
    """bitsandbytes' functional module (importing it registers its ops), imported where first used rather than with
    qshard: its import takes time every process paid at start, those that never quantize or dequantize a weight
    too (`qshard plan`, whose probes run on meta tensors, and the launcher)."""
    from bitsandbytes import functional

    return functional


def quantize_nf4(weight: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight on its device; return (packed uint8 [out, in/2], absmax bits int32 [out, in/bs])."""
    out_features, in_features = weight.shape
    assert in_features % blocksize == 0, "caller checks quantizability"
    packed, state = _bitsandbytes().quantize_4bit(weight.contiguous(), blocksize=blocksize, quant_type="nf4")
    absmax = state.absmax.to(torch.float32).view(torch.int32)
    return packed.view(out_features, in_features // 2), absmax.view(out_features, in_features // blocksize)


def dequantize_nf4(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_nf4`: bitsandbytes' kernel (CUDA) or its CPU path, called through its op directly
    (its Python wrapper builds a QuantState and validates it on every call: CPU time in every forward)."""
    return _dequantize_bnb(packed, absmax_bits.view(torch.int32).view(torch.float32), dtype)


def _dequantize_bnb(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`packed` codes times `absmax` (fp32 [out, blocks]) through bitsandbytes' op."""
    packed = packed.view(torch.uint8)  # a float carrier, if one
    out_features, half_in = packed.shape
    in_features = half_in * 2
    blocksize = in_features // absmax.shape[1]
    _bitsandbytes()  # its op registered
    return torch.ops.bitsandbytes.dequantize_4bit.default(
        packed.reshape(-1, 1), absmax.reshape(-1), blocksize, "nf4", [out_features, in_features], dtype
    )


# Double quantization: code c of a block's absmax stands for 2^(-c / 16) times its row's largest absmax (c = 0
# for the largest itself, exact); code 255 for zero. A geometric scale, so each of the 255 levels is within
# 2^(1/32) (2.2%) of any absmax it is nearest to, down to 2^-15.9 of the row's largest; a smaller absmax takes
# the smallest level, or zero below half of it (an absolute error under 2^-15.9 of the row's largest either way).
ABSMAX_STEPS_PER_OCTAVE = 16
ABSMAX_ZERO_CODE = 255
_ABSMAX_LEVELS = torch.cat([
    torch.exp2(-torch.arange(ABSMAX_ZERO_CODE, dtype=torch.float64) / ABSMAX_STEPS_PER_OCTAVE).float(),
    torch.zeros(1),
])

# One table of each kind per device, the same tensor in every call, so that two dequantizations of a weight in a
# backward graph (the recomputed forward's and the input gradient's, where the storage is what was saved) are one
# expression, which the compiler computes once where the expression runs (see `_dequantize`); a table built in each
# call was a graph constant of its own, and never merged. Copied to the device once: a host table moved there in
# every call was a blocking copy each time.
# One function per table: the compiler names a constant result after its function, and refuses two of a name.
_NF4_TABLES: dict[torch.device, torch.Tensor] = {}
_ABSMAX_TABLES: dict[torch.device, torch.Tensor] = {}


def _on_device(tables: dict[torch.device, torch.Tensor], values: torch.Tensor, device: torch.device) -> torch.Tensor:
    table = tables.get(device)
    if table is None:
        table = tables[device] = values.to(device)
    return table


@torch.compiler.assume_constant_result  # compiled graphs take the table as it is, one input for every call
def _nf4_table(device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16 NF4 levels (fp32) on `device`, made there once."""
    return _on_device(_NF4_TABLES, _nf4_values(), device)


@functools.cache
def _nf4_values() -> torch.Tensor:
    return _bitsandbytes().get_4bit_type("nf4", device="cpu")


@torch.compiler.assume_constant_result
def _absmax_table(device: torch.device) -> torch.Tensor:
    """The 256 levels of a double-quantized absmax (fp32, fractions of the row's largest) on `device`."""
    return _on_device(_ABSMAX_TABLES, _ABSMAX_LEVELS, device)


def compress_absmax(absmax_bits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' absmax (fp32 bits, int32 [out, blocks]) -> (their codes, uint8 [out, width], padded with the zero
    code to `width` columns; each row's largest absmax, fp32 bits int32 [out, 1]): the nearest level on the
    geometric scale, by the ratio's logarithm."""
    # Non-finite weights are not checked here (a wait for the device at every layer): loading refuses them once it
    # has read every tensor (loading/read_ahead.py).
    absmax = absmax_bits.view(torch.float32)
    row_max = absmax.amax(dim=1, keepdim=True)
    ratio = absmax.double() / torch.where(row_max > 0, row_max, 1).double()
    steps = (-torch.log2(ratio) * ABSMAX_STEPS_PER_OCTAVE).round().clamp(0, ABSMAX_ZERO_CODE - 1)
    smallest = float(_ABSMAX_LEVELS[ABSMAX_ZERO_CODE - 1])
    codes = torch.where(ratio >= smallest / 2, steps, float(ABSMAX_ZERO_CODE)).to(torch.uint8)
    codes = F.pad(codes, (0, width - codes.shape[1]), value=ABSMAX_ZERO_CODE)
    return codes, row_max.contiguous().view(torch.int32)


def expand_absmax(codes: torch.Tensor, row_max_bits: torch.Tensor, blocks: int) -> torch.Tensor:
    """Inverse of `compress_absmax`: the first `blocks` absmax of each row, fp32 [out, blocks]. A table lookup
    and one fp32 multiply, so eager and compiled blocks get the same bits."""
    codes, row_max_bits = codes.view(torch.uint8)[:, :blocks], row_max_bits.view(torch.int32)  # float carriers
    return _absmax_table(codes.device)[codes.long()] * row_max_bits.view(torch.float32)


def dequantize_nf4_torch(packed: torch.Tensor, absmax_bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same function in plain torch ops (bit-identical: a table lookup, then one fp32 multiply per weight),
    for compiled blocks: the compiler fuses it into a single kernel, where bitsandbytes' op is opaque."""
    return _dequantize_torch(packed, absmax_bits.view(torch.int32).view(torch.float32), dtype)


def _dequantize_torch(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    packed = packed.view(torch.uint8)  # a float carrier, if one
    out_features, half_in = packed.shape
    n_blocks = absmax.shape[1]
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(out_features, n_blocks, -1)
    values = _nf4_table(packed.device)[codes.long()] * absmax.unsqueeze(-1)
    return values.view(out_features, half_in * 2).to(dtype)


def _dequantize(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`packed` codes times `absmax` (fp32 [out, blocks]), all three ways bit-identical: inside a compiled graph,
    qshard's Triton kernel on CUDA for 16-bit outputs (nf4_triton.py) or else plain torch ops, which the compiler
    fuses into one kernel; outside one, bitsandbytes' op. Meta tensors (the planner's probes) only need the shape."""
    if packed.is_meta:
        return torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=dtype, device="meta")
    if torch.compiler.is_compiling():
        # fp32 (DoRA's weight norm) stays an expression the compiler can fuse into the norm's reduction.
        if nf4_triton.AVAILABLE and packed.is_cuda and dtype != torch.float32:
            return nf4_triton.dequantize(packed.view(torch.uint8), absmax, _nf4_table(packed.device), dtype)
        return _dequantize_torch(packed, absmax, dtype)
    return _dequantize_bnb(packed, absmax, dtype)


def _dequantize_beside(packed: torch.Tensor, absmax: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """`_dequantize`'s weight in `extra`'s dtype with `extra`'s columns after its own: one kernel where the Triton
    one runs, else a concatenation."""
    dtype = extra.dtype
    if packed.is_meta:
        return torch.empty(packed.shape[0], packed.shape[1] * 2 + extra.shape[1], dtype=dtype, device="meta")
    if torch.compiler.is_compiling() and nf4_triton.AVAILABLE and packed.is_cuda and dtype != torch.float32:
        return nf4_triton.dequantize_beside(packed.view(torch.uint8), absmax, _nf4_table(packed.device), extra)
    return torch.cat([_dequantize(packed, absmax, dtype), extra], dim=1)


class _NF4Matmul(torch.autograd.Function):
    """y = x W^T with W dequantized on the fly; backward dequantizes again instead of saving W, so the
    activation memory of a frozen layer is its input only. The storage saved for backward is the layer's own
    (sharded or FSDP-managed) tensors, not a gathered copy: the codes, the block scales and, double-quantized,
    the rows' scales (else None). A fixed list of arguments: the compiler does not trace variadic ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear, packed: torch.Tensor, scales: torch.Tensor,
                row_scales: torch.Tensor | None) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(packed, scales, row_scales)
        return F.linear(x, layer.dequantize(_gathered_storage(packed, scales, row_scales), x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            storage = _gathered_storage(*ctx.saved_tensors)  # unpacked once: checkpointing allows no more
            grad_x = grad_out @ ctx.layer.dequantize(storage, grad_out.dtype)
        return grad_x, None, None, None, None


class _NF4MatmulInTracedCheckpoint(torch.autograd.Function):
    """`_NF4Matmul` for a layer of a block whose checkpoint is traced into its compiled graph
    (`NF4Linear.in_traced_checkpoint`): it saves the dense weight for backward. The traced checkpoint keeps no
    output of any op it does not have to (parallel/checkpointing.py), so the weight is not kept from forward to
    backward: the backward graph dequantizes it once, and the recomputed forward and the input's gradient both use
    that. Saving the storage instead dequantized it twice in backward, since the compiler merges two equal
    expressions but not two calls of the dequantization kernel (quant/nf4_triton.py). Its cost: the dense weights
    the recompute reads live on in backward until their input gradients (gate's and up's with kept projections, else
    all but down's: 0.29 GiB at the 8B defaults' peak; under a LoRA layer, widened by its B factor,
    `_NF4MatmulBesideLowRank`, the same on that promise). Outside such a checkpoint, or if the checkpoint's policy kept
    the dequantization's output (parallel/checkpointing.py), this would keep every layer's dense weight from forward
    to backward: only layers inside one are switched to it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4Linear, packed: torch.Tensor, scales: torch.Tensor,
                row_scales: torch.Tensor | None) -> torch.Tensor:
        weight = layer.dequantize(_gathered_storage(packed, scales, row_scales), x.dtype)
        ctx.save_for_backward(weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            (weight,) = ctx.saved_tensors
            grad_x = grad_out @ weight.to(grad_out.dtype)
        return grad_x, None, None, None, None


class _NF4MatmulBesideLowRank(torch.autograd.Function):
    """A LoRA layer's base matmul and its B factor as one matmul, for a layer of a block whose checkpoint is traced
    into its compiled graph: x W^T + low B^T = [x, low] [W, B]^T, `low` the adapter's A x (scaled B given).
    Forward runs one matmul where it ran two and an add; backward one, grad [W, B], for the gradients of x and low
    together, where it ran two and read the output's gradient twice. B's own gradient is grad^T low, as before.
    The widened weight [W, B] is written by the dequantization itself (quant/nf4_triton.py, `dequantize_beside`) and
    saved for backward as `_NF4MatmulInTracedCheckpoint` saves W, on the same promise: the traced checkpoint
    recomputes it in backward instead of keeping it (parallel/checkpointing.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, low: torch.Tensor, b: torch.Tensor, layer: NF4Linear, packed: torch.Tensor,
                scales: torch.Tensor, row_scales: torch.Tensor | None) -> torch.Tensor:
        storage = _gathered_storage(packed, scales, row_scales)
        wide = _dequantize_beside(storage[0], layer.block_absmax(storage[1:]), b)
        ctx.save_for_backward(wide, low)
        return F.linear(torch.cat([x, low], dim=-1), wide)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        wide, low = ctx.saved_tensors
        grad_x = grad_low = grad_b = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            both = grad_out @ wide
            cut = wide.shape[1] - low.shape[-1]
            grad_x, grad_low = both[..., :cut], both[..., cut:]
        if ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).t() @ low.reshape(-1, low.shape[-1])
        return grad_x, grad_low, grad_b, None, None, None, None


def _gathered_storage(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return tuple(gathered(t) for t in tensors if t is not None)


class NF4Linear(QuantizedLinear):
    """A frozen linear layer stored in NF4: packed codes and each block's absmax bits."""

    STORAGE = ("packed", "absmax")
    # Codes two to a bf16 element; scales (fp32 bits kept as int32) as the fp32 values they are.
    CARRIERS = {"packed": torch.bfloat16, "absmax": torch.float32}
    BITS = (4,)
    EXPERTS = True
    # The matmul's autograd function; `in_traced_checkpoint` switches a layer to the one that saves the weight.
    _matmul = _NF4Matmul

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
        storage = {"packed": (in_features // 2, torch.uint8), **self.scale_storage(in_features // blocksize)}
        super().__init__(in_features, out_features, bias, storage, bias_dtype=bias_dtype, device=device)
        self.blocksize = blocksize

    @staticmethod
    def scale_storage(blocks: int) -> dict[str, tuple[int, torch.dtype]]:
        """The storage of a row's `blocks` scales after its codes: name -> (row width, integer dtype)."""
        return {"absmax": (blocks, torch.int32)}

    @classmethod
    def can_quantize(cls, in_features: int, quant: QuantConfig) -> bool:
        return in_features % quant.blocksize == 0

    @classmethod
    def from_config(cls, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                    bias_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> NF4Linear:
        layer = NF4DoubleQuantLinear if quant.double_quantized() else cls
        return layer(in_features, out_features, bias, quant.blocksize, bias_dtype=bias_dtype, device=device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, absmax = quantize_nf4(weight, self.blocksize)
        return {"packed": packed, "absmax": absmax}

    def block_absmax(self, storage: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Each block's absmax, fp32 [out, blocks], from the storage after the codes."""
        (absmax_bits,) = storage
        return absmax_bits.view(torch.int32).view(torch.float32)

    def dequantize(self, storage: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return _dequantize(storage[0], self.block_absmax(storage[1:]), dtype)

    def _storage_arguments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The storage as the matmuls' autograd functions take it: codes, scales, the rows' scales or None."""
        packed, scales, *row_scales = (getattr(self, name) for name in self.STORAGE)
        return packed, scales, row_scales[0] if row_scales else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offloaded is None:
            y = self._matmul.apply(x, self, *self._storage_arguments())
        else:  # saving the host tensors would be free, but backward must fetch them again anyway
            y = RefetchingMatmul.apply(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def in_traced_checkpoint(self) -> None:
        self._matmul = _NF4MatmulInTracedCheckpoint
        self.joins_low_rank = True

    def forward_beside_low_rank(self, x: torch.Tensor, low: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`forward(x) + F.linear(low, b)` as one matmul (`_NF4MatmulBesideLowRank`) inside the compiled graph:
        what a LoRA layer on this one computes, `low` its A x and `b` its scaled B in x's dtype. Called eagerly (the
        samples a run generates and a preference pair's shared prompt, with the compiled blocks set aside), the two
        matmuls: there no kernel writes the widened weight, and building it would copy the whole dense weight once
        more per call."""
        if not torch.compiler.is_compiling():
            return self(x) + F.linear(low, b)
        y = _NF4MatmulBesideLowRank.apply(x, low, b, self, *self._storage_arguments())
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def bits_per_weight(self) -> float:
        return 4 + 32 / self.blocksize

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, blocksize={self.blocksize} ({self.bits_per_weight():.2f} bits/weight)"
        )


class NF4DoubleQuantLinear(NF4Linear):
    """NF4 with its absmax double-quantized (`quant.double_quant`): packed codes, each block's absmax as a byte
    (`compress_absmax`), and each row's largest absmax as fp32 bits."""

    STORAGE = ("packed", "absmax_codes", "row_absmax")
    # Absmax codes two to a bf16 element (a row of an odd number of blocks has one zero code more), the row's
    # absmax as fp32.
    CARRIERS = {"packed": torch.bfloat16, "absmax_codes": torch.bfloat16, "row_absmax": torch.float32}

    @staticmethod
    def scale_storage(blocks: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"absmax_codes": (_codes_width(blocks), torch.uint8), "row_absmax": (1, torch.int32)}

    # From the layer's shape, not its tensors: they may be held as carriers or moved to the host.
    @property
    def blocks(self) -> int:
        return self.in_features // self.blocksize

    @property
    def codes_width(self) -> int:
        return _codes_width(self.blocks)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, absmax = quantize_nf4(weight, self.blocksize)
        codes, row_max = compress_absmax(absmax, self.codes_width)
        return {"packed": packed, "absmax_codes": codes, "row_absmax": row_max}

    def block_absmax(self, storage: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return expand_absmax(*storage, self.blocks)

    def bits_per_weight(self) -> float:
        return 4 + (8 * self.codes_width + 32) / self.in_features


def _codes_width(blocks: int) -> int:
    """A row's absmax codes, padded to an even count (two to a bf16 carrier)."""
    return -(-blocks // 2) * 2
