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
