"""Batches: the held-out split, which examples each rank takes for each step, and collation."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qshard.attention import SHARED_ROWS, mask_placeholder
from qshard.data.example import IGNORE_INDEX, Example
from qshard.errors import QShardError


def split_held_out(
    examples: Sequence[Example], fraction: float, seed: int
) -> tuple[Sequence[Example], Sequence[Example]]:
    """Split into (train, held_out), with ``fraction`` of the examples held out; deterministic in ``seed``.

    At least one example is held out when fraction > 0 and there are two or more, and at least one is
    always left for training. Both lists keep the input order.
    """
    if not 0.0 <= fraction < 1.0:
        raise QShardError(f"eval_fraction option: must be in [0, 1), got {fraction}")
    n = len(examples)
    n_held = round(n * fraction)
    if fraction > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_held])
    train = [i for i in range(n) if i not in held]
    held_out = sorted(held)
    return _take(examples, train), _take(examples, held_out)


def _take(examples: Sequence[Example], indices: list[int]) -> Sequence[Example]:
    if hasattr(examples, "subset"):  # an on-disk view stays a view
        return examples.subset(indices)
    return [examples[i] for i in indices]


class GlobalBatchSampler:
    """Which examples each rank uses for each optimizer step.

    Epoch ``e`` shuffles all examples with seed ``seed + e``; global step ``s`` of the epoch is the
    ``s``-th run of G = micro_batch_size * grad_accum * world_size indices (the incomplete tail is
    dropped). Rank ``r`` takes the ``r``-th contiguous block of micro_batch_size * grad_accum of them,
    split into ``grad_accum`` micro-batches. So the examples of a step depend only on G, not on how G is
    factored into ranks and accumulation: a run can change GPU count and keep the same data order.
    Data whose items depend on the epoch (packing is redone each epoch) is read through
    `for_epoch(examples, sampler.epoch_of(step))`, so a resumed run gets what it would have got.
    """

    def __init__(
        self, num_examples: int, micro_batch_size: int, grad_accum: int, world_size: int, rank: int, seed: int
    ):
        sizes = {"micro_batch_size": micro_batch_size, "grad_accum": grad_accum, "world_size": world_size}
        for name, value in sizes.items():
            if value < 1:
                raise QShardError(f"{name} option: must be at least 1, got {value}")
        if not 0 <= rank < world_size:
            raise QShardError(f"rank {rank} is outside world_size {world_size}")
        self.num_examples = num_examples
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.global_batch_size = micro_batch_size * grad_accum * world_size
        if num_examples < self.global_batch_size:
            raise QShardError(
                f"only {num_examples} training examples, but one optimizer step needs at least "
                f"{self.global_batch_size} (micro_batch_size={micro_batch_size} x grad_accum={grad_accum} "
                f"x world_size={world_size}); add data or reduce micro_batch_size/grad_accum"
            )
        self._cached: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the data."""
        return self.num_examples // self.global_batch_size

    def _permutation(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._cached = (epoch, torch.randperm(self.num_examples, generator=generator).tolist())
        return self._cached[1]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def microbatches(self, step: int) -> list[list[int]]:
        """This rank's example indices for global optimizer step ``step`` (counted across epochs).

        Returns ``grad_accum`` lists of ``micro_batch_size`` indices each.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, self.steps_per_epoch)
        per_rank = self.micro_batch_size * self.grad_accum
        start = index * self.global_batch_size + self.rank * per_rank
        mine = self._permutation(epoch)[start : start + per_rank]
        mbs = self.micro_batch_size
        return [mine[i * mbs : (i + 1) * mbs] for i in range(self.grad_accum)]


def for_epoch(examples: Sequence[Example], epoch: int) -> Sequence[Example]:
    """The examples as epoch `epoch` sees them: packed data is packed anew each epoch, the rest is fixed."""
    return examples.of_epoch(epoch) if hasattr(examples, "of_epoch") else examples


def collate(examples: list[Example], pad_id: int, width: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest example (or to `width` tokens, if longer); padding is masked out of
    attention and loss.

    Packed examples (with position_ids) give position_ids and no attention_mask: transformers then
    masks attention between the documents of a row. Their padding is one more document at the end of
    a row, which no real token can see under the causal mask, and `num_tokens` counts the real ones."""
    assert examples, "collate needs at least one example"
    packed = examples[0].position_ids is not None
    width = max(width, *(len(e.input_ids) for e in examples))
    shape = (len(examples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    mask_or_positions = torch.arange(width).repeat(len(examples), 1) if packed else torch.zeros(shape, dtype=torch.long)
    for row, example in enumerate(examples):
        assert len(example.input_ids) == len(example.labels), "input_ids and labels differ in length"
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(example.labels, dtype=torch.long)
        if packed:
            mask_or_positions[row, :n] = torch.tensor(example.position_ids, dtype=torch.long)
            mask_or_positions[row, n:] -= n
        else:
            mask_or_positions[row, :n] = 1
    if packed:
        num_tokens = torch.tensor(sum(len(e.input_ids) for e in examples), dtype=torch.long)
        return {"input_ids": input_ids, "labels": labels, "position_ids": mask_or_positions, "num_tokens": num_tokens}
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask_or_positions}


def input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Input tokens of a collated batch, padding excluded: counted by the batches whose attention mask does not
    say it (packed rows, pref.share_prompt's)."""
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    return int(batch["attention_mask"].sum())


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments from a collated batch: its tokens' embedding rows where the batch has them
    (model.embedding_on_host: looked up on the host, host_embedding.py), else its token ids; a shared preference
    batch's rows among them (pref.share_prompt), with a placeholder of no memory for its attention mask."""
    tokens = "inputs_embeds" if "inputs_embeds" in batch else "input_ids"
    inputs = {k: batch[k] for k in (tokens, "attention_mask", "position_ids", SHARED_ROWS) if k in batch}
    if SHARED_ROWS in batch:
        inputs["attention_mask"] = mask_placeholder(batch[tokens])
    return inputs
