"""Preference objectives (train.objective: dpo, ipo, orpo, simpo, kto): one small loss function per method, chosen
once when the trainer is built, each a direct transcription of its paper's formula over per-sequence log-probs.

Every function takes the policy's (and, for the methods that have one, the reference's) per-sequence log-probs
and returns the per-example losses and the rewards that the metrics report; the caller sums the losses over
the global batch and divides by its pair (or, for KTO, example) count.

- DPO (Rafailov et al. 2023), with conservative DPO's label smoothing (Mitchell 2023):
  -(1-e) log s(b h) - e log s(-b h), h = (log pi(yw) - log ref(yw)) - (log pi(yl) - log ref(yl)).
- IPO (Azar et al. 2023): (h - 1/(2 tau))^2.
- ORPO (Hong et al. 2024), reference-free: NLL(yw) - lambda log s(log odds(yw) - log odds(yl)), with
  odds(y) = P(y) / (1 - P(y)) and log P(y) the mean token log-prob.
- SimPO (Meng et al. 2024), reference-free: -log s(b (mean log pi(yw) - mean log pi(yl)) - gamma).
- KTO (Ethayarajh et al. 2024): w_d (1 - s(b (r - z0))) for desirable examples, w_u (1 - s(b (z0 - r))) for
  undesirable ones, r = log pi(y) - log ref(y), z0 the policy-to-reference KL estimate (no gradient): the mean
  log-ratio of mismatched prompt-completion pairs (each prompt with another example's completion) over the
  global batch, at least 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from qshard.adapters import adapters_disabled
from qshard.attention import check_rows_taken
from qshard.config import DEFAULT_BETA, REFERENCE_OBJECTIVES, Config
from qshard.data.preference import collate_kto, collate_pairs, collate_shared_pairs, mismatched_rows


@dataclass(frozen=True)
class PairLogps:
    """Per-sequence log-probs of one micro-batch: summed and per-token mean, of the chosen and the rejected (or,
    for KTO, the desirable and the undesirable) sequences, the policy's and (where used) the reference's."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_mean: torch.Tensor
    rejected_mean: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    ref_chosen_mean: torch.Tensor | None = None
    ref_rejected_mean: torch.Tensor | None = None
    kl: torch.Tensor | None = None  # KTO's reference point z0


def dpo_loss(pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0):
    """(losses, chosen rewards, rejected rewards) of DPO; label_smoothing > 0 is conservative DPO."""
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    logits = chosen - rejected
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen.detach(), rejected.detach()


def ipo_loss(pc, pr, rc, rr, tau: float):
    """(losses, chosen rewards, rejected rewards) of IPO: the log-ratio margin regressed to 1 / (2 tau)."""
    h = (pc - rc) - (pr - rr)
    losses = (h - 1 / (2 * tau)) ** 2
    return losses, (tau * (pc - rc)).detach(), (tau * (pr - rr)).detach()


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(P / (1 - P)) from log P, stable as P nears 1 (log P is below 0 for any answer of a real token)."""
    return mean_logp - torch.log1p(-torch.exp(mean_logp).clamp(max=1 - 1e-7))


def orpo_loss(mean_pc, mean_pr, lam: float, beta: float):
    """(losses, chosen rewards, rejected rewards, nll, log odds ratio) of ORPO: the chosen's mean NLL (the SFT
    term) plus lambda times the odds-ratio term. The rewards are beta times the mean log-probs."""
    ratio = log_odds(mean_pc) - log_odds(mean_pr)
    nll = -mean_pc
    losses = nll - lam * F.logsigmoid(ratio)
    return losses, (beta * mean_pc).detach(), (beta * mean_pr).detach(), nll.detach(), ratio.detach()


def simpo_loss(mean_pc, mean_pr, beta: float, gamma: float):
    """(losses, chosen rewards, rejected rewards) of SimPO: length-normalized rewards with a target margin."""
    chosen, rejected = beta * mean_pc, beta * mean_pr
    losses = -F.logsigmoid(chosen - rejected - gamma)
    return losses, chosen.detach(), rejected.detach()


def kto_kl(policy: list[torch.Tensor], reference: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """KTO's reference point z0: the mean policy-to-reference log-ratio of the mismatched prompt-completion pairs
    (per micro-batch: their log-probs and weights, 0 for a row that compares nothing), over every rank's, at
    least 0, with no gradient. Summed over ranks, so every rank holds the same z0."""
    ratios = [((p - r).detach().float() * w).sum() for p, r, w in zip(policy, reference, weights, strict=True)]
    stats = torch.stack([torch.stack(ratios).sum(), torch.stack([w.sum() for w in weights]).float().sum()])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).clamp(min=0)


def kto_loss(pd, pu, rd, ru, kl, beta: float, desirable_weight: float, undesirable_weight: float):
    """(desirable losses, undesirable losses, their rewards) of KTO around the reference point `kl`."""
    desirable, undesirable = pd - rd, pu - ru
    loss_d = desirable_weight * (1 - torch.sigmoid(beta * (desirable - kl)))
    loss_u = undesirable_weight * (1 - torch.sigmoid(beta * (kl - undesirable)))
    return loss_d, loss_u, (beta * desirable).detach(), (beta * undesirable).detach()


# ---------------------------------------------------------------------------------------------------------------
# The objectives as the trainer uses them: (summed loss, the metrics' sums and counts) of one micro-batch.

PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                "logps_rejected")


def _pair_sums(losses, chosen, rejected, logps: PairLogps, extra=()) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss and, per metric, (sum, count): every pair metric is averaged over pairs."""
    n = torch.full((), chosen.numel(), dtype=torch.float32, device=chosen.device)
    values = [chosen, rejected, chosen - rejected, (chosen > rejected).float(), logps.chosen.detach(),
              logps.rejected.detach(), *extra]
    sums = torch.stack([x for v in values for x in (v.float().sum(), n)])
    return losses.sum(), sums


