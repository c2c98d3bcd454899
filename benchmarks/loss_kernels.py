"""The head and cross-entropy of a training step side by side, on a GPU: the paths qshard's loss takes (train/loss.py)
at a Llama-3 head (4,096 wide, 128,256 words, bf16), forward + backward of the summed loss over `--tokens` trained
tokens. Prints ms, the peak memory each adds over its inputs, and each path's largest difference from the full-logits
loss and its gradient.

- full logits: the [tokens, vocabulary] logits at once, cross-entropy in fp32 (`FullLogitsLoss`'s arithmetic);
- recomputed: chunk by chunk, each chunk's logits computed again in backward (`_ChunkedHeadCE`, a head that trains);
- frozen, eager / compiled: each chunk's gradient computed in forward (`_FrozenHeadCE`, every adapter train type),
  its arithmetic eager or compiled by inductor as compiled runs do.

    python3 benchmarks/loss_kernels.py [--tokens 2047 8191] [--chunk 512] [--iters 10]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from dequant_kernels import time_ms  # benchmarks/, on the path when run as a script

from qshard.train.loss import _chunk_loss_and_gradient, _ChunkedHeadCE, _FrozenHeadCE

HIDDEN, VOCAB = 4096, 128256


def _full(states, labels, weight, chunk):
    return F.cross_entropy(F.linear(states, weight).float(), labels, reduction="sum")


def _recomputed(states, labels, weight, chunk):
    return _ChunkedHeadCE.apply(states, labels, weight, None, chunk, None, "sum")


def _frozen(chunk_fn, states, labels, weight, chunk):
    return _FrozenHeadCE.apply(states, labels, weight, None, chunk, None, "sum", chunk_fn, True)


def _step(path, states, labels, weight, chunk):
    states.grad = None
    path(states, labels, weight, chunk).backward()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2047, 8191])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(_chunk_loss_and_gradient, dynamic=True)
    paths = {"full logits": _full, "recomputed": _recomputed,
             "frozen, eager": functools.partial(_frozen, _chunk_loss_and_gradient),
             "frozen, compiled": functools.partial(_frozen, compiled)}
    print("| tokens | path | forward + backward ms | peak memory added (GiB) | loss diff | gradient diff (relative) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        states = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, VOCAB, (tokens,), device="cuda")
        reference = None
        for name, path in paths.items():
            states.grad = None
            loss = path(states, labels, weight, args.chunk)
            loss.backward()
            result = (loss.detach().float(), states.grad.float())
            reference = reference or result
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = time_ms(functools.partial(_step, path, states, labels, weight, args.chunk), args.iters)
            added = (torch.cuda.max_memory_allocated() - base) / 2**30
            loss_diff = (result[0] - reference[0]).abs().item()
            grad_diff = ((result[1] - reference[1]).norm() / reference[1].norm()).item()
            print(f"| {tokens:,} | {name} | {ms:.2f} | {added:.2f} | {loss_diff:.3g} | {grad_diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
