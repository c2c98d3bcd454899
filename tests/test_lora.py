"""LoRA math: the adapter adds (alpha/r) B A x to the frozen base, starts as the identity, trains A and B."""

import torch
import torch.nn.functional as F

from qshard.adapters import LoRALinear


def make(rank=4, alpha=8.0, dropout=0.0):
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 16).requires_grad_(False)
    lora = LoRALinear(base, 32, 16, rank, alpha, dropout)
    a, b = lora.init_adapter(torch.Generator().manual_seed(1))
    lora.lora_A.data.copy_(a)
    lora.lora_B.data.copy_(b)
    return base, lora


def test_starts_as_the_base_function():
    base, lora = make()
    x = torch.randn(2, 7, 32)
    assert torch.equal(lora(x), base(x))
    assert torch.count_nonzero(lora.lora_A) == lora.lora_A.numel()


def test_output_is_base_plus_scaled_low_rank_update():
    base, lora = make(rank=4, alpha=8.0)
    lora.lora_B.data.normal_()
    x = torch.randn(5, 32)
    expected = base(x) + 2.0 * (x @ lora.lora_A.T @ lora.lora_B.T)
    torch.testing.assert_close(lora(x), expected)


def test_gradients_reach_only_the_adapter():
    base, lora = make()
    lora.lora_B.data.normal_()
    x = torch.randn(4, 32)
    lora(x).square().sum().backward()
    assert base.weight.grad is None
    a, b, s = lora.lora_A, lora.lora_B, lora.scaling
    # d/dB of sum((base + s B A x)^2) = 2 s (y) (A x)^T, summed over the batch
    y = lora(x).detach()
    torch.testing.assert_close(b.grad, 2 * s * y.T @ (x @ a.detach().T))
    assert a.grad is not None and a.grad.abs().sum() > 0


def test_init_is_deterministic_and_kaiming_bounded():
    _, l1 = make()
    _, l2 = make()
    assert torch.equal(l1.lora_A, l2.lora_A)
    assert l1.lora_A.abs().max() <= 1 / 32**0.5
    assert torch.count_nonzero(l1.lora_B) == 0


def test_dropout_applies_to_adapter_input_only():
    base, lora = make(dropout=0.5)
    lora.lora_B.data.normal_()
    lora.eval()
    x = torch.randn(3, 32)
    torch.testing.assert_close(lora(x), base(x) + lora.scaling * F.linear(F.linear(x, lora.lora_A), lora.lora_B))
    lora.train()
    torch.manual_seed(3)
    assert not torch.allclose(lora(x), lora(x))


def test_b_joined_with_an_nf4_base_computes_and_trains_as_the_separate_matmuls():
    """In a traced checkpoint an NF4 base computes its matmul and the adapter's B factor as one inside the compiled
    graph (`join_base`, quant/nf4.py `_NF4MatmulBesideLowRank`): the same output and the same gradients of the input,
    A and B as the two matmuls and their sum, with a bias and a batch of sequences; only fp32 sums in another order
    apart (both compiled: the graph runs as traced, no code generated). Called eagerly (samples generated beside the
    compiled blocks), the joined layer runs the two matmuls: the same bits as the separate layer's."""
    from qshard.quant import NF4Linear

    torch.manual_seed(0)
    base = NF4Linear(128, 48, True, 64)
    base.set_weight(torch.randn(48, 128))
    with torch.no_grad():
        base.bias.copy_(torch.randn(48))
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(3))
    results, eager = [], []
    for joined in (False, True):
        lora = LoRALinear(base, 128, 48, 8, 16.0, 0.0)
        lora.lora_A.data.copy_(torch.randn(8, 128, generator=torch.Generator().manual_seed(1)))
        lora.lora_B.data.copy_(torch.randn(48, 8, generator=torch.Generator().manual_seed(2)))
        if joined:
            base.in_traced_checkpoint()
            lora.join_base()
        assert lora.joined_with_base is joined
        with torch.no_grad():
            eager.append(lora(x))
        inputs = x.clone().requires_grad_()
        graphs = []

        def keeping(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        try:
            y = torch.compile(lora, backend=keeping, fullgraph=True)(inputs)
        finally:
            torch._dynamo.reset()
        # Compiled, the joined layer concatenates the input and A x for its one matmul; the separate one has no cat.
        code = "\n".join(m.code for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        assert ("torch.cat" in code) is joined, code
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
        results.append([y.detach(), inputs.grad, lora.lora_A.grad, lora.lora_B.grad])
    assert torch.equal(eager[0], eager[1])
    for separate, joined in zip(*results):
        assert separate.shape == joined.shape
        torch.testing.assert_close(joined, separate, rtol=1e-5, atol=1e-5 * separate.abs().max().item())


def test_only_plain_lora_on_a_base_that_can_joins_it():
    """`join_base` joins where the base says it can (an NF4 layer told it is in a traced checkpoint) and the rank is a
    multiple of 8 (the widened weight's rows 16 bytes apart); not on a dense base, nor an NF4 one outside a traced
    checkpoint, nor for DoRA, which scales its base's output its own way."""
    from qshard.adapters import DoRALinear
    from qshard.quant import NF4Linear

    traced_base = NF4Linear(64, 16, False, 64)
    traced_base.in_traced_checkpoint()
    layers = {
        "dense": LoRALinear(torch.nn.Linear(64, 16), 64, 16, 8, 8.0, 0.0),
        "outside": LoRALinear(NF4Linear(64, 16, False, 64), 64, 16, 8, 8.0, 0.0),
        "inside": LoRALinear(traced_base, 64, 16, 8, 8.0, 0.0),
        "inside, rank 12": LoRALinear(traced_base, 64, 16, 12, 8.0, 0.0),
        "dora": DoRALinear(traced_base, 64, 16, 8, 8.0, 0.0),
    }
    for layer in layers.values():
        layer.join_base()
    assert {name for name, layer in layers.items() if layer.joined_with_base} == {"inside"}
