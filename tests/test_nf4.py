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


# Double quantization (quant.double_quant): each block's absmax as a byte under its row's largest.


def test_double_quant_absmax_within_its_level_and_the_row_max_exact():
    from qshard.quant.nf4 import ABSMAX_ZERO_CODE, compress_absmax, expand_absmax

    g = torch.Generator().manual_seed(0)
    # Rows of blocks whose absmax spans a few octaves, a row with an all-zero block, one with a block far below
    # the smallest level (2^-15.9 of the row's largest), and an all-zero row.
    weight = torch.randn(6, 1024, generator=g) * torch.rand(6, 16, 1, generator=g).repeat_interleave(64, 1).view(6, -1)
    weight[1, 64:128] = 0
    weight[2, :64] *= 1e-6
    block = weight[2, 64:128]
    weight[2, 64:128] = block / block.abs().max() * weight[2, 128:].abs().max() * 1.2e-5  # between the two
    weight[3] = 0
    weight[4] *= 1e-39  # a subnormal row
    _, absmax_bits = quantize_nf4(weight, 64)
    codes, row_max = compress_absmax(absmax_bits, 16)
    assert codes.dtype == torch.uint8 and codes.shape == (6, 16) and row_max.shape == (6, 1)
    absmax = absmax_bits.view(torch.float32)
    decoded = expand_absmax(codes, row_max, 16)
    largest = absmax.amax(1)
    # The row's largest absmax is kept exactly, and its block decodes to it.
    assert torch.equal(row_max.view(torch.float32).squeeze(1), largest)
    assert torch.equal(decoded.amax(1), largest)
    # Within 2^(1/32) of the absmax, where the absmax is within the levels' range; below it, the smallest level,
    # and zero below half of that; zero blocks are code 255.
    in_range = absmax >= largest[:, None] * 2.0 ** (-254 / 16)
    ratio = decoded[in_range & (absmax > 0)] / absmax[in_range & (absmax > 0)]
    assert (ratio - 1).abs().max() <= 2 ** (1 / 32) - 1 + 1e-6
    assert ratio.sub(1).abs().max() > 0.01  # not exact: the test would pass for a format that stored fp32
    assert codes[2, 0] == ABSMAX_ZERO_CODE and decoded[2, 0] == 0  # 1e-6 of the row: below half the smallest level
    assert 2.0 ** (-254 / 16) / 2 < absmax[2, 1] / largest[2] < 2.0 ** (-254 / 16) and codes[2, 1] == 254
    assert torch.equal(codes == ABSMAX_ZERO_CODE, (absmax == 0) | ~in_range & (codes != 254))
    assert (decoded[absmax == 0] == 0).all()
    # Rows of an odd number of blocks are padded with the zero code, which expanding drops.
    odd_codes, odd_max = compress_absmax(absmax_bits[:, :15], 16)
    assert odd_codes.shape == (6, 16) and (odd_codes[:, 15] == ABSMAX_ZERO_CODE).all()
    assert expand_absmax(odd_codes, odd_max, 15).shape == (6, 15)


def test_double_quant_rows_are_independent_and_the_two_dequantizations_agree():
    """Any block of rows holds its own codes and scales (FSDP2's dim-0 shards); bitsandbytes' kernel path (eager)
    and the plain-torch path (compiled blocks) give the same bits."""
    from qshard.quant.nf4 import _dequantize_bnb, _dequantize_torch

    layer = NF4Linear.from_config(256, 10, False, _quant(double_quant=True))
    assert type(layer).__name__ == "NF4DoubleQuantLinear"
    weight = torch.randn(10, 256, generator=torch.Generator().manual_seed(1))
    layer.set_weight(weight)
    storage = tuple(getattr(layer, name) for name in layer.STORAGE)
    full = layer.dequantize(storage, torch.bfloat16)
    for rows in (slice(0, 5), slice(5, 10), slice(3, 4)):
        assert torch.equal(layer.dequantize(tuple(t[rows] for t in storage), torch.bfloat16), full[rows])
    absmax = layer.block_absmax(storage[1:])
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_dequantize_torch(storage[0], absmax, dtype), _dequantize_bnb(storage[0], absmax, dtype))
    # Within NF4's own bound of the weight, with the scale's error on top.
    plain = NF4Linear(256, 10, bias=False, blocksize=64)
    plain.set_weight(weight)
    err = (layer.dequantized_weight(torch.float32) - weight).abs().view(10, -1, 64)
    scale = weight.abs().view(10, -1, 64).amax(-1, keepdim=True)
    assert (err <= 0.17 * scale * 2 ** (1 / 32) + 0.0216 * scale).all()
    # The codes are NF4's: only the scales differ from the plain layer's.
    assert torch.equal(layer.packed, plain.packed)


def test_double_quant_storage_size_and_odd_block_counts():
    layer = NF4Linear.from_config(4096, 1024, False, _quant(double_quant=True))
    params = dict(layer.named_parameters())
    assert {n: p.dtype for n, p in params.items()} == {
        "packed": torch.uint8, "absmax_codes": torch.uint8, "row_absmax": torch.int32}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    assert nbytes / (4096 * 1024 * 2) == pytest.approx((0.5 + 1 / 64 + 4 / 4096) / 2)  # 0.258 of bf16, 0.281 plain
    assert "4.13 bits/weight" in repr(layer)
    # A row's absmax codes travel two to a bf16 carrier: an odd number of blocks takes one padding code.
    odd = NF4Linear.from_config(64 * 7, 8, False, _quant(double_quant=True))
    assert NF4Linear.can_quantize(64 * 7, _quant(double_quant=True)) and odd.absmax_codes.shape == (8, 8)
    weight = torch.randn(8, 64 * 7, generator=torch.Generator().manual_seed(2))
    odd.set_weight(weight)
    plain = NF4Linear(64 * 7, 8, bias=False, blocksize=64)
    plain.set_weight(weight)
    err = (odd.dequantized_weight(torch.float32) - plain.dequantized_weight(torch.float32)).abs()
    assert (err <= 0.0219 * weight.abs().amax()).all()
    # What loading writes into a rank's rows is those rows of the whole weight's quantization.
    whole = odd.quantize(weight)
    assert all(torch.equal(odd.quantize(weight[3:7])[name], whole[name][3:7]) for name in odd.STORAGE)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ([("quant.method", "hqq"), ("quant.double_quant", "true")], "quant.double_quant: compresses NF4's"),
        ([("train.train_type", "lora"), ("quant.double_quant", "true")], "has no effect with train.train_type lora"),
    ],
)
def test_double_quant_refused_where_it_means_nothing(options, message):
    from qshard import config as config_mod
    from qshard.errors import QShardError

    with pytest.raises(QShardError, match=message):
        config_mod.resolve(None, options)


def _quant(**kwargs):
    from qshard.config import QuantConfig

    return QuantConfig(**kwargs)
