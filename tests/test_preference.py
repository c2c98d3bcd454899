"""Preference tuning: each method's loss and gradient against its paper's formula written out here, the options'
range checks, the reference as the base with adapters off, preference data, and training runs."""

from __future__ import annotations

import math

import pytest
import torch

from qshard.config import Config
from qshard.train import preference as pref


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _logps(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Policy and reference per-sequence log-probs; mean ones as a per-token average (always below 0).
    pc, pr, rc, rr = (-(torch.rand(n, generator=g, dtype=torch.float64) * 20 + 1) for _ in range(4))
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr


def _check(ours, theirs, inputs):
    """Values equal, and gradients of the summed loss with respect to `inputs`."""
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=ours.dtype))
    grads = torch.autograd.grad(ours.sum(), inputs)
    for i, x in enumerate(inputs):
        for j in range(x.numel()):  # central differences of the paper's formula, element by element
            h = 1e-6
            up = [v.detach().clone() for v in inputs]
            down = [v.detach().clone() for v in inputs]
            up[i][j] += h
            down[i][j] -= h
            expected = (sum(_theirs_fn(*up)) - sum(_theirs_fn(*down))) / (2 * h)
            assert abs(grads[i][j].item() - expected) < 1e-5 * max(1.0, abs(expected)), (i, j)


_theirs_fn = None


def _use(fn):
    global _theirs_fn
    _theirs_fn = fn
    return fn


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_and_gradient_are_the_papers(smoothing):
    pc, pr, rc, rr = _logps()
    beta = 0.3

    @_use
    def theirs(pc, pr):
        out = []
        for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True):
            z = beta * ((a - c) - (b - d))
            out.append(-(1 - smoothing) * math.log(_sig(z)) - smoothing * math.log(_sig(-z)))
        return out

    losses, chosen, rejected = pref.dpo_loss(pc, pr, rc, rr, beta, smoothing)
    torch.testing.assert_close(chosen, (beta * (pc - rc)).detach())
    torch.testing.assert_close(rejected, (beta * (pr - rr)).detach())
    _check(losses, theirs(pc.detach(), pr.detach()), (pc, pr))


def test_ipo_loss_and_gradient_are_the_papers():
    pc, pr, rc, rr = _logps(seed=1)
    tau = 0.5

    @_use
    def theirs(pc, pr):
        return [((a - c) - (b - d) - 1 / (2 * tau)) ** 2
                for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True)]

    _check(pref.ipo_loss(pc, pr, rc, rr, tau)[0], theirs(pc.detach(), pr.detach()), (pc, pr))


def test_orpo_loss_and_gradient_are_the_papers():
    pc, pr, _, _ = _logps(seed=2)
    mc, mr = (x.detach().div(7).requires_grad_() for x in (pc, pr))  # mean log-probs in (-3, 0)
    lam = 0.25

    @_use
    def theirs(mc, mr):
        out = []
        for a, b in zip(mc.tolist(), mr.tolist(), strict=True):
            odds = lambda lp: math.exp(lp) / (1 - math.exp(lp))  # noqa: E731
            out.append(-a - lam * math.log(_sig(math.log(odds(a) / odds(b)))))
        return out

    losses, _, _, nll, ratio = pref.orpo_loss(mc, mr, lam, 0.1)
    torch.testing.assert_close(nll, -mc.detach())
    _check(losses, theirs(mc.detach(), mr.detach()), (mc, mr))


def test_simpo_loss_and_gradient_are_the_papers():
    pc, pr, _, _ = _logps(seed=3)
    mc, mr = (x.detach().div(9).requires_grad_() for x in (pc, pr))
    beta, gamma = 2.0, 0.7

    @_use
    def theirs(mc, mr):
        return [-math.log(_sig(beta * a - beta * b - gamma)) for a, b in zip(mc.tolist(), mr.tolist(), strict=True)]

    _check(pref.simpo_loss(mc, mr, beta, gamma)[0], theirs(mc.detach(), mr.detach()), (mc, mr))


def test_kto_loss_and_gradient_are_the_papers():
    pd, pu, rd, ru = _logps(n=4, seed=4)
    pd, rd = pd[:3].detach().requires_grad_(), rd[:3]  # unequal counts of desirable and undesirable examples
    beta, wd, wu = 0.2, 1.0, 1.5
    kl = pref.kto_kl(pd, pu, rd, ru)
    ratios = [a - c for a, c in zip(pd.tolist(), rd.tolist(), strict=True)]
    ratios += [b - d for b, d in zip(pu.tolist(), ru.tolist(), strict=True)]
    z0 = max(0.0, sum(ratios) / len(ratios))
    assert kl.item() == pytest.approx(z0) and not kl.requires_grad

    @_use
    def theirs(pd, pu):  # z0 held fixed: the paper's reference point takes no gradient
        out = [wd * (1 - _sig(beta * ((a - c) - z0))) for a, c in zip(pd.tolist(), rd.tolist(), strict=True)]
        return out + [wu * (1 - _sig(beta * (z0 - (b - d)))) for b, d in zip(pu.tolist(), ru.tolist(), strict=True)]

    loss_d, loss_u, _, _ = pref.kto_loss(pd, pu, rd, ru, kl, beta, wd, wu)
    _check(torch.cat([loss_d, loss_u]), theirs(pd.detach(), pu.detach()), (pd, pu))


