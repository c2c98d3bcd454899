"""NF4 dequantization as one Triton kernel, for CUDA devices where Triton is installed.

The plain-torch expression in nf4.py, fused by the compiler, computes each weight on its own: it loads the weight's
packed byte, picks one nibble, looks the level up and scales it. This kernel reads a run of packed bytes once, looks
both nibbles of each byte up, and writes the two weights side by side, so each byte, scale and index is handled once
per byte instead of once per weight; the dequantization of a block's weights is a write-bound copy, and this one
gets close to the device's write rate (docs/benchmarks.md, "NF4 dequantization kernels").

Bit-identical to the other two paths: the same fp32 level times the same fp32 scale, rounded once to the output
dtype. Registered as a Triton custom op (`torch.library.triton_op`) so that compiled blocks call the kernel inside
their graphs instead of breaking them. Compiled graphs only: called eagerly, the op's dispatch costs more host time
per call than bitsandbytes' op, which eager blocks keep. Its costs: a launch per weight (the compiler's fused kernel
was one per block), and the compiler does not merge two calls of a kernel the way it merged two equal expressions:
a block checkpointed by hooks runs it in backward for the recompute and again for the input's gradient (a block
checkpointed inside its compiled graph once, through nf4.py's `_NF4MatmulInTracedCheckpoint`).

A second kernel writes the same weights into the first columns of a wider row and a LoRA layer's scaled B factor into
the rest (`dequantize_beside`): the weight [W, sB] with which the base's matmul computes the adapter's B product too
(nf4.py, `_NF4MatmulBesideLowRank`), built by the dequantization at no extra pass over W.
"""

from __future__ import annotations

import torch

try:  # an installed but broken Triton leaves qshard on its other two paths
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:
    AVAILABLE = False

# Packed bytes per program (two weights each) and its warps: the best of those tried on an H200.
_BYTES_PER_PROGRAM = 1024
_WARPS = 4

