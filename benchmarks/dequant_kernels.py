"""NF4 dequantization kernels side by side, on a GPU: one Llama-3-8B block's seven weights (218M) dequantized to
bf16 by bitsandbytes' op, by the compiler's kernel for qshard's plain-torch expression (as compiled blocks ran it
before), and by qshard's Triton kernel (quant/nf4_triton.py) called from a compiled graph as blocks call it; each
checked bit for bit against bitsandbytes', beside a bf16 fill of the same size (the device's write rate, the bound
of a dequantization).

    python3 benchmarks/dequant_kernels.py [--iters 30]
"""

from __future__ import annotations

import argparse

import torch

from qshard.quant import nf4_triton
from qshard.quant.nf4 import _dequantize_bnb, _dequantize_torch, _nf4_table, quantize_nf4

# q, k, v, o, gate, up, down of Llama-3-8B: (out_features, in_features).
BLOCK_SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def time_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = []
    for rows, cols in BLOCK_SHAPES:
        packed, absmax = quantize_nf4(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), 64)
        weights.append((packed, absmax.view(torch.float32)))
    n = sum(rows * cols for rows, cols in BLOCK_SHAPES)
    table = _nf4_table(torch.device("cuda"))
    want = [_dequantize_bnb(p, a, torch.bfloat16) for p, a in weights]

    def compiled_torch_path(ws):
        return [_dequantize_torch(p, a, torch.bfloat16) for p, a in ws]

    def triton_kernel_path(ws):
        return [nf4_triton.dequantize(p, a, table, torch.bfloat16) for p, a in ws]

    inductor = torch.compile(compiled_torch_path, options={"combo_kernels": True})
    kernel = torch.compile(triton_kernel_path)
    paths = {
        "bitsandbytes op": lambda: [_dequantize_bnb(p, a, torch.bfloat16) for p, a in weights],
        "compiled torch expression": lambda: inductor(weights),
        "qshard Triton kernel, compiled graph": lambda: kernel(weights),
    }
    fill = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    print(f"{torch.cuda.get_device_name()}: one Llama-3-8B block, {n / 1e6:.0f}M weights, NF4 -> bf16")
    print("| path | ms | TB/s moved (2.5 B/weight) | equal to bitsandbytes |")
    print("| --- | --- | --- | --- |")
    for name, fn in paths.items():
        equal = all(torch.equal(x, y) for x, y in zip(fn(), want))
        ms = time_ms(fn, args.iters)
        print(f"| {name} | {ms:.4f} | {n * 2.5 / ms / 1e9:.2f} | {equal} |")
    ms = time_ms(lambda: fill.fill_(1.0), args.iters)
    print(f"| bf16 fill (writes 2 B/weight) | {ms:.4f} | {n * 2 / ms / 1e9:.2f} | - |")


if __name__ == "__main__":
    main()