class Objective:
    """A preference method, configured: `needs_reference`, its metric names, and `__call__(logps)` -> (summed
    loss, metric sums and counts interleaved)."""

    needs_reference = True
    metrics = PAIR_METRICS
    length_normalized = False  # whether the method compares per-token mean log-probs

    def __init__(self, cfg: Config) -> None:
        self.p = cfg.pref
        self.beta = cfg.pref.beta if cfg.pref.beta is not None else DEFAULT_BETA[cfg.train.objective]

    def compared(self, logps: PairLogps):
        """(policy chosen, policy rejected, reference chosen, reference rejected): per-token means where the method
        normalizes by length, sums otherwise."""
        if self.length_normalized:
            return logps.chosen_mean, logps.rejected_mean, logps.ref_chosen_mean, logps.ref_rejected_mean
        return logps.chosen, logps.rejected, logps.ref_chosen, logps.ref_rejected


class DPO(Objective):
    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        # Empty: IPO compares per-token means (its margin target 1/(2 tau) is per token, as TRL has it), DPO sums.
        normalize = cfg.pref.length_normalization
        self.length_normalized = cfg.train.objective == "ipo" if normalize is None else normalize

    def __call__(self, logps: PairLogps):
        losses, chosen, rejected = dpo_loss(*self.compared(logps), self.beta, self.p.label_smoothing)
        return _pair_sums(losses, chosen, rejected, logps)


class IPO(DPO):
    def __call__(self, logps: PairLogps):
        losses, chosen, rejected = ipo_loss(*self.compared(logps), self.beta)
        return _pair_sums(losses, chosen, rejected, logps)


class ORPO(Objective):
    needs_reference = False
    metrics = (*PAIR_METRICS, "nll_loss", "log_odds_ratio")

    def __call__(self, logps: PairLogps):
        losses, chosen, rejected, nll, ratio = orpo_loss(logps.chosen_mean, logps.rejected_mean,
                                                         self.p.orpo_lambda, self.beta)
        return _pair_sums(losses, chosen, rejected, logps, (nll, ratio))


class SimPO(Objective):
    needs_reference = False

    def __call__(self, logps: PairLogps):
        losses, chosen, rejected = simpo_loss(logps.chosen_mean, logps.rejected_mean, self.beta, self.p.simpo_gamma)
        return _pair_sums(losses, chosen, rejected, logps)


class KTO(Objective):
    """KTO's metrics average each reward over its own examples (desirable or undesirable); its margin and accuracy
    are those of the two means, which the run reports from the sums."""

    metrics = ("rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected", "kl")

    def __call__(self, logps: PairLogps):
        pd, pu, rd, ru, kl = logps.chosen, logps.rejected, logps.ref_chosen, logps.ref_rejected, logps.kl
        loss_d, loss_u, chosen, rejected = kto_loss(pd, pu, rd, ru, kl, self.beta, self.p.kto_desirable_weight,
                                                    self.p.kto_undesirable_weight)
        n_d, n_u, one = (torch.full((), float(v), device=kl.device) for v in (pd.numel(), pu.numel(), 1))
        sums = torch.stack([chosen.sum(), n_d, rejected.sum(), n_u, pd.detach().sum(), n_d, pu.detach().sum(), n_u,
                            kl, one]).float()
        return loss_d.sum() + loss_u.sum(), sums


OBJECTIVES = {"dpo": DPO, "ipo": IPO, "orpo": ORPO, "simpo": SimPO, "kto": KTO}
assert set(OBJECTIVES) == {*REFERENCE_OBJECTIVES, "orpo", "simpo"}


def build_objective(cfg: Config) -> Objective:
    """train.objective's method with its pref.* parameters (a preference objective, not sft)."""
    return OBJECTIVES[cfg.train.objective](cfg)


