"""The NF4 linear against bitsandbytes' reference (de)quantization, and its storage contract."""

import pytest
import torch
import torch.nn.functional as F
from bitsandbytes import functional as bnbf

from qshard.quant import NF4Linear, dequantize_nf4, quantize_nf4


def reference(weight: torch.Tensor, blocksize: int, dtype=torch.bfloat16) -> torch.Tensor:
    packed, state = bnbf.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
    state.dtype = dtype
    return bnbf.dequantize_4bit(packed, state)


@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_matches_bitsandbytes(blocksize, src_dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 256, dtype=src_dtype)
    packed, absmax = quantize_nf4(weight, blocksize)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 128)
    assert absmax.dtype == torch.int32 and absmax.shape == (96, 256 // blocksize)
    ours = dequantize_nf4(packed, absmax, torch.bfloat16)
    assert torch.equal(ours, reference(weight, blocksize))
    # NF4 error is bounded by half the largest gap between code points times the block's absmax.
    err = (ours.float() - weight.float()).abs().view(96, -1, blocksize)
    scale = weight.float().abs().view(96, -1, blocksize).amax(-1, keepdim=True)
    assert (err <= 0.17 * scale + 1e-2).all()


def test_absmax_bits_are_exact_fp32():
    weight = torch.randn(8, 64) * 3.3
    _, absmax = quantize_nf4(weight, 64)
    assert torch.equal(absmax.view(torch.float32).squeeze(1), weight.abs().amax(1))


def test_row_slices_dequantize_independently():
    """What FSDP2's dim-0 sharding relies on: any block of rows holds its own codes and scales."""
    weight = torch.randn(10, 128)
    packed, absmax = quantize_nf4(weight, 64)
    full = dequantize_nf4(packed, absmax, torch.float32)
    for rows in (slice(0, 5), slice(5, 10), slice(3, 4)):
        assert torch.equal(dequantize_nf4(packed[rows], absmax[rows], torch.float32), full[rows])


def test_linear_forward_backward_match_dense():
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64, bias=True)
    layer = NF4Linear(128, 64, bias=True, blocksize=64, bias_dtype=torch.float32)
    layer.set_weight(dense.weight.detach())
    layer.bias.data.copy_(dense.bias.detach())
    w = layer.dequantized_weight(torch.float32)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    expected = F.linear(x, w, dense.bias.detach())
    torch.testing.assert_close(y, expected)
    grad = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(gx, grad @ w)
    assert not any(p.requires_grad for p in layer.parameters())


def test_storage_is_integer_and_quarter_size():
    layer = NF4Linear(4096, 1024, bias=False, blocksize=64)
    params = dict(layer.named_parameters())
    assert {n: p.dtype.is_floating_point for n, p in params.items()} == {"packed": False, "absmax": False}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    bf16 = 4096 * 1024 * 2
    assert nbytes / bf16 == pytest.approx((0.5 + 4 / 64) / 2)  # 0.28 of bf16


def test_rejects_unaligned_width():
    with pytest.raises(ValueError, match="blocksize"):
        NF4Linear(100, 64, bias=False, blocksize=64)