def test_objectives_are_chosen_once_with_their_defaults():
    cfg = Config()
    cfg.train.objective = "simpo"
    objective = pref.build_objective(cfg.validate())
    assert isinstance(objective, pref.SimPO) and objective.beta == 2.0 and not objective.needs_reference
    cfg.train.objective, cfg.pref.beta, cfg.pref.length_normalization = "dpo", 0.5, True
    objective = pref.build_objective(cfg.validate())
    assert objective.beta == 0.5 and objective.needs_reference and objective.length_normalized
    logps = pref.PairLogps(torch.tensor([-1.0, -4.0]), torch.tensor([-2.0, -1.0]), torch.tensor([-0.5, -1.0]),
                           torch.tensor([-1.0, -0.5]), torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]))
    loss, sums = objective(logps)
    metrics = pref.finish_metrics(objective.metrics, sums.tolist())
    assert metrics["rewards_accuracy"] == 0.5  # mean log-probs compared: pair 1 prefers chosen, pair 2 not
    assert metrics["logps_chosen"] == -2.5  # summed log-probs reported, whatever the loss compares
    torch.testing.assert_close(metrics["rewards_margin"], metrics["rewards_chosen"] - metrics["rewards_rejected"])


@pytest.mark.parametrize("setting, message", [
    ({"train.objective": "dpo", "pref.beta": 0}, "pref.beta must be > 0"),
    ({"train.objective": "dpo", "pref.label_smoothing": 0.6}, "pref.label_smoothing must be in [0.0, 0.5]"),
    ({"train.objective": "orpo", "pref.orpo_lambda": -1}, "pref.orpo_lambda must be >= 0"),
    ({"train.objective": "simpo", "pref.simpo_gamma": -0.1}, "pref.simpo_gamma must be >= 0"),
    ({"train.objective": "kto", "pref.kto_undesirable_weight": -1}, "pref.kto_undesirable_weight must be >= 0"),
    ({"train.objective": "dpo", "pref.max_prompt_length": 600}, "pref.max_prompt_length must be below"),
    ({"train.objective": "simpo", "pref.label_smoothing": 0.1}, "pref.label_smoothing: applies to train.objective dpo"),
    ({"train.objective": "orpo", "pref.precompute_reference": True}, "pref.precompute_reference: applies to"),
    ({"pref.beta": 0.1}, "pref.beta: applies to a preference train.objective, not sft"),
    ({"train.objective": "dpo", "data.packing": True}, "data.packing: train.objective dpo"),
    ({"train.objective": "dpo", "train.train_type": "full"}, "train.objective: dpo takes its reference"),
    ({"train.objective": "rlhf"}, "train.objective must be one of sft, dpo, ipo, orpo, simpo, kto"),
])
def test_bad_preference_options_are_one_line_exit_2(setting, message, capsys):
    from qshard.cli import main

    flags = [x for key, value in setting.items() for x in (f"--{key}", str(value).lower())]
    assert main(["train", "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qshard: error: ") and message in err, err


# ------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("train_type", ["qlora", "qdora"])
def test_reference_is_the_base_with_adapters_off(train_type, tiny_models, dist_env):
    """Inside adapters_disabled the model computes what transformers computes from its (dequantized) base weights;
    outside, the adapters are back, bit for bit."""
    from transformers import AutoModelForCausalLM

    from qshard import export
    from qshard.adapters import LoRALinear, adapters_disabled
    from qshard.build import build_model

    model_dir = tiny_models("llama")
    cfg = Config()
    cfg.model.path, cfg.train.train_type, cfg.train.precision = str(model_dir), train_type, "fp32"
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    with torch.no_grad():
        for layer in layers:  # trained-looking adapters (B starts at zero, which would hide them)
            layer.lora_B.normal_(0, 0.5)
            if train_type == "qdora":
                layer.magnitude.mul_(1.5)
    model.eval()
    ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=ids, use_cache=False).logits
        with adapters_disabled(model):
            reference = model(input_ids=ids, use_cache=False).logits
        again = model(input_ids=ids, use_cache=False).logits
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        missing, unexpected = hf.load_state_dict(dict(export.base_weights(model, torch.float32)), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        base = hf(input_ids=ids).logits
    torch.testing.assert_close(reference, base, atol=1e-4, rtol=1e-4)
    assert (adapted - reference).abs().max() > 0.1  # the adapters matter, and were switched off
    assert torch.equal(again, adapted) and all(layer.adapter_enabled for layer in layers)
