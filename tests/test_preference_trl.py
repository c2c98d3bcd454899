"""qshard's preference losses and their gradients equal TRL's own loss code on the same log-probs.

TRL computes DPO's and KTO's losses inside its trainers' `_compute_loss`, from the per-token log-probs its fused
LM head returns; these tests run that method on a trainer object built without a model, whose "model" hands back
given per-token log-probs (zero outside the completions, as TRL's head does), with the reference log-probs
precomputed. Conservative DPO (label smoothing) and SimPO are CPO's `cpo_loss` (CPO is DPO with the reference
at zero: given log-ratios it is DPO's loss), ORPO's odds-ratio term `odds_ratio_loss`. Single process: gathering
is the identity. Needs trl (the `test` extra); skipped without it."""

from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

# The loss code these tests call is private to TRL's trainers: pyproject's test extra pins the versions it has.
trl = pytest.importorskip("trl", minversion="1.16")

with warnings.catch_warnings():  # trl.experimental warns that its API may change: the pinned range holds it
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

from qshard.train.preference import dpo_loss, ipo_loss, kto_kl, kto_loss, orpo_loss, simpo_loss  # noqa: E402

BETA = 0.3
PROMPT, WIDTH = 2, 7  # prompt tokens; sequence width (completions of 2 to 5 tokens, right-padded)


class _Identity:
    """The accelerator of one process: TRL's gathers return their input."""

    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


class _Head:
    """Stands for the model behind TRL's fused LM head: the given per-token log-probs for the sequences whose
    input_ids it is called with (masked to the completions, as the head masks them by label -100)."""

    training = True

    def __init__(self, by_input):
        self.by_input = by_input

    def __call__(self, input_ids, labels, **_):
        logps = self.by_input[id(input_ids)]
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps * (labels[:, 1:] != -100), entropy=zeros, mean_logits=zeros,
                               is_top1=zeros.bool())


def _trainer(cls, **attrs):
    """A TRL trainer object with only what its loss code reads (no model, no data, no Trainer.__init__)."""
    trainer = object.__new__(cls)
    defaults = dict(accelerator=_Identity(), beta=BETA, precompute_ref_logps=True, aux_loss_enabled=False,
                    _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                    _tp_size=1)
    for name, value in {**defaults, **attrs}.items():
        setattr(trainer, name, value)
    return trainer


