"""HQQ: packing, the error bound at 4, 3 and 2 bits, the solver beating min-max rounding, the layer's
storage contract, and configuration checks. Training over an HQQ base: test_train_types.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qshard import config as config_mod
from qshard.errors import QShardError
from qshard.quant import HQQLinear, dequantize_hqq, quantize_hqq
from qshard.quant.hqq import pack_codes, split_scale_zero, unpack_codes


def _weight(rows=64, cols=512):
    # Gaussian weights with a few large outliers, as trained LLM weights have.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * 0.02
    spikes = torch.rand(rows, cols, generator=g) < 0.01
    return torch.where(spikes, w * 8, w)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_codes_pack_exactly_into_bits_per_weight(bits):
    codes = torch.randint(0, 2**bits, (6, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 128 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def _errors(weight, bits, group, iters):
    packed, scale_zero = quantize_hqq(weight, bits, group, iters=iters)
    err = (dequantize_hqq(packed, scale_zero, bits, torch.float32) - weight).abs().view(weight.shape[0], -1, group)
    return err, split_scale_zero(scale_zero)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_error_within_the_bound_and_below_min_max_rounding(bits):
    """Bound: with the group's min-max scale s, the zero z, and z0 = -min/s (min-max's zero), a weight whose
    code was not clamped is within half a step, s/2, of its reconstruction; a clamped one (only once z has
    moved away from z0) is off by at most |z - z0| steps. The solver trades those few clamped outliers
    for a better fit of the rest: its l_p error (what it minimizes) and its mean error beat min-max's."""
    weight, group = _weight(), 64
    err, (scale, zero) = _errors(weight, bits, group, iters=20)
    groups = weight.view(weight.shape[0], -1, group)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    z0 = -groups.amin(-1, keepdim=True) / s
    t = groups / s + z  # each weight in code units, before rounding and clamping
    clamped = (t < -0.5) | (t > 2**bits - 1 + 0.5)
    slack = 1e-5 * groups.abs().amax(-1, keepdim=True)  # fp32 rounding of the reconstruction
    assert (err[~clamped] <= (s / 2 + slack).expand_as(err)[~clamped]).all()
    assert (err <= s * torch.clamp((z - z0).abs(), min=0.5) + slack).all()
    assert (s <= (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / (2**bits - 1) * 1.001).all()

    rtn, (rtn_scale, _) = _errors(weight, bits, group, iters=0)  # plain min-max round-to-nearest
    assert torch.equal(rtn_scale, scale)
    assert (rtn <= rtn_scale.unsqueeze(-1) * 0.51).all()  # min-max: half a step (plus the fp16 zero's rounding)
    lp, lp_rtn = err.pow(0.7).mean(), rtn.pow(0.7).mean()
    assert lp < 0.97 * lp_rtn, (float(lp), float(lp_rtn))
    assert err.mean() < 0.97 * rtn.mean(), (float(err.mean()), float(rtn.mean()))


def test_row_blocks_quantize_and_dequantize_on_their_own():
    """What FSDP2's dim-0 shards and the loader (which quantizes only a rank's rows) rely on."""
    weight = _weight(10, 128)
    packed, scale_zero = quantize_hqq(weight, 3, 64)
    for rows in (slice(0, 5), slice(5, 10), slice(3, 4)):
        part_packed, part_scale_zero = quantize_hqq(weight[rows], 3, 64)
        assert torch.equal(part_packed, packed[rows]) and torch.equal(part_scale_zero, scale_zero[rows])
        torch.testing.assert_close(
            dequantize_hqq(packed[rows], scale_zero[rows], 3, torch.float32),
            dequantize_hqq(packed, scale_zero, 3, torch.float32)[rows],
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_layer_storage_is_integer_and_forward_backward_match_dense(bits):
    layer = HQQLinear(256, 64, bias=True, bits=bits, group_size=64, bias_dtype=torch.float32)
    params = dict(layer.named_parameters())
    storage = {n: p for n, p in params.items() if n != "bias"}
    assert {n: p.dtype for n, p in storage.items()} == {"packed": torch.uint8, "scale_zero": torch.int32}
    nbytes = sum(p.numel() * p.element_size() for p in storage.values())
    assert nbytes * 8 / (256 * 64) == bits + 32 / 64  # bits per weight, fp16 scale and zero included

    dense = torch.nn.Linear(256, 64)
    layer.set_weight(dense.weight.detach())
    layer.bias.data.copy_(dense.bias.detach())
    w = layer.dequantized_weight(torch.float32)
    x = torch.randn(3, 256, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, w, dense.bias.detach()))
    grad = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(gx, grad @ w)
    assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ([("quant.bits", "3")], "quant.bits: nf4 is a 4-bit format, got 3; for 3 or 2 bits use quant.method hqq"),
        ([("quant.method", "hqq"), ("train.train_type", "lora")], "use train.train_type qlora (LoRA) or qdora"),
        ([("quant.method", "hqq"), ("train.train_type", "dora")], "which train.train_type dora keeps unquantized"),
        ([("quant.method", "hqq"), ("quant.bits", "5")], "quant.bits must be one of 4, 3, 2"),
    ],
)
def test_incompatible_options_are_refused(options, message):
    with pytest.raises(QShardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_mod.resolve(None, options)


def test_hqq_refuses_fused_moe_experts(tiny_models, dist_env):
    from qshard.build import build_model

    cfg = config_mod.resolve(None, [("quant.method", "hqq")])
    with pytest.raises(QShardError, match="quant.method hqq does not quantize yet; use quant.method nf4"):
        build_model(cfg, dist_env, tiny_models("mixtral"))
