"""One transformer block's seven LoRA linears side by side, on a GPU: the forms a block's adapters can take, forward +
backward of all seven at a Llama-3-8B block's shapes (hidden 4,096, 1,024 for k/v, MLP 14,336; LoRA r=64) over
`--tokens` tokens, compiled as blocks are. The base weights are given dense in bf16 (the NF4 dequantization that
produces them is the same in every form and left out); the outputs' gradients are fixed random tensors, so no loss
is timed. Prints per form the groups the pre-grad pass made, the median ms per block over rounds interleaved across
the forms, the peak memory above the inputs, and the largest difference from the first form's outputs and gradients.

- separate: each adapter as LoRALinear computes it, base(x) + B (A x) scaled;
- A grouped: the same code compiled with qshard's pre-grad pass (parallel/grouped_matmuls.py), which concatenates
  the A factors of q/k/v and of gate/up: what compiled blocks run;
- B folded: the adapter's B joins the base matmul along its contraction, y = [x, s A x] [W, B]^T, so forward runs one
  matmul for base and B, and backward one for the input's gradient and A x's (`FoldedB`); the widened weight is
  built by a copy of W each step (what it costs without a dequantization kernel that writes into it);
- B folded, weight prebuilt: the same with [W, B] given, as if the dequantization wrote W into it: the bound of the
  gain.
Both B-folded forms are compiled with the pre-grad pass too: compare them with "A grouped". The pass runs only where
inductor compiles the graph anew (a cache hit loads it), so run this with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1.

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python3 benchmarks/lora_kernels.py [--tokens 2048 8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from qshard.parallel.compile import INDUCTOR_OPTIONS
from qshard.parallel.grouped_matmuls import GroupSharedInputLinears, group_shared_input_linears

# name: (in, out, which input); a block's q/k/v read the attention's normed input, gate/up the MLP's.
LLAMA3_8B = {"q": (4096, 4096, "attn"), "k": (4096, 1024, "attn"), "v": (4096, 1024, "attn"),
             "o": (4096, 4096, "o"), "gate": (4096, 14336, "mlp"), "up": (4096, 14336, "mlp"),
             "down": (14336, 4096, "down")}


class FoldedB(torch.autograd.Function):
    """y = [x, low] [W, B]^T for a frozen W: forward one matmul; backward one for the gradients of x and low together,
    and B's own from low. `wide` is [W, B] prebuilt, or None to build it here."""

    @staticmethod
    def forward(ctx, x, low, weight, b, wide):
        if wide is None:
            wide = torch.cat([weight, b], dim=1)
        ctx.save_for_backward(low, wide)
        return F.linear(torch.cat([x, low], dim=-1), wide)

    @staticmethod
    def backward(ctx, grad):
        low, wide = ctx.saved_tensors
        both = grad @ wide
        cut = wide.shape[1] - low.shape[-1]
        grad_b = grad.reshape(-1, grad.shape[-1]).t() @ low.reshape(-1, low.shape[-1])
        return both[..., :cut], both[..., cut:], None, grad_b, None


