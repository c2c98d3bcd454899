"""Packing: several examples per sequence of at most max_length tokens, without padding inside.

Each document keeps its own positions (position_ids restart at 0), its first token is never a target
(the last token of the document before must not learn to predict it), and transformers builds a
block-diagonal causal mask from restarting position_ids when no attention_mask is given, so attention
never crosses documents."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from qshard.data.example import IGNORE_INDEX, Example
from qshard.errors import QShardError


def example_lengths(examples: Sequence[Example]) -> np.ndarray:
    if hasattr(examples, "lengths"):
        return np.asarray(examples.lengths(), dtype=np.int64)
    return np.asarray([len(e.input_ids) for e in examples], dtype=np.int64)


def pack_indices(lengths: np.ndarray, max_length: int) -> list[np.ndarray]:
    """Bins of example indices, each summing to at most max_length tokens.

    Longest first, each into the bin with the most room left (worst-fit decreasing): O(n log n), and
    deterministic, so every rank and every world size packs alike."""
    if len(lengths) and int(lengths.max()) > max_length:
        raise QShardError(f"an example of {int(lengths.max())} tokens does not fit data.max_length={max_length}")
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # max-heap of (-room left, bin number)
    for i in order.tolist():
        size = int(lengths[i])
        if room and -room[0][0] >= size:
            left, b = heapq.heappop(room)
            bins[b].append(i)
            heapq.heappush(room, (left + size, b))
        else:
            bins.append([i])
            heapq.heappush(room, (size - max_length, len(bins) - 1))
    return [np.asarray(sorted(b), dtype=np.int64) for b in bins]


class PackedExamples(Sequence):
    """Packed sequences over `examples`; item i is one Example with position_ids."""

    def __init__(self, examples: Sequence[Example], max_length: int):
        self.examples = examples
        self.bins = pack_indices(example_lengths(examples), max_length)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> Example:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for j in self.bins[i].tolist():
            doc = self.examples[j]
            ids += doc.input_ids
            labels += [IGNORE_INDEX] + doc.labels[1:]
            positions += range(len(doc.input_ids))
        return Example(ids, labels, positions)

    def lengths(self) -> np.ndarray:
        doc_lengths = example_lengths(self.examples)
        return np.asarray([int(doc_lengths[b].sum()) for b in self.bins], dtype=np.int64)
