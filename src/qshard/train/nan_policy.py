"""What a training step whose loss or gradient norm is NaN or infinite does (`train.nan_policy`), chosen once
per run: `error` ends the run naming the step, `skip_step` leaves that step's update out and goes on.

Either way a run never finishes looking sound with NaN weights, and fp16's loss scaler keeps its own rule:
a step whose scaled gradients overflow is skipped by the scaler (which lowers its scale), recorded as
skipped, and is not an error."""

from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist

from qshard.errors import QShardError

log = logging.getLogger("qshard")

# A skipped first step (fp16's overflow, skip_step) advances the schedule without an optimizer step: on purpose.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")

# Skipped steps in a row that end the run under either policy. A bad batch or an overflow is rare; sixteen in a
# row are a model that no longer learns (a NaN that skipping cannot remove), and under fp16 a loss scale
# halved sixteen times (from its initial 2^16 down to 1: gradients that overflow fp16 unscaled).
MAX_SKIPS_IN_A_ROW = 16

STOPPED = ("the run stops here (train.nan_policy: error), with no metrics line or checkpoint for this step; "
           "lower optim.lr, check the data, or set train.nan_policy: skip_step to leave such steps out")


class NonFiniteError(QShardError):
    """A loss or gradient norm that is not finite ends the run; every rank raises it at the same step."""


def build_nan_policy(name: str, loss_scaling: bool, is_main: bool) -> StopOnNonFinite | SkipNonFinite:
    """The policy `train.nan_policy` names; `loss_scaling`: fp16's scaler skips overflowing steps itself."""
    return {"error": StopOnNonFinite, "skip_step": SkipNonFinite}[name](loss_scaling, is_main)


class StopOnNonFinite:
    """`error`: a step whose loss, or whose gradient norm where no loss scaler skipped it, is not finite raises,
    from the totals `Trainer.finish` reads anyway (the step waits for nothing more): before the step's metrics
    line is written or any checkpoint after it is saved."""

    def __init__(self, loss_scaling: bool, is_main: bool) -> None:
        self.loss_scaling, self.is_main = loss_scaling, is_main
        self.in_a_row = 0  # skipped steps just before this one

    def skip_update(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether to leave this step's update out: never decided before the update in this mode."""
        return False

    def judge(self, step: int, loss: float, grad_norm: float, skipped: bool) -> bool:
        """Check finished step `step` (1-based); whether it was skipped (by fp16's loss scaler)."""
        if not math.isfinite(loss):
            raise NonFiniteError(f"step {step}: the loss is {loss}; {STOPPED}")
        overflowed = not math.isfinite(grad_norm)
        if overflowed and not self.loss_scaling:
            raise NonFiniteError(f"step {step}: the gradient norm is {grad_norm} (the loss is {loss:.4f}); {STOPPED}")
        return self._count(step, overflowed)

    def check_eval(self, when: str, loss: float) -> None:
        if not math.isfinite(loss):
            raise NonFiniteError(f"the held-out loss {when} is {loss}; the run stops here (train.nan_policy: error)")

    def _count(self, step: int, skipped: bool) -> bool:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(
                f"step {step}: {self.in_a_row} steps in a row (from step {step - self.in_a_row + 1}) had a loss or "
                "gradients that are not finite and were skipped; the run stops, as it no longer learns (the "
                f"weights are those after step {step - self.in_a_row}). Lower optim.lr or check the data"
            )
        return skipped


class SkipNonFinite(StopOnNonFinite):
    """`skip_step`: a step whose loss (on any rank) or gradient norm is not finite changes no parameter and no
    optimizer state (under fp16 the scaler still lowers its scale); the learning-rate schedule advances, as
    fp16's scaler skips have always let it, so the schedule stays a function of the step. Deciding before the
    update reads a flag on the host every step: this mode's cost."""

    def skip_update(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        values = torch.stack([loss_sum.detach().float(), grad_norm.detach().to(loss_sum.device).float()])
        bad = (~torch.isfinite(values)).sum()
        dist.all_reduce(bad)  # every rank skips the same steps: a loss is only this rank's
        return bool(bad.item())

    def judge(self, step: int, loss: float, grad_norm: float, skipped: bool) -> bool:
        skipped = skipped or not math.isfinite(grad_norm)
        if skipped and self.is_main:
            log.warning("step %d: the loss is %s and the gradient norm %s: the step's update was skipped "
                        "(train.nan_policy: skip_step)", step, loss, grad_norm)
        return self._count(step, skipped)

    def check_eval(self, when: str, loss: float) -> None:
        if not math.isfinite(loss) and self.is_main:
            log.warning("the held-out loss %s is %s", when, loss)
