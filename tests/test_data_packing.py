"""Packing: bins, labels at document boundaries, collation, and the model seeing each document alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from qshard.data import (
    IGNORE_INDEX,
    Example,
    GlobalBatchSampler,
    PackedExamples,
    collate,
    for_epoch,
    input_tokens,
    model_inputs,
)
from qshard.data.packing import pack_indices
from qshard.errors import QShardError


def docs(lengths: list[int], start: int = 3) -> list[Example]:
    """Documents with every token trained; document i's tokens are distinct from the others'."""
    out = []
    for i, n in enumerate(lengths):
        ids = [start + (7 * i + j) % 300 for j in range(n)]
        out.append(Example(ids, list(ids)))
    return out


def test_bins_fit_and_use_every_example_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    bins = pack_indices(lengths, 64)
    flat = np.concatenate(bins)
    assert sorted(flat.tolist()) == list(range(500))
    assert all(int(lengths[b].sum()) <= 64 for b in bins)
    assert len(bins) <= 1.15 * lengths.sum() / 64  # little room wasted
    assert [b.tolist() for b in bins] == [b.tolist() for b in pack_indices(lengths, 64)]  # deterministic
    with pytest.raises(QShardError, match="does not fit data.max_length=64"):
        pack_indices(np.array([65, 3]), 64)


def test_packed_sequence_positions_restart_and_boundaries_are_not_trained():
    examples = docs([5, 3, 4, 6])
    packed = PackedExamples(examples, max_length=9)
    assert len(packed) == 2
    seen = []
    for seq in packed:
        assert len(seq.input_ids) == len(seq.labels) == len(seq.position_ids) <= 9
        starts = [i for i, p in enumerate(seq.position_ids) if p == 0]
        assert starts[0] == 0
        bounds = starts + [len(seq.input_ids)]
        for a, b in zip(bounds, bounds[1:]):
            assert seq.position_ids[a:b] == list(range(b - a))
            doc = next(e for e in examples if e.input_ids == seq.input_ids[a:b])
            seen.append(doc)
            # the document's own labels, except its first token: no target across the boundary
            assert seq.labels[a:b] == [IGNORE_INDEX] + doc.labels[1:]
    assert sorted(map(id, seen)) == sorted(map(id, examples))
    assert packed.lengths().tolist() == [len(s.input_ids) for s in packed]


def test_collate_packed_gives_positions_no_mask_and_counts_real_tokens():
    a = Example([5, 6, 7], [IGNORE_INDEX, 6, 7], [0, 1, 0])
    b = Example([8], [IGNORE_INDEX], [0])
    batch = collate([a, b], pad_id=0)
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [IGNORE_INDEX] * 3]
    # padding is a document of its own, after the real ones
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    assert input_tokens(batch) == 4
    assert set(model_inputs(batch)) == {"input_ids", "position_ids"}


def test_sampler_over_packed_sequences_keeps_world_size_invariance():
    packed = PackedExamples(docs(list(range(1, 40))), max_length=48)
    n = len(packed)
    for step in range(4):
        ref = sorted(i for m in GlobalBatchSampler(n, 2, 2, 1, 0, 1).microbatches(step) for i in m)
        split = sorted(i for r in range(2) for m in GlobalBatchSampler(n, 1, 2, 2, r, 1).microbatches(step) for i in m)
        assert split == ref


def test_packed_document_has_the_logits_it_has_alone(tiny_models):
    """The model's output for each document of a packed row equals its output run alone: positions
    restart and attention does not cross documents."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"), attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    examples = docs([7, 12, 5])
    packed = PackedExamples(examples, max_length=32)
    assert len(packed) == 1
    batch = collate([packed[0], Example([9, 10], [9, 10], [0, 1])], pad_id=0)  # a second, shorter row
    with torch.no_grad():
        logits = model(**model_inputs(batch), use_cache=False).logits
        seq = packed[0]
        starts = [i for i, p in enumerate(seq.position_ids) if p == 0] + [len(seq.input_ids)]
        for a, b in zip(starts, starts[1:]):
            alone = model(input_ids=torch.tensor([seq.input_ids[a:b]]), use_cache=False).logits[0]
            torch.testing.assert_close(logits[0, a:b], alone, atol=1e-5, rtol=1e-4)
        # Without the restarting positions the later documents would see the earlier ones: the check bites.
        plain = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]
        assert (plain[starts[1] : starts[2]] - logits[0, starts[1] : starts[2]]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ packing per epoch


def random_docs(n: int, seed: int = 0) -> list[Example]:
    """Documents of random lengths whose token ids say which document they are (the first token)."""
    rng = np.random.default_rng(seed)
    return [Example([i] + [7] * int(k - 1), [i] + [7] * int(k - 1)) for i, k in enumerate(rng.integers(2, 30, n))]


def documents_of(sequence: Example) -> tuple[int, ...]:
    """The documents packed into a sequence, by their first token."""
    return tuple(sequence.input_ids[i] for i, p in enumerate(sequence.position_ids) if p == 0)


def grouping(packed: PackedExamples, epoch: int) -> dict[int, frozenset[int]]:
    """Document -> the documents packed with it in `epoch`."""
    out = {}
    for i in range(len(packed)):
        docs = documents_of(packed.of_epoch(epoch)[i])
        out.update({d: frozenset(docs) for d in docs})
    return out


def test_each_epoch_packs_anew_and_every_packing_is_complete():
    packed = PackedExamples(random_docs(400), max_length=64, seed=5)
    assert packed.of_epoch(0)[3] == packed[3]  # epoch 0 is the plain packing
    groupings = [grouping(packed, epoch) for epoch in range(3)]
    for epoch, g in enumerate(groupings):
        assert sorted(g) == list(range(400)), epoch  # every document once
        assert all(len(packed.of_epoch(epoch)[i].input_ids) <= 64 for i in range(len(packed)))
    for a, b in [(0, 1), (1, 2), (0, 2)]:
        moved = np.mean([groupings[a][d] != groupings[b][d] for d in range(400)])
        assert moved > 0.5, (a, b, moved)  # most documents have other neighbours
    # A function of (documents, max_length, seed, epoch) alone: a fresh object agrees, another seed does not.
    assert grouping(PackedExamples(random_docs(400), 64, seed=5), 2) == groupings[2]
    assert grouping(PackedExamples(random_docs(400), 64, seed=6), 2) != groupings[2]


def sequences(packed: PackedExamples, sampler: GlobalBatchSampler, step: int) -> list[tuple[int, ...]]:
    epoch_data = for_epoch(packed, sampler.epoch_of(step))  # as the trainer reads it
    return [documents_of(epoch_data[i]) for m in sampler.microbatches(step) for i in m]


def test_packing_per_epoch_is_the_same_after_a_resume_and_at_any_world_size():
    docs = random_docs(300)
    packed = PackedExamples(docs, max_length=64, seed=9)
    sampler = GlobalBatchSampler(len(packed), 2, 2, 1, 0, seed=9)
    steps = 3 * sampler.steps_per_epoch
    run = [sequences(packed, sampler, s) for s in range(steps)]  # epochs 0, 1, 2 straight through
    per_epoch = [
        {seq for s in run[e * sampler.steps_per_epoch : (e + 1) * sampler.steps_per_epoch] for seq in s}
        for e in range(3)
    ]
    for sequences_of_epoch in per_epoch:  # every document once per epoch, less the incomplete last batch
        seen = [d for seq in sequences_of_epoch for d in seq]
        assert len(seen) == len(set(seen)) > 250
    assert len(per_epoch[0] & per_epoch[1]) < len(per_epoch[1]) / 2  # the trainer's path gets the new packing
    # Resumed in the middle of epoch 1 with fresh objects (a new process): the same sequences from there on.
    resumed = PackedExamples(docs, max_length=64, seed=9)
    start = sampler.steps_per_epoch + 2
    assert [sequences(resumed, GlobalBatchSampler(len(resumed), 2, 2, 1, 0, 9), s) for s in range(start, steps)] == (
        run[start:]
    )
    # Two ranks with the global batch unchanged: disjoint halves of the same sequences, epochs 1 and 2 too.
    for step in (1, sampler.steps_per_epoch + 1, steps - 1):
        ranks = [sequences(packed, GlobalBatchSampler(len(packed), 1, 2, 2, r, 9), step) for r in range(2)]
        assert not set(ranks[0]) & set(ranks[1])
        assert sorted(ranks[0] + ranks[1]) == sorted(run[step])
