"""benchmarks/lora_kernels.py's forms of a block's adapters on the CPU, at tiny shapes: each computes the outputs and
gradients of the separate form (the benchmark's timings compare like with like)."""

from __future__ import annotations

import lora_kernels  # benchmarks/, on the path (conftest.py)
import pytest
import torch

SHAPES = {"q": (32, 32, "attn"), "k": (32, 8, "attn"), "o": (32, 32, "o"), "up": (32, 64, "mlp"),
          "down": (64, 32, "down")}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_every_form_computes_the_separate_adapters(backend):
    block = lora_kernels.make_block(SHAPES, rank=4, device="cpu")
    inputs = lora_kernels.make_inputs(SHAPES, tokens=16, device="cpu")
    params = [t for _, a, b in block.values() for t in (a, b)]
    out_grads = lora_kernels.output_grads(SHAPES, tokens=16, device="cpu")
    try:
        forms, _ = lora_kernels.forms(SHAPES, block, inputs, scaling=2.0, backend=backend)
        (outs, grads), *others = [lora_kernels.results(form, inputs, params, out_grads) for form in forms.values()]
    finally:
        torch._dynamo.reset()
    assert len(others) == 3 and len(grads) == len(inputs) + len(params)
    for other_outs, other_grads in others:
        for got, want in zip(other_outs + other_grads, outs + grads, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_the_counting_pass_groups_the_shared_input_factors():
    """What the benchmark prints as "groups made" for the grouped forms: here q and k share their input (one group);
    up's input has no other adapter."""
    from torch._dynamo.backends.debugging import aot_eager

    block = lora_kernels.make_block(SHAPES, rank=4, device="cpu")
    inputs = lora_kernels.make_inputs(SHAPES, tokens=16, device="cpu")
    counting = lora_kernels.CountingPass()

    def grouping(gm, example_inputs):
        counting(gm.graph)
        gm.recompile()
        return aot_eager(gm, example_inputs)

    expected = lora_kernels.separate(SHAPES, block, inputs, 2.0)
    try:
        got = torch.compile(lora_kernels.separate, backend=grouping)(SHAPES, block, inputs, 2.0)
    finally:
        torch._dynamo.reset()
    assert counting.made == 1
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, want)