if AVAILABLE:

    @triton.jit
    def _weight_pairs(packed_ptr, absmax_ptr, table_ptr, bytes_at, scales_at, inside, out_dtype: tl.constexpr):
        """The two weights of each packed byte at `bytes_at` (scaled by the absmax at `scales_at`), interleaved in
        the output's order and dtype."""
        byte = tl.load(packed_ptr + bytes_at, mask=inside, other=0).to(tl.int32)
        scale = tl.load(absmax_ptr + scales_at, mask=inside, other=0.0)
        high = tl.load(table_ptr + (byte >> 4)) * scale  # the first weight of the pair: bitsandbytes' order
        low = tl.load(table_ptr + (byte & 15)) * scale
        return tl.interleave(high, low).to(out_dtype)

    @triton.jit
    def _dequantize_kernel(packed_ptr, absmax_ptr, table_ptr, out_ptr, n_bytes, n_weights,
                           BYTES_PER_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n_bytes
        weights = _weight_pairs(packed_ptr, absmax_ptr, table_ptr, offsets, offsets // BYTES_PER_SCALE, inside,
                                out_ptr.dtype.element_ty)
        out = 2 * start + tl.arange(0, 2 * BLOCK)
        # The weight count comes from the host, not as `2 * n_bytes` here: Triton passes an int below 2^31 as int32,
        # and that product overflows from 2^30 bytes on. Not `(out >> 1) < n_bytes` either: the compiler cannot tell
        # that mask is constant over runs of the output, and stores one element at a time (2.7x slower on an H200).
        tl.store(out_ptr + out, weights, mask=out < n_weights)

    @triton.jit
    def _dequantize_beside_kernel(packed_ptr, absmax_ptr, table_ptr, extra_ptr, out_ptr, bytes_per_row,
                                  scales_per_row, extra_width, out_width, BYTES_PER_SCALE: tl.constexpr,
                                  BLOCK: tl.constexpr, EXTRA_BLOCK: tl.constexpr, ROWS_ALIGNED: tl.constexpr):
        """One row's run of BLOCK packed bytes per program, written into a row of `out_width` columns; the row's
        last program copies the row of `extra` after its weights instead."""
        row = tl.program_id(0).to(tl.int64)
        column_block = tl.program_id(1)
        row_start = row * out_width
        if ROWS_ALIGNED:
            # Triton assumes an integer argument aligned only where it is a multiple of 16 (4,160 for rank 64, not
            # 4,104 for rank 8): told that each row starts 16 bytes in, it stores 16 bytes at a time, not 2.
            row_start = tl.multiple_of(row_start, 8)
        out_row = out_ptr + row_start
        if column_block * BLOCK < bytes_per_row:
            columns = column_block * BLOCK + tl.arange(0, BLOCK)
            inside = columns < bytes_per_row
            weights = _weight_pairs(packed_ptr, absmax_ptr, table_ptr, row * bytes_per_row + columns,
                                    row * scales_per_row + columns // BYTES_PER_SCALE, inside,
                                    out_ptr.dtype.element_ty)
            out = 2 * column_block * BLOCK + tl.arange(0, 2 * BLOCK)
            # As above: a bound on the output's own offsets keeps the stores vectorized.
            tl.store(out_row + out, weights, mask=out < 2 * bytes_per_row)
        else:  # names of its own: Triton types a name once across both branches
            extra_columns = tl.arange(0, EXTRA_BLOCK)
            extra_inside = extra_columns < extra_width
            values = tl.load(extra_ptr + row * extra_width + extra_columns, mask=extra_inside, other=0.0)
            tl.store(out_row + 2 * bytes_per_row + extra_columns, values, mask=extra_inside)

    @torch.library.triton_op("qshard::nf4_dequantize", mutates_args=())
    def _nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
        return _launch(torch.library.wrap_triton(_dequantize_kernel), packed, absmax, table, dtype)

    @torch.library.triton_op("qshard::nf4_dequantize_beside", mutates_args=())
    def _nf4_dequantize_beside(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                               extra: torch.Tensor) -> torch.Tensor:
        return _launch_beside(torch.library.wrap_triton(_dequantize_beside_kernel), packed, absmax, table, extra)


def _checked(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor) -> tuple[int, int]:
    """The codes' [out, in / 2], once they, the scales and the table are what the kernels read."""
    out_features, half_in = packed.shape
    assert absmax.shape[0] == out_features and half_in % absmax.shape[1] == 0, (packed.shape, absmax.shape)
    assert packed.dtype == torch.uint8 and absmax.dtype == table.dtype == torch.float32 and table.numel() == 16
    return out_features, half_in


def _launch(kernel, packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Run `kernel` (the op's wrapped kernel; the bare one in Triton's interpreter, which the wrapper refuses on some
    torch versions) over every packed byte."""
    out_features, half_in = _checked(packed, absmax, table)
    out = torch.empty(out_features, 2 * half_in, dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    grid = (triton.cdiv(n_bytes, _BYTES_PER_PROGRAM),)
    kernel[grid](packed, absmax, table, out, n_bytes, 2 * n_bytes, BYTES_PER_SCALE=half_in // absmax.shape[1],
                 BLOCK=_BYTES_PER_PROGRAM, num_warps=_WARPS)
    return out


def _launch_beside(kernel, packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                   extra: torch.Tensor) -> torch.Tensor:
    """`_launch`'s weights, each row followed by the same row of `extra`: [out, in + extra's columns] in extra's
    dtype."""
    out_features, half_in = _checked(packed, absmax, table)
    assert extra.shape[0] == out_features, (packed.shape, extra.shape)
    extra_width = extra.shape[1]
    out = torch.empty(out_features, 2 * half_in + extra_width, dtype=extra.dtype, device=packed.device)
    grid = (out_features, triton.cdiv(half_in, _BYTES_PER_PROGRAM) + 1)
    kernel[grid](packed, absmax, table, extra, out, half_in, absmax.shape[1], extra_width, out.shape[1],
                 BYTES_PER_SCALE=half_in // absmax.shape[1], BLOCK=_BYTES_PER_PROGRAM,
                 EXTRA_BLOCK=triton.next_power_of_2(extra_width), ROWS_ALIGNED=out.shape[1] % 8 == 0,
                 num_warps=_WARPS)
    return out


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`packed` codes (uint8 [out, in/2]) times `absmax` (fp32 [out, blocks]), each code's level read from `table`
    (fp32 [16]), as [out, in] in `dtype`. Only where `AVAILABLE`."""
    return torch.ops.qshard.nf4_dequantize(packed.contiguous(), absmax.contiguous(), table, dtype)


def dequantize_beside(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                      extra: torch.Tensor) -> torch.Tensor:
    """`dequantize`'s [out, in] weights in `extra`'s dtype with `extra` ([out, k]) after them, [out, in + k], written
    by one kernel: the weight a LoRA layer's base matmul and its B factor share (quant/nf4.py,
    `_NF4MatmulBesideLowRank`). Only where `AVAILABLE`."""
    return torch.ops.qshard.nf4_dequantize_beside(packed.contiguous(), absmax.contiguous(), table,
                                                  extra.contiguous())
