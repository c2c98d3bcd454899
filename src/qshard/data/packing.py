"""Packing: several examples per sequence of at most max_length tokens, without padding inside.

Each document keeps its own positions (position_ids restart at 0), its first token is never a target
(the last token of the document before must not learn to predict it), and transformers builds a
block-diagonal causal mask from restarting position_ids when no attention_mask is given, so attention
never crosses documents.

Every epoch packs the documents differently, so the same ones are not always trained side by side: epoch
0 packs worst-fit decreasing; epoch e > 0 starts from that packing and swaps documents of similar length
between sequences, at random (seeded by the seed and e) wherever both sequences still fit. Swaps keep the
number of sequences, so an epoch's step count and the sampler stay as they are, and a packing is a function
of (documents, max_length, seed, epoch) alone: the same on every rank, at every world size, and after a
resume."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from qshard.data.example import IGNORE_INDEX, Example
from qshard.errors import QShardError

# Swap partners are neighbours in length order after random jitter, in tokens, one round per entry. Packed
# sequences are mostly full, so a swap fits when the two lengths are (nearly) equal: a jitter below one
# token pairs equal lengths in random order, which always fits; the second round pairs nearby lengths,
# which fits where there is room, and mixes the documents whose length no other one has.
SWAP_JITTER = (1.0, 16.0)


def example_lengths(examples: Sequence[Example]) -> np.ndarray:
    if hasattr(examples, "lengths"):
        return np.asarray(examples.lengths(), dtype=np.int64)
    return np.asarray([len(e.input_ids) for e in examples], dtype=np.int64)


def longest_positions(examples: Sequence[Example]) -> int:
    """The most positions any one sequence uses: its length, or packed, its longest document's (positions
    restart at each document)."""
    if hasattr(examples, "longest_row"):  # preference pairs: each of a pair's rows is a sequence of its own
        return examples.longest_row()
    lengths = examples.doc_lengths if isinstance(examples, PackedExamples) else example_lengths(examples)
    return int(lengths.max()) if len(lengths) else 0


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


def shuffle_bins(
    bins: list[np.ndarray], lengths: np.ndarray, max_length: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Another packing with as many bins, each with as many documents, as `bins`: documents of similar
    length swapped between bins at random, each swap made only if both bins still fit max_length."""
    rng = np.random.default_rng([seed, epoch])
    bin_array = np.empty(len(lengths), dtype=np.int64)
    for b, members in enumerate(bins):
        bin_array[members] = b
    # Python lists: the loop below touches single elements, where numpy's per-call cost dominates.
    bin_of, size = bin_array.tolist(), lengths.tolist()
    load = [int(lengths[m].sum()) for m in bins]
    for jitter in SWAP_JITTER:
        # Sorting by jittered length puts documents of similar length, from random bins, side by side.
        order = np.argsort(lengths + rng.uniform(0, jitter, len(lengths)), kind="stable")
        pairs = order[: len(order) // 2 * 2].reshape(-1, 2).tolist()
        # One at a time: each swap changes two loads that later swaps must see.
        for x, y in pairs:
            bx, by = bin_of[x], bin_of[y]
            grow = size[y] - size[x]  # bin bx gains this, bin by loses it
            if bx != by and load[bx] + grow <= max_length and load[by] - grow <= max_length:
                bin_of[x], bin_of[y] = by, bx
                load[bx] += grow
                load[by] -= grow
    bin_array = np.asarray(bin_of, dtype=np.int64)
    order = np.argsort(bin_array, kind="stable")  # documents grouped by bin, in index order within each
    return np.split(order, np.cumsum(np.bincount(bin_array, minlength=len(bins)))[:-1])


class PackedExamples(Sequence):
    """Packed sequences over `examples`; item i is one Example with position_ids.

    Indexing reads epoch 0's packing; `of_epoch(e)` is the same sequences as epoch `e` packs them."""

    def __init__(self, examples: Sequence[Example], max_length: int, seed: int = 0):
        self.examples, self.max_length, self.seed = examples, max_length, seed
        self.doc_lengths = example_lengths(examples)
        self.bins = pack_indices(self.doc_lengths, max_length)
        self._epoch_bins: tuple[int, list[np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.bins)

    def bins_of_epoch(self, epoch: int) -> list[np.ndarray]:
        """The packing used in `epoch` (epoch 0's and the latest other one asked for are kept)."""
        if epoch == 0:
            return self.bins
        if self._epoch_bins is None or self._epoch_bins[0] != epoch:
            self._epoch_bins = (epoch, shuffle_bins(self.bins, self.doc_lengths, self.max_length, self.seed, epoch))
        return self._epoch_bins[1]

    def __getitem__(self, i: int) -> Example:
        return self.item(i, epoch=0)

    def of_epoch(self, epoch: int) -> Sequence[Example]:
        return _EpochPacking(self, epoch)

    def item(self, i: int, epoch: int) -> Example:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for j in self.bins_of_epoch(epoch)[i].tolist():
            doc = self.examples[j]
            ids += doc.input_ids
            labels += [IGNORE_INDEX] + doc.labels[1:]
            positions += range(len(doc.input_ids))
        return Example(ids, labels, positions)

    def lengths(self) -> np.ndarray:
        """Sequence lengths of epoch 0's packing."""
        return np.asarray([int(self.doc_lengths[b].sum()) for b in self.bins], dtype=np.int64)


class _EpochPacking(Sequence):
    """PackedExamples as one epoch packs them."""

    def __init__(self, packed: PackedExamples, epoch: int):
        self.packed, self.epoch = packed, epoch

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i: int) -> Example:
        return self.packed.item(i, self.epoch)
