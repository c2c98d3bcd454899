"""qshard's NF4 dequantization kernel (quant/nf4_triton.py): the same weights as the plain-torch and bitsandbytes
paths. On the CPU the kernel runs in Triton's interpreter (in a child process: the interpreter is chosen when
Triton is imported); on a GPU, natively, compiled and eager, against bitsandbytes' kernel bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from qshard.quant import nf4_triton  # noqa: E402
from qshard.quant.nf4 import (  # noqa: E402
    _dequantize_bnb,
    _dequantize_torch,
    _nf4_table,
    compress_absmax,
    expand_absmax,
    quantize_nf4,
)

# Shapes whose byte counts are not multiples of the kernel's 1,024 bytes a program (the last program is partly
# masked), with several blocksizes (scales per row) and a single row.
_INTERPRETED = textwrap.dedent("""
    import torch
    from qshard.quant import nf4_triton
    from qshard.quant.nf4 import _dequantize_torch, _NF4_VALUES, quantize_nf4
    torch.manual_seed(0)
    table = _NF4_VALUES.float()
    for (rows, cols, blocksize) in [(3, 128, 64), (37, 320, 64), (5, 2048, 128), (1, 4096, 256), (16, 64, 64)]:
        packed, absmax = quantize_nf4(torch.randn(rows, cols) * 3, blocksize)
        absmax = absmax.view(torch.float32)
        for dtype in (torch.float32, torch.float16):
            got = nf4_triton._launch(nf4_triton._dequantize_kernel, packed, absmax, table, dtype)
            want = _dequantize_torch(packed, absmax, dtype)
            assert got.shape == want.shape == (rows, cols), (got.shape, want.shape)
            assert got.dtype == dtype
            assert torch.equal(got, want), (rows, cols, blocksize, dtype, (got.float() - want.float()).abs().max())
    print("KERNEL OK")
""")


def test_kernel_matches_the_torch_path_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KERNEL OK" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_bitsandbytes_on_a_gpu(dtype):
    torch.manual_seed(0)
    table = _nf4_table(torch.device("cuda"))
    for rows, cols, blocksize in [(4096, 4096, 64), (1024, 4096, 64), (4096, 14336, 64), (37, 320, 64),
                                  (5, 2048, 128)]:
        packed, absmax_bits = quantize_nf4(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), blocksize)
        absmax = absmax_bits.view(torch.float32)
        want = _dequantize_bnb(packed, absmax, dtype)
        assert torch.equal(nf4_triton.dequantize(packed, absmax, table, dtype), want)
        # A float carrier of the bytes, as FSDP2 may hand them over, and double-quantized scales.
        assert torch.equal(nf4_triton.dequantize(packed.view(torch.bfloat16).view(torch.uint8), absmax, table, dtype),
                           want)
        codes, row_max = compress_absmax(absmax_bits, -(-absmax.shape[1] // 2) * 2)
        expanded = expand_absmax(codes, row_max, absmax.shape[1])
        assert torch.equal(nf4_triton.dequantize(packed, expanded, table, dtype),
                           _dequantize_torch(packed, expanded, dtype))

        compiled = torch.compile(lambda p, a: nf4_triton.dequantize(p, a, _nf4_table(p.device), dtype) * 1,
                                 fullgraph=True)
        assert torch.equal(compiled(packed, absmax), want)
