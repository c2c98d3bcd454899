"""qshard's NF4 dequantization kernel (quant/nf4_triton.py): the same weights as the plain-torch and bitsandbytes
paths. On the CPU the kernel runs in Triton's interpreter (in a child process: the interpreter is chosen when
Triton is imported); on a GPU, natively, compiled and eager, against bitsandbytes' kernel bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.utils import run_and_get_code

triton = pytest.importorskip("triton")

from conftest import cli_env  # noqa: E402

from qshard.quant import nf4_triton  # noqa: E402
from qshard.quant.nf4 import (  # noqa: E402
    NF4DoubleQuantLinear,
    NF4Linear,
    _dequantize_bnb,
    _dequantize_torch,
    _nf4_table,
    compress_absmax,
    expand_absmax,
    quantize_nf4,
)

# Shapes whose byte counts are not multiples of the kernel's 1,024 bytes a program (the last program is partly
# masked), with several blocksizes (scales per row) and a single row. The interpreter rounds to bf16 its own way
# (not to nearest even), so bf16 is checked on a GPU only.
_INTERPRETED = textwrap.dedent("""
    import torch
    from qshard.quant import nf4_triton
    from qshard.quant.nf4 import _dequantize_torch, _nf4_table, quantize_nf4
    torch.manual_seed(0)
    table = _nf4_table(torch.device("cpu"))
    for (rows, cols, blocksize) in [(3, 128, 64), (37, 320, 64), (5, 2048, 128), (1, 4096, 256), (16, 64, 64)]:
        packed, absmax = quantize_nf4(torch.randn(rows, cols) * 3, blocksize)
        absmax = absmax.view(torch.float32)
        for dtype in (torch.float32, torch.float16):
            got = nf4_triton._launch(nf4_triton._dequantize_kernel, packed, absmax, table, dtype)
            want = _dequantize_torch(packed, absmax, dtype)
            assert got.shape == want.shape == (rows, cols), (got.shape, want.shape)
            assert got.dtype == dtype
            assert torch.equal(got, want), (rows, cols, blocksize, dtype, (got.float() - want.float()).abs().max())
            # The same weights with a LoRA B factor's columns after each row's (a width that fills its block of the
            # kernel, and one that does not).
            for width in (8, 5):
                extra = torch.randn(rows, width).to(dtype)
                got = nf4_triton._launch_beside(nf4_triton._dequantize_beside_kernel, packed, absmax, table, extra)
                assert got.shape == (rows, cols + width) and got.dtype == dtype, got.shape
                assert torch.equal(got, torch.cat([want, extra], dim=1)), (rows, cols, blocksize, dtype, width)
    print("KERNEL OK")
""")


def test_kernel_matches_the_torch_path_in_triton_interpreter():
    env = dict(cli_env(), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KERNEL OK" in result.stdout


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _stores(kernel, signature: dict, constexprs: dict, aligned: tuple[int, ...]) -> dict[str, int]:
    """The global stores of `kernel` compiled for an H100/H200 (sm_90) by kind, counted in its PTX, with the arguments
    at the indices `aligned` taken as multiples of 16, as Triton specializes them when they are. No GPU needed; skipped
    where this Triton compiles ahead of time through other internals than 3.9's (they are not a stable interface)."""
    if not nf4_triton.AVAILABLE or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs Triton's compiler")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                           attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": nf4_triton._WARPS})
        ptx = compiled.asm["ptx"]
    except (ImportError, TypeError, AttributeError, KeyError) as e:
        pytest.skip(f"this Triton compiles ahead of time another way: {type(e).__name__}: {e}")
    kinds = re.findall(r"\b(st\.global[.\w]*)", ptx)
    return {kind: kinds.count(kind) for kind in set(kinds)}


@pytest.mark.parametrize("rank", [8, 64])
def test_the_widened_weight_is_stored_sixteen_bytes_at_a_time(rank):
    """The widened kernel writes its weights 16 bytes a store, as the plain one does, for rows of 4,096 + rank bf16
    values: 4,160 at rank 64 is a multiple of 16, which Triton sees; 4,104 at rank 8 is not, and without
    `ROWS_ALIGNED` the stores were one value each (2.7x slower for the plain kernel on an H200). The only 2-byte
    store left is the B factor's copy."""
    signature = {"packed_ptr": "*u8", "absmax_ptr": "*fp32", "table_ptr": "*fp32", "extra_ptr": "*bf16",
                 "out_ptr": "*bf16", "bytes_per_row": "i32", "scales_per_row": "i32", "extra_width": "i32",
                 "out_width": "i32", "BYTES_PER_SCALE": "constexpr", "BLOCK": "constexpr", "EXTRA_BLOCK": "constexpr",
                 "ROWS_ALIGNED": "constexpr"}
    # 4,096 inputs at blocksize 64: 2,048 bytes and 64 scales a row, the pointers and both counts multiples of 16.
    aligned = (0, 1, 2, 3, 4, 5, 6) + ((7, 8) if rank % 16 == 0 else ())
    constexprs = {"BYTES_PER_SCALE": 32, "BLOCK": nf4_triton._BYTES_PER_PROGRAM, "EXTRA_BLOCK": rank,
                  "ROWS_ALIGNED": (4096 + rank) % 8 == 0}
    stores = _stores(nf4_triton._dequantize_beside_kernel, signature, constexprs, aligned)
    assert stores.pop("st.global.v4.b32", 0) >= 2 and set(stores) <= {"st.global.b16"}, stores
    assert stores.get("st.global.b16", 0) <= 1, stores


