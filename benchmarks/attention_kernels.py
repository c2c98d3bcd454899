"""Causal attention kernels side by side, on a GPU: PyTorch's scaled_dot_product_attention through each of its fused
backends (flash, cuDNN, memory-efficient), forward alone and forward + backward, at the head layout of a Llama-3-8B
block as the model calls it (32 query heads of 128, the key/value heads repeated to match, batch 1, bf16). Prints
ms and the TFLOP/s they reach (causal: half the score matrix; backward 2.5 forwards) and each backend's largest
difference from the output of the first that ran (flash, where the device has it). Which backend a training step
runs is SDPA's own choice for its inputs.

    python3 benchmarks/attention_kernels.py [--seqs 2048 8192 131072]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from dequant_kernels import time_ms  # benchmarks/, on the path when run as a script
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 32, 128
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def _forward(q, k, v) -> None:  # as a training forward calls it: with autograd recording
    F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _both(q, k, v, grad) -> None:
    q.grad = k.grad = v.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 131072])
    args = p.parse_args()
    torch.manual_seed(0)
    print("| tokens | backend | forward ms | TFLOP/s | forward + backward ms | TFLOP/s | max diff from the first |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seqs:
        q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        forward_flops = 4 * seq * seq / 2 * HEAD_DIM * HEADS
        iters = 20 if seq <= 8192 else 3
        first = None
        for backend in BACKENDS:
            with sdpa_kernel([backend]):
                try:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                except RuntimeError as e:  # a backend this device or build lacks
                    print(f"| {seq:,} | {backend.name} | - | - | - | - | {str(e)[:80]} |")
                    continue
                fwd = time_ms(functools.partial(_forward, q, k, v), iters) / 1e3
                fwd_bwd = time_ms(functools.partial(_both, q, k, v, grad), iters) / 1e3
            diff = 0.0 if first is None else (out.float() - first).abs().max().item()
            first = out.float() if first is None else first
            print(f"| {seq:,} | {backend.name} | {fwd * 1e3:.3f} | {forward_flops / fwd / 1e12:.0f} | "
                  f"{fwd_bwd * 1e3:.3f} | {3.5 * forward_flops / fwd_bwd / 1e12:.0f} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