def make_block(shapes: dict, rank: int, device: str, seed: int = 0) -> dict:
    """Per linear: the frozen base weight (bf16), A and B (fp32 masters, B non-zero so A has a gradient), and [W, B]
    prebuilt in bf16."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = {}
    for name, (n_in, n_out, _) in shapes.items():
        weight = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(device, torch.bfloat16)
        a = (torch.randn(rank, n_in, generator=g) / n_in**0.5).to(device).requires_grad_()
        b = (torch.randn(n_out, rank, generator=g) * 0.05).to(device).requires_grad_()
        block[name] = (weight, a, b)
    return block


def make_inputs(shapes: dict, tokens: int, device: str, seed: int = 1) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    widths = {source: n_in for n_in, _, source in shapes.values()}
    return {source: torch.randn(tokens, width, generator=g).to(device, torch.bfloat16).requires_grad_()
            for source, width in widths.items()}


def separate(shapes, block, inputs, scaling):
    outs = []
    for name, (_, _, source) in shapes.items():
        weight, a, b = block[name]
        x = inputs[source]
        outs.append(F.linear(x, weight) + F.linear(F.linear(x, a.to(x.dtype)), (b * scaling).to(x.dtype)))
    return outs


def folded(shapes, block, inputs, scaling, prebuilt=None):
    outs = []
    for name, (_, _, source) in shapes.items():
        weight, a, b = block[name]
        x = inputs[source]
        low = F.linear(x, a.to(x.dtype))
        b16 = (b * scaling).to(x.dtype)
        wide = None if prebuilt is None else prebuilt[name]
        outs.append(FoldedB.apply(x, low, weight, b16, wide))
    return outs


def prebuild(shapes, block, scaling) -> dict:
    """[W, B] per linear, written once (B's values of now; for timing, what a dequantization kernel would write)."""
    with torch.no_grad():
        return {name: torch.cat([w, (b * scaling).to(w.dtype)], dim=1) for name, (w, _, b) in block.items()}


def output_grads(shapes, tokens: int, device: str, seed: int = 2) -> list[torch.Tensor]:
    """Fixed random gradients for the seven outputs, as the rest of a block would send back (no loss is computed, so
    the timings hold only the adapters' own work)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(tokens, n_out, generator=g).to(device, torch.bfloat16) for _, n_out, _ in shapes.values()]


def step(form, inputs, params, grads):
    for t in (*inputs.values(), *params):
        t.grad = None
    torch.autograd.backward(form(), grads)


def results(form, inputs, params, grads):
    step(form, inputs, params, grads)
    outs = [o.detach().float() for o in form()]
    return outs, [t.grad.float() for t in (*inputs.values(), *params)]


class CountingPass(GroupSharedInputLinears):
    """qshard's pre-grad pass, counting the groups it made (the benchmark prints them: a form said to be grouped that
    grouped nothing would time the separate form twice)."""

    made = 0

    def __call__(self, graph) -> None:
        self.made += group_shared_input_linears(graph)


def forms(shapes, block, inputs, scaling, backend: str) -> tuple[dict, CountingPass]:
    """The forms to compare, each a no-argument callable returning the seven outputs, and the pre-grad pass the
    grouped forms compile with."""
    counting = CountingPass()

    def compiled(fn, grouped: bool):
        if backend == "eager":
            return fn
        options = None
        if backend == "inductor":
            options = {k: v for k, v in INDUCTOR_OPTIONS.items() if k != "pre_grad_custom_pass"}
            if grouped:
                options["pre_grad_custom_pass"] = counting
        return torch.compile(fn, backend=backend, options=options, dynamic=False)  # static, as padded training runs

    wide = prebuild(shapes, block, scaling)
    return {
        "separate": functools.partial(compiled(separate, False), shapes, block, inputs, scaling),
        "A grouped": functools.partial(compiled(separate, True), shapes, block, inputs, scaling),
        "B folded": functools.partial(compiled(folded, True), shapes, block, inputs, scaling),
        "B folded, weight prebuilt": functools.partial(compiled(folded, True), shapes, block, inputs, scaling, wide),
    }, counting


def measure(fn, iters: int) -> tuple[float, float]:
    """(ms per call, peak memory above what was allocated before, GiB)."""
    from dequant_kernels import time_ms  # benchmarks/, on the path when run as a script

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(fn, iters)
    return ms, (torch.cuda.max_memory_allocated() - before) / 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="timings interleaved over the forms; the median is printed")
    p.add_argument("--backend", default="inductor", help="inductor (as blocks run), aot_eager or eager")
    args = p.parse_args()
    scaling = args.alpha / args.rank
    block = make_block(LLAMA3_8B, args.rank, "cuda")
    params = [t for _, a, b in block.values() for t in (a, b)]
    print("| tokens | form | groups made | forward + backward ms (one block, median) | all rounds | peak GiB "
          "| output diff | gradient diff (relative) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        torch._dynamo.reset()  # each size its own static graphs
        inputs = make_inputs(LLAMA3_8B, tokens, "cuda")
        grads = output_grads(LLAMA3_8B, tokens, "cuda")
        named, counting = forms(LLAMA3_8B, block, inputs, scaling, args.backend)
        rows, reference = {}, None
        for name, form in named.items():  # compiles each form, and checks it against the first
            before = counting.made
            outs, got = results(form, inputs, params, grads)
            reference = reference or (outs, got)
            out_diff = max((o - r).abs().max().item() for o, r in zip(outs, reference[0], strict=True))
            grad_diff = max(((g - r).norm() / r.norm()).item() for g, r in zip(got, reference[1], strict=True))
            del outs, got
            rows[name] = {"groups": counting.made - before, "diff": (out_diff, grad_diff), "ms": [], "peak": 0.0}
        for _ in range(args.rounds):
            for name, form in named.items():
                ms, peak = measure(functools.partial(step, form, inputs, params, grads), args.iters)
                rows[name]["ms"].append(ms)
                rows[name]["peak"] = max(rows[name]["peak"], peak)
        for name, row in rows.items():
            ms = sorted(row["ms"])
            spread = " ".join(f"{m:.3f}" for m in row["ms"])
            print(f"| {tokens:,} | {name} | {row['groups']} | {ms[len(ms) // 2]:.3f} | {spread} | {row['peak']:.2f} "
                  f"| {row['diff'][0]:.3g} | {row['diff'][1]:.2e} |", flush=True)


if __name__ == "__main__":
    main()