def finish_metrics(names: tuple[str, ...], sums: list[float]) -> dict[str, float]:
    """The metrics from their (sum, count) pairs summed over micro-batches and ranks; KTO's margin and accuracy
    from its mean rewards."""
    out = {name: sums[2 * i] / max(sums[2 * i + 1], 1) for i, name in enumerate(names)}
    if "rewards_margin" not in out:
        out["rewards_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# The trainer's view: a micro-batch of pairs in, (summed loss, metric sums) out.


class PreferenceLoss:
    """train.objective's preference method over collated pairs (data.preference.collate_pairs, or under
    pref.share_prompt collate_shared_pairs: `shared`): one policy forward over chosen and rejected together through
    the head loss's per-token log-probs (chunked where the architecture allows), and before it the reference's,
    without gradient and with the adapters switched off, for the methods that have one. Normalized by the global
    batch's pairs (KTO: examples).

    KTO's reference point is set by `start_step` for the global batch's micro-batches (their mismatched rows run
    through the policy and the reference without gradient first); a micro-batch evaluated alone estimates it from
    its own (and the other ranks' of the same forward)."""

    def __init__(self, cfg: Config, head, shared: bool = False) -> None:
        self.objective = build_objective(cfg)
        self.metrics = self.objective.metrics
        self.head = head
        kto = cfg.train.objective == "kto"
        self.unit = "examples" if kto else "pairs"
        self.units = _rows if kto else _pairs
        self.collate = collate_kto if kto else collate_shared_pairs if shared else collate_pairs
        self.unchecked = shared and not kto
        self.start_step = self._kto_start_step if kto else _nothing
        self.reference_point = self._kto_reference_point if kto else _no_reference
        self.reference = (_no_reference if not self.objective.needs_reference
                          else _precomputed if cfg.pref.precompute_reference else self._reference)

    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's (chosen or rejected completion's) summed and per-token mean log-prob of its trained
        tokens, in the batch's order of sequences (every chosen, then every rejected)."""
        if self.unchecked:  # pref.share_prompt's first forward: did every layer's attention take the rows?
            self.unchecked = False
            with check_rows_taken(model):
                token = self.head.token_logps(model, batch)
        else:
            token = self.head.token_logps(model, batch)
        tokens = batch["sequence_tokens"]
        sums = token.new_zeros(tokens.shape[0]).index_add(0, batch["loss_sequences"], token)
        return sums, sums / tokens

    def _reference(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), adapters_disabled(model):
            return self.sequence_logps(model, batch)[0]

    def _mismatched_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(policy, reference) log-probs of a KTO batch's mismatched rows, and their weights."""
        kl = mismatched_rows(batch)
        with torch.no_grad():
            policy = self.sequence_logps(model, kl)[0]
            with adapters_disabled(model):
                reference = self.sequence_logps(model, kl)[0]
        return policy, reference, kl["weight"]

    def _kto_reference_point(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "kto_z0" in batch:  # set for the whole global batch by start_step
            return batch["kto_z0"]
        return kto_kl(*([t] for t in self._mismatched_logps(model, batch)))

    def _kto_start_step(self, model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
        """KTO's reference point for one optimizer step: from every micro-batch's mismatched rows, on every rank."""
        policy, reference, weights = zip(*(self._mismatched_logps(model, b) for b in batches), strict=True)
        z0 = kto_kl(list(policy), list(reference), list(weights))
        for batch in batches:
            batch["kto_z0"] = z0

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        kl = self.reference_point(model, batch)
        reference = self.reference(model, batch)
        sums, means = self.sequence_logps(model, batch)
        rows = [sums, means]
        if reference is not None:
            rows += [reference, reference / batch["sequence_tokens"]]
        chosen, rejected = batch["chosen_sequences"], batch["rejected_sequences"]
        # PairLogps' order: each quantity's chosen rows, then its rejected rows.
        split = [part for t in rows for part in (t.index_select(0, chosen), t.index_select(0, rejected))]
        return self.objective(PairLogps(*split[:4], *split[4:6], *split[6:], kl=kl))


def _nothing(_model: nn.Module, _batches: list[dict[str, torch.Tensor]]) -> None:
    """start_step of the objectives that prepare nothing for a step."""


def _no_reference(_model: nn.Module, _batch: dict[str, torch.Tensor]) -> None:
    """The reference (or KTO's reference point) of an objective without one."""
    return None


def _precomputed(_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """pref.precompute_reference: the sequences' reference log-probs, collated with them (train/reference.py)."""
    assert "ref_logps" in batch, "the reference is precomputed before the trainer collates a batch"
    return batch["ref_logps"]


def _pairs(batch: dict[str, torch.Tensor]) -> int:
    return len(batch["chosen_sequences"])


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(batch["chosen_sequences"]) + len(batch["rejected_sequences"])