@_GPU
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
        codes, row_max = compress_absmax(absmax_bits, -(-absmax.shape[1] // 2) * 2)
        expanded = expand_absmax(codes, row_max, absmax.shape[1])
        assert torch.equal(nf4_triton.dequantize(packed, expanded, table, dtype),
                           _dequantize_torch(packed, expanded, dtype))


@_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_beside_a_factor_match_bitsandbytes_on_a_gpu(dtype):
    """The widened weight a LoRA layer's base and B factor share (`dequantize_beside`): bitsandbytes' weights, then
    the factor's columns, bit for bit; a Llama-3-8B block's shapes with rank 64, and shapes whose rows end in a
    partly masked run of the kernel."""
    torch.manual_seed(0)
    table = _nf4_table(torch.device("cuda"))
    for rows, cols, blocksize, rank in [(4096, 4096, 64, 64), (14336, 4096, 64, 64), (4096, 14336, 64, 64),
                                        (37, 320, 64, 8), (5, 2048, 128, 5)]:
        packed, absmax_bits = quantize_nf4(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), blocksize)
        absmax = absmax_bits.view(torch.float32)
        extra = torch.randn(rows, rank, device="cuda").to(dtype)
        got = nf4_triton.dequantize_beside(packed, absmax, table, extra)
        assert torch.equal(got, torch.cat([_dequantize_bnb(packed, absmax, dtype), extra], dim=1)), (rows, cols)


@_GPU
@pytest.mark.parametrize("layer_class", [NF4Linear, NF4DoubleQuantLinear])
def test_compiled_layers_dequantize_through_the_kernel_as_eager_ones_do(layer_class):
    """`NF4Linear.dequantize` inside a compiled graph (the kernel, for 16-bit outputs) against the same outside one
    (bitsandbytes), with the storage as FSDP2 may hand it over: float carriers of its bytes."""
    torch._dynamo.reset()
    layer = layer_class(4096, 1000, False, 64, device="cuda")
    layer.set_weight(torch.randn(1000, 4096, device="cuda"))
    storage = tuple(getattr(layer, name) for name in layer.STORAGE)
    carriers = tuple(t.view(layer.CARRIERS[name]) for name, t in zip(layer.STORAGE, storage))
    compiled = torch.compile(lambda s, dtype: layer.dequantize(s, dtype) * 1, fullgraph=True)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = layer.dequantize(storage, dtype)
        # The kernel is what runs for 16-bit outputs (the plain-torch expression would give the same bits); fp32
        # keeps the expression.
        got, code = run_and_get_code(compiled, carriers, dtype)
        assert ("_dequantize_kernel" in "\n".join(code)) == (dtype != torch.float32), dtype
        assert torch.equal(got, want), dtype
        assert torch.equal(compiled(storage, dtype), want), dtype


@_GPU
def test_a_compiled_lora_layer_joined_with_its_base_runs_the_widened_kernel_and_trains_as_eager():
    """A LoRA layer on an NF4 base in a traced checkpoint, compiled: its B factor joins the base's matmul through the
    widened weight the kernel writes (`_dequantize_beside_kernel` in the generated code), and output and gradients
    are the eager separate matmuls' within bf16 rounding."""
    from qshard.adapters import LoRALinear

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = NF4Linear(4096, 1024, False, 64, device="cuda")
    base.set_weight(torch.randn(1024, 4096, device="cuda"))
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    results = []
    for joined in (False, True):
        lora = LoRALinear(base, 4096, 1024, 64, 16.0, 0.0).cuda()
        # The same factors in both forms.
        lora.lora_A.data.copy_(torch.randn(64, 4096, generator=torch.Generator().manual_seed(1)) / 64)
        lora.lora_B.data.copy_(torch.randn(1024, 64, generator=torch.Generator().manual_seed(2)))
        inputs = x.clone().requires_grad_()
        if joined:
            base.in_traced_checkpoint()
            lora.join_base()
            y, code = run_and_get_code(torch.compile(lora, fullgraph=True), inputs)
            assert "_dequantize_beside_kernel" in "\n".join(code)
        else:
            y = lora(inputs)
        y.backward(grad)
        results.append([y.detach(), inputs.grad, lora.lora_A.grad, lora.lora_B.grad])
    torch._dynamo.reset()
    for separate, joined in zip(*results):
        torch.testing.assert_close(joined.float(), separate.float(), rtol=2e-2, atol=2e-2 * separate.abs().max().item())


@_GPU
def test_kernel_writes_the_last_rows_past_two_to_the_thirty_bytes():
    """A weight of over 2^30 packed bytes (a fused MoE layer's size): its last rows are written and right."""
    rows, half_in, blocks = 2**19 + 2, 2048, 64  # 2^30 + 4,096 bytes
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (rows, half_in), dtype=torch.uint8, device="cuda", generator=gen)
    absmax = torch.rand(rows, blocks, device="cuda", generator=gen) + 0.5
    got = nf4_triton.dequantize(packed, absmax, _nf4_table(packed.device), torch.bfloat16)
    assert torch.equal(got[-3:], _dequantize_bnb(packed[-3:], absmax[-3:], torch.bfloat16))
    assert torch.equal(got[:2], _dequantize_bnb(packed[:2], absmax[:2], torch.bfloat16))
