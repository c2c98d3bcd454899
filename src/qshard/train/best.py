"""The best held-out loss of a run so far, and early stopping's count of evaluations without improvement.
Saved with every checkpoint (trainer_state.json's "best"), so that a resumed run goes on counting."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BestLoss:
    """The lowest held-out loss evaluated after a training step, its step, and the evaluations since the last
    one that beat the best by more than `min_delta` (early stopping's patience count)."""

    patience: int = 0  # 0: never stop early
    min_delta: float = 0.0
    loss: float | None = None
    step: int | None = None
    evals_without_improvement: int = 0

    def update(self, step: int, loss: float) -> None:
        """Record the held-out loss evaluated after `step`."""
        improved = self.loss is None or loss < self.loss - self.min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        if self.loss is None or loss < self.loss:  # the best checkpoint is the lowest loss, however small the gain
            self.loss, self.step = loss, step

    @property
    def exhausted(self) -> bool:
        """Whether early stopping's patience has run out."""
        return 0 < self.patience <= self.evals_without_improvement

    def state(self) -> dict:
        """What a checkpoint keeps of it (the options are the run's own, not saved here)."""
        return {"loss": self.loss, "step": self.step, "evals_without_improvement": self.evals_without_improvement}

    def restore(self, state: dict | None) -> None:
        """Continue from a checkpoint's `state()` (none in a checkpoint of an older qshard: start afresh)."""
        if state:
            self.loss, self.step = state["loss"], state["step"]
            self.evals_without_improvement = state["evals_without_improvement"]
