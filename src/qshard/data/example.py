"""The unit of training data: one tokenized example with its loss labels."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where the token is not trained on
    # Only packed sequences have them: each document's positions restart at 0.
    position_ids: list[int] | None = None