def _sequences(lengths, seed):
    """input_ids, completion mask, leaf per-token log-probs (B, WIDTH - 1) of completions of these lengths."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), WIDTH, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, PROMPT:PROMPT + n] = 1
    ids = torch.randint(3, 50, (len(lengths), WIDTH), generator=g)
    token = (-3 * torch.rand(len(lengths), WIDTH - 1, generator=g, dtype=torch.float64)).requires_grad_()
    return ids, mask, token


def _sums(token, mask):
    """Per-sequence summed and mean log-probs of the completion tokens (what qshard's head loss returns)."""
    shifted = mask[:, 1:]
    sums = (token * shifted).sum(1)
    return sums, sums / shifted.sum(1)


def _pairs(seed=0):
    """Three pairs: chosen lengths 3, 5, 2 and rejected 4, 2, 5; reference log-probs per sequence."""
    ids, mask, token = _sequences([3, 5, 2, 4, 2, 5], seed)
    ref = -4 * torch.rand(6, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return ids, mask, token, ref


def _trl_dpo(loss_type, ids, mask, token, ref):
    trainer = _trainer(DPOTrainer, model=_Head({}), ld_alpha=None, f_divergence_type="reverse_kl",
                       loss_types=[loss_type], loss_weights=[1.0], label_smoothing=0.0, use_weighting=False)
    trainer.model.by_input[id(ids)] = token
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "ref_chosen_logps": ref[:3], "ref_rejected_logps": ref[3:]}
    return trainer._compute_loss(trainer.model, inputs, return_outputs=False)


def _grad(loss, token):
    return torch.autograd.grad(loss, token)[0]


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_dpo_and_ipo_equal_trl_dpo_trainer(objective):
    """DPO (TRL's "sigmoid": summed log-probs) and IPO (TRL's "ipo": per-token means, beta as tau): loss and
    gradient w.r.t. every token's log-prob."""
    ids, mask, token, ref = _pairs()
    theirs = _trl_dpo({"dpo": "sigmoid", "ipo": "ipo"}[objective], ids, mask, token, ref)
    sums, means = _sums(token, mask)
    n = mask.sum(1)
    if objective == "dpo":
        losses = dpo_loss(sums[:3], sums[3:], ref[:3], ref[3:], BETA)[0]
    else:
        mean_ref = ref / n
        losses = ipo_loss(means[:3], means[3:], mean_ref[:3], mean_ref[3:], BETA)[0]
    ours = losses.mean()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(_grad(ours, token), _grad(theirs, token))


def _same_grads(ours, theirs, inputs):
    """The gradients of the summed losses with respect to `inputs` are equal."""
    for ours_g, theirs_g in zip(torch.autograd.grad(ours.sum(), inputs), torch.autograd.grad(theirs.sum(), inputs),
                                strict=True):
        torch.testing.assert_close(ours_g, theirs_g)


def _log_ratios(seed=2):
    g = torch.Generator().manual_seed(seed)
    pc, pr = (-30 * torch.rand(5, generator=g, dtype=torch.float64)).requires_grad_(), \
        (-30 * torch.rand(5, generator=g, dtype=torch.float64)).requires_grad_()
    rc, rr = -30 * torch.rand(5, generator=g, dtype=torch.float64), -30 * torch.rand(5, generator=g,
                                                                                   dtype=torch.float64)
    return pc, pr, rc, rr


def test_conservative_dpo_equals_trl_sigmoid_with_label_smoothing():
    """Label-smoothed DPO: TRL's conservative sigmoid loss (CPO's, given the log-ratios as log-probs)."""
    pc, pr, rc, rr = _log_ratios()
    cpo = _trainer(CPOTrainer, loss_type="sigmoid", alpha=0.0, label_smoothing=0.2, simpo_gamma=0.0)
    theirs, chosen_t, rejected_t = cpo.cpo_loss(pc - rc, pr - rr)
    ours, chosen, rejected = dpo_loss(pc, pr, rc, rr, BETA, label_smoothing=0.2)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close((chosen, rejected), (chosen_t, rejected_t))
    _same_grads(ours, theirs, (pc, pr))


def test_simpo_equals_trl_cpo_simpo():
    """SimPO over per-token mean log-probs: TRL's CPO loss_type "simpo" (gamma as the reward margin)."""
    pc, pr, _, _ = _log_ratios(3)
    pc, pr = (pc / 10).detach().requires_grad_(), (pr / 10).detach().requires_grad_()
    cpo = _trainer(CPOTrainer, loss_type="simpo", alpha=0.0, label_smoothing=0.0, simpo_gamma=0.7)
    theirs, chosen_t, rejected_t = cpo.cpo_loss(pc, pr)
    ours, chosen, rejected = simpo_loss(pc, pr, BETA, 0.7)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close((chosen, rejected), (chosen_t, rejected_t))
    _same_grads(ours, theirs, (pc, pr))


def test_orpo_equals_trl_odds_ratio_loss():
    """ORPO: qshard's loss minus its NLL term is TRL's odds-ratio loss (TRL's beta is ORPO's lambda), with the same
    log odds ratio, on mean log-probs near 0 (the stable branch of log(1 - P) matters there) and far from it."""
    pc = torch.tensor([-0.01, -0.5, -2.0, -0.7], dtype=torch.float32, requires_grad=True)
    pr = torch.tensor([-0.02, -1.5, -0.3, -0.69], dtype=torch.float32, requires_grad=True)
    orpo = _trainer(ORPOTrainer, beta=0.25)
    theirs, _, _, _, log_odds = orpo.odds_ratio_loss(pc, pr)
    losses, _, _, _, ratio = orpo_loss(pc, pr, lam=0.25, beta=BETA)
    ours = losses - (-pc)  # the odds-ratio term: -lambda log s(log odds ratio)
    torch.testing.assert_close(ours, -theirs)
    torch.testing.assert_close(ratio.mean(), log_odds)
    _same_grads(ours, -theirs, (pc, pr))


def test_kto_equals_trl_kto_trainer():
    """KTO: desirable and undesirable examples, the reference point from mismatched pairs (clamped at 0), the
    weights of both kinds; loss (mean over examples) and gradient w.r.t. every token's log-prob."""
    ids, mask, token = _sequences([3, 5, 2, 4, 1], seed=4)
    kl_ids, kl_mask, kl_token = _sequences([4, 2, 3, 5, 3], seed=5)
    kl_token = kl_token.detach()
    label = torch.tensor([True, False, True, True, False])
    g = torch.Generator().manual_seed(6)
    ref = -4 * torch.rand(5, generator=g, dtype=torch.float64)
    kl_sums = _sums(kl_token, kl_mask)[0]
    ref_kl = kl_sums - 0.2 - 0.5 * torch.rand(5, generator=g, dtype=torch.float64)  # policy above the reference
    trainer = _trainer(KTOTrainer, model=_Head({id(ids): token, id(kl_ids): kl_token}), calculate_KL=True,
                       loss_type="kto", desirable_weight=1.3, undesirable_weight=0.8)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(kl_ids), "KL_completion_mask": kl_mask,
              "label": label, "ref_logps": ref, "ref_KL_logps": ref_kl}
    theirs = trainer._compute_loss(trainer.model, inputs, return_outputs=False)

    sums = _sums(token, mask)[0]
    z0 = kto_kl([kl_sums], [ref_kl], [torch.ones(5)])
    assert z0.item() > 0  # the clamp does not decide the test
    loss_d, loss_u, _, _ = kto_loss(sums[label], sums[~label], ref[label], ref[~label], z0, BETA, 1.3, 0.8)
    ours = (loss_d.sum() + loss_u.sum()) / 5
    # qshard reduces the reference point in float32 (it is summed across ranks)
    close = dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, theirs, **close)
    assert z0.item() == pytest.approx(trainer._metrics["train"]["kl"][0], rel=1e-6)
    torch.testing.assert_close(_grad(ours, token), _grad(theirs, token), **close)
