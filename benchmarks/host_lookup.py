"""The host work of model.embedding_on_host per micro-batch, timed: the row lookup (HostEmbedding.lookup), its
copy into pinned memory and the copy to the GPU, for a Llama-3-8B-sized table (128,256 x 4,096 bf16) by default.

  python3 benchmarks/host_lookup.py [--tokens 3072] [--vocab 128256] [--hidden 4096] [--threads 1,4,16]

Each line: torch's intra-op threads, then the milliseconds of the lookup, of pin_memory (from torch's caching
pinned allocator after the first call), and of the non-blocking copy to the GPU waited for (without a GPU, none).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn


def timed(fn, n: int = 50) -> float:
    """Milliseconds per call of `fn`, after warm-up calls."""
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--threads", default="1,4,16")
    a = p.parse_args()
    embed = nn.Embedding(a.vocab, a.hidden, dtype=torch.bfloat16)
    ids = torch.randint(0, a.vocab, (1, a.tokens))
    cuda = torch.cuda.is_available()
    with torch.no_grad():
        rows = embed(ids)
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            line = f"threads {threads:3d}: lookup {timed(lambda: embed(ids).to(torch.bfloat16)):6.2f} ms"
            if cuda:
                pinned = rows.pin_memory()
                line += f", pin_memory {timed(rows.pin_memory):6.2f} ms"

                def to_gpu(pinned=pinned):
                    pinned.to("cuda", non_blocking=True)
                    torch.cuda.synchronize()

                line += f", to the GPU {timed(to_gpu):6.2f} ms"
            print(line)


if __name__ == "__main__":
    main()
