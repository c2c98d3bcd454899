"""Preference data (train.objective other than sft): records to pairs of token rows, and views of pairs.

Records, each field a string or a list of {role, content} messages:

* pairs (dpo, ipo, orpo, simpo): ``prompt``, ``chosen``, ``rejected``. The prompt's turns are shared and the two
  completions are different final assistant turns. As in UltraFeedback binarized, ``chosen`` and ``rejected``
  may instead be whole conversations that repeat the prompt's turns; the prompt is then their shared turns
  before the last (a ``prompt`` field beside them is ignored).
* kto: ``prompt``, ``completion``, ``label`` (true: desirable).

Each record becomes two rows of the token store, rendered by the run's chat template with the prompt's tokens
untrained: (chosen, rejected), or for KTO (completion, empty) when desirable and (empty, completion) when not.
So the data pipeline (sources, weights, the held-out split, caching) handles pairs as it handles examples, and
`PairView` reads them back two rows at a time. A batch runs them as stored (`collate_pairs`), or under
pref.share_prompt as one row a pair, the prompt once, then both completions (`collate_shared_pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from qshard.attention import SHARED_ROWS, shared_row_indices
from qshard.data.batching import collate
from qshard.data.example import IGNORE_INDEX, Example
from qshard.data.formats import ROLES, string_field
from qshard.data.records import BadRecord, json_type
from qshard.data.store import ExampleView
from qshard.data.templates import Encoder

# The record layouts (tokenize.Options.format) of the preference objectives.
PAIRS, UNPAIRED = "preference", "kto"
PREFERENCE_FORMATS = (PAIRS, UNPAIRED)


def preference_format(objective: str) -> str | None:
    """The record layout train.objective reads, or None for sft (the SFT formats)."""
    return None if objective == "sft" else UNPAIRED if objective == "kto" else PAIRS


# --------------------------------------------------------------------------------------------------- records


def _messages(value: Any, name: str, where: str) -> list[dict[str, str]]:
    """A field as messages: a string is one turn (user for a prompt, assistant for a completion)."""
    if isinstance(value, str):
        return [{"role": "user" if name == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRecord(f"{where}: field '{name}' must be a string or a non-empty array of messages, got "
                        f"{json_type(value)}")
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise BadRecord(f"{where}: field '{name}[{i}]' must be an object, got {json_type(turn)}")
        role = string_field(turn, "role", f"{where}: {name}[{i}]")
        if role not in ROLES:
            raise BadRecord(f"{where}: field '{name}[{i}].role': unknown role {role!r} (expected one of "
                            f"{', '.join(ROLES)})")
        out.append({"role": role, "content": string_field(turn, "content", f"{where}: {name}[{i}]")})
    return out


def _completion(turns: list[dict[str, str]], name: str, where: str) -> list[dict[str, str]]:
    if turns[-1]["role"] != "assistant":
        raise BadRecord(f"{where}: field '{name}' does not end with an assistant turn, so nothing in it is trained")
    return turns


def _prompt(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    if record.get("prompt") in (None, "", []):
        raise BadRecord(f"{where}: no prompt: field 'prompt' is missing or empty")
    prompt = _messages(record["prompt"], "prompt", where)
    if prompt[-1]["role"] == "assistant":
        raise BadRecord(f"{where}: field 'prompt' ends with an assistant turn; the completion is the assistant's")
    return prompt


def pair_messages(record: dict[str, Any], where: str) -> tuple[list, list, list]:
    """(prompt turns, chosen turns, rejected turns) of a pair record, or a BadRecord saying what is wrong."""
    for name in ("chosen", "rejected"):
        if name not in record:
            raise BadRecord(f"{where}: missing field '{name}'")
    chosen = _messages(record["chosen"], "chosen", where)
    rejected = _messages(record["rejected"], "rejected", where)
    if chosen[0]["role"] != "assistant" and rejected[0]["role"] != "assistant":  # whole conversations
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
            raise BadRecord(f"{where}: 'chosen' and 'rejected' are whole conversations whose turns before the last "
                            "differ (or hold no prompt turn), so they share no prompt")
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    else:
        prompt = _prompt(record, where)
    chosen, rejected = _completion(chosen, "chosen", where), _completion(rejected, "rejected", where)
    if chosen == rejected:
        raise BadRecord(f"{where}: 'chosen' and 'rejected' are identical, so the pair prefers nothing")
    return prompt, chosen, rejected


def kto_messages(record: dict[str, Any], where: str) -> tuple[list, list, bool]:
    """(prompt turns, completion turns, desirable) of a KTO record."""
    if "completion" not in record:
        raise BadRecord(f"{where}: missing field 'completion'")
    label = record.get("label")
    if not isinstance(label, bool):
        raise BadRecord(f"{where}: field 'label' must be true (desirable) or false, got {json_type(label)}")
    completion = _completion(_messages(record["completion"], "completion", where), "completion", where)
    return _prompt(record, where), completion, label


# ------------------------------------------------------------------------------------------------- encoding


def _tokens(encoder: Encoder, prompt: list, completion: list, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) as the chat template renders the conversation; the completion is what
    rendering it adds after the prompt with the assistant's turn opened (with the eos the encoder appends)."""
    prompt_ids = encoder.generation_prompt(prompt, where)
    ids, _ = encoder._conversation(prompt + completion, where)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise BadRecord(f"{where}: the chat template is not prefix-consistent (the prompt's rendering is not a token "
                        "prefix of the conversation's), so the completion cannot be located")
    return prompt_ids, ids[len(prompt_ids):]


def cut_prompt(ids: list[int], keep: int, bos_id: int | None) -> list[int]:
    """The prompt's last `keep` tokens, its bos kept first."""
    if len(ids) <= keep:
        return ids
    if bos_id is not None and ids and ids[0] == bos_id:
        return [bos_id] + ids[len(ids) - keep + 1:]
    return ids[len(ids) - keep:]


def prompt_room(opts: Any, longest_completion: int) -> int:
    """Prompt tokens kept: pref.max_prompt_length; empty, as many as the longest completion leaves of
    data.max_length, but at least half of it (a long prompt would otherwise leave its completions a token
    or two, which compare nothing)."""
    if opts.max_prompt_length:
        return min(opts.max_prompt_length, opts.max_length - 1)
    return max(opts.max_length - longest_completion, opts.max_length // 2)


def encode_preference(encoder: Encoder, opts: Any, fmt: str, record: dict[str, Any], where: str) -> tuple:
    """One record's outcome: ("rows", [(ids, labels), (ids, labels)], truncated) or ("overlong",). The prompt is
    cut to pref.max_prompt_length (its end kept), then each completion to what data.max_length leaves."""
    if fmt == PAIRS:
        prompt, *completions = pair_messages(record, where)
        desirable = None
    else:
        prompt, completion, desirable = kto_messages(record, where)
        completions = [completion]
    encoded = [_tokens(encoder, prompt, c, where) for c in completions]
    prompt_ids = encoded[0][0]
    cut = cut_prompt(prompt_ids, prompt_room(opts, max(len(c) for _, c in encoded)), encoder.bos_id)
    room = opts.max_length - len(cut)
    truncated = len(cut) < len(prompt_ids) or any(len(c) > room for _, c in encoded)
    if truncated and opts.overlong == "drop":
        return ("overlong",)
    kept = [c[:room] for _, c in encoded]
    if desirable is None and kept[0] == kept[1]:
        raise BadRecord(f"{where}: 'chosen' and 'rejected' are identical in their first {room} tokens, all that "
                        f"data.max_length {opts.max_length} leaves them after the prompt, so the pair prefers nothing")
    rows = [_row(cut, c) for c in kept]
    if desirable is not None:
        empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
        rows = [rows[0], empty] if desirable else [empty, rows[0]]
    return ("rows", rows, truncated)


def _row(prompt: list[int], completion: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = prompt + completion
    labels = [IGNORE_INDEX] * len(prompt) + completion
    return np.asarray(ids, np.int32), np.asarray(labels, np.int32)


# ---------------------------------------------------------------------------------------------------- views


class Pair(NamedTuple):
    """A record's two rows (KTO: one of them empty), with their precomputed reference log-probs where there are."""

    chosen: Example
    rejected: Example
    ref_chosen: float | None = None
    ref_rejected: float | None = None


class PairView(Sequence):
    """Pairs read from stores of rows, two rows a pair: (chosen, rejected), or KTO's (desirable, undesirable) with
    one of the two empty. Selects, repeats and joins as ExampleView does, pair by pair."""

    def __init__(self, rows: ExampleView):
        assert len(rows) % 2 == 0, "a preference store holds two rows per record"
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, i: int) -> Pair:
        return Pair(self.rows[2 * i], self.rows[2 * i + 1], self._reference(2 * i), self._reference(2 * i + 1))

    def _reference(self, row: int) -> float | None:
        store, j = self.rows.refs[row]
        reference = self.rows.stores[store].reference
        return None if reference is None else float(reference[j])

    def lengths(self) -> np.ndarray:
        return self.rows.lengths().reshape(-1, 2).sum(axis=1)

    def longest_row(self) -> int:
        """The most positions one forward row uses: the longer of a pair's rows (a shared row's rejected tokens
        take their positions from where the prompt ends)."""
        lengths = self.rows.lengths()
        return int(lengths.max()) if len(lengths) else 0

    def subset(self, indices: Sequence[int] | np.ndarray) -> PairView:
        pairs = np.asarray(indices, dtype=np.int64).reshape(-1, 1)
        return PairView(self.rows.subset((2 * pairs + np.arange(2)).reshape(-1)))

    @staticmethod
    def concat(views: list[PairView]) -> PairView:
        return PairView(ExampleView.concat([v.rows for v in views]))

    def completions(self) -> ExampleView:
        """Each pair's first non-empty row (the chosen one, or KTO's completion): its prompt samples the model."""
        lengths = self.rows.lengths().reshape(-1, 2)
        return self.rows.subset(2 * np.arange(len(self)) + (lengths[:, 0] == 0))


def collate_pairs(pairs: list[Pair], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch for one forward: every pair's chosen row, then every rejected one (KTO's empty rows left out).
    Each row is a sequence whose log-prob the objective compares, and the keys the trainer reads are per sequence,
    in that order (chosen ones, then rejected ones): the sequences of the chosen and of the rejected completions
    (`chosen_sequences`, `rejected_sequences`), the sequence of each trained position (`loss_sequences`, in
    `loss_positions` order), each sequence's trained-token count (`sequence_tokens`), and where they were
    precomputed, each sequence's reference log-prob (`ref_logps`)."""
    chosen = [p for p in pairs if p.chosen.input_ids]
    rejected = [p for p in pairs if p.rejected.input_ids]
    batch = collate([p.chosen for p in chosen] + [p.rejected for p in rejected], pad_id)
    _references(batch, pairs, chosen, rejected)
    _trained_rows(batch)
    batch["chosen_sequences"] = torch.arange(len(chosen))
    batch["rejected_sequences"] = torch.arange(len(chosen), len(chosen) + len(rejected))
    return batch


def _references(batch: dict[str, torch.Tensor], pairs: list[Pair], chosen: list[Pair], rejected: list[Pair]) -> None:
    if pairs[0].ref_chosen is not None:
        references = [p.ref_chosen for p in chosen] + [p.ref_rejected for p in rejected]
        batch["ref_logps"] = torch.tensor(references, dtype=torch.float32)


def _trained_rows(batch: dict[str, torch.Tensor]) -> None:
    """Each row one sequence: the sequence of each trained position and each sequence's trained-token count."""
    trained = batch["labels"][:, 1:] != IGNORE_INDEX
    batch["loss_sequences"] = trained.flatten().nonzero().squeeze(1) // trained.shape[1]
    batch["sequence_tokens"] = trained.sum(dim=1).clamp(min=1).float()


# The completions of a shared row (collate_shared_pairs).
CHOSEN, REJECTED = range(2)


def collate_shared_pairs(pairs: list[Pair], pad_id: int) -> dict[str, torch.Tensor]:
    """pref.share_prompt's batch of pairs (dpo, ipo, orpo, simpo): one row a pair, its prompt, chosen and rejected
    tokens in a row (right-padded to the longest), so the prompt is computed once. The rejected tokens' positions
    restart where the prompt ends; they see the prompt and the earlier rejected tokens, never the chosen ones,
    through the two causal attentions of each row whose token indices the batch carries (`SHARED_ROWS`,
    attention.py) instead of an attention mask (the model gets a placeholder, data/batching.py model_inputs). What a
    row trains is explicit: `loss_positions`, flat indices into [pairs x L], are the hidden states that predict
    `loss_targets` (the first rejected token is predicted by the prompt's last position, as the first chosen token
    is). The sequences and their keys are collate_pairs': every pair's chosen, then every pair's rejected."""
    parts = [_shared_row(pair) for pair in pairs]
    n, width = len(pairs), max(len(ids) for ids, *_ in parts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    # Padding at position 0: a shared row is longer than any position its tokens use, and a position beyond
    # them would reach rope scalings that grow with the largest position given (dynamic NTK).
    position_ids = torch.zeros((n, width), dtype=torch.long)
    positions, targets, sequences = [], [], []
    for row, (ids, position, loss, _) in enumerate(parts):
        length = len(ids)
        input_ids[row, :length] = torch.as_tensor(ids)
        position_ids[row, :length] = torch.as_tensor(position)
        for part, sequence in ((CHOSEN, row), (REJECTED, n + row)):
            where, target = loss[part]
            positions.append(torch.as_tensor(where) + row * width)
            targets.append(torch.as_tensor(target))
            sequences.append(torch.full((len(target),), sequence, dtype=torch.long))
    sequence = torch.cat(sequences)
    batch = {"input_ids": input_ids, "position_ids": position_ids,
             "num_tokens": torch.tensor(sum(len(ids) for ids, *_ in parts), dtype=torch.long),
             "loss_positions": torch.cat(positions).long(), "loss_targets": torch.cat(targets).long(),
             "loss_sequences": sequence,
             "sequence_tokens": torch.bincount(sequence, minlength=2 * n).clamp(min=1).float(),
             "chosen_sequences": torch.arange(n), "rejected_sequences": torch.arange(n, 2 * n),
             SHARED_ROWS: shared_row_indices([sizes for *_, sizes in parts], width)}
    _references(batch, pairs, pairs, pairs)
    return batch


def _shared_row(pair: Pair) -> tuple:
    """(ids, position of each, {CHOSEN: (predicting positions, targets), REJECTED: ...}, (prompt,
    chosen, rejected) token counts) of a pair's shared row: its prompt, then the chosen row's completion, then the
    rejected row's."""
    prompt = _prompt_length(pair.chosen)
    chosen, rejected = np.asarray(pair.chosen.input_ids), np.asarray(pair.rejected.input_ids)
    assert prompt >= 1 and prompt == _prompt_length(pair.rejected), "a pair's rows start with the same prompt"
    assert np.array_equal(chosen[:prompt], rejected[:prompt]), "a pair's rows start with the same prompt"
    c, r = len(chosen) - prompt, len(rejected) - prompt
    ids = np.concatenate([chosen, rejected[prompt:]])
    position = np.concatenate([np.arange(prompt + c), np.arange(prompt, prompt + r)])
    # Each completion token is predicted by the position before it in its own sequence: the first one by the
    # prompt's last position, the others by the completion's own.
    chosen_from = np.arange(prompt - 1, prompt + c - 1)
    rejected_from = np.concatenate([[prompt - 1], np.arange(prompt + c, prompt + c + r - 1)])[:r]
    loss = {CHOSEN: (chosen_from, chosen[prompt:]), REJECTED: (rejected_from, rejected[prompt:])}
    return ids, position, loss, (prompt, c, r)


# The keys of collate_kto's mismatched rows beside the batch's own.
MISMATCHED = "kl."


def collate_kto(pairs: list[Pair], pad_id: int) -> dict[str, torch.Tensor]:
    """collate_pairs' batch of KTO examples, with beside it (keys prefixed `kl.`) the mismatched rows its reference
    point is estimated from: each example's prompt followed by the next example's completion (the last's by the
    first's), the prompt untrained, cut to the batch's longest row. `kl.weight` is 0 for a row that compares
    nothing (a batch of one example, or a prompt that leaves the completion no room), which is then still run so
    that every rank runs the same forwards."""
    batch = collate_pairs(pairs, pad_id)
    rows = [r for p in pairs for r in (p.chosen, p.rejected) if len(r.input_ids)]
    width = max(len(r.input_ids) for r in rows)
    mismatched, weights = [], []
    for i, row in enumerate(rows):
        other = rows[(i + 1) % len(rows)]
        prompt = _prompt_length(row)
        completion = list(other.input_ids[_prompt_length(other):])[: width - prompt]
        if len(rows) < 2 or not completion:
            mismatched.append(row)
            weights.append(0.0)
            continue
        ids = list(row.input_ids[:prompt]) + completion
        mismatched.append(Example(ids, [IGNORE_INDEX] * prompt + completion))
        weights.append(1.0)
    kl = collate(mismatched, pad_id)
    _trained_rows(kl)
    kl["loss_positions"] = (kl["labels"][:, 1:] != IGNORE_INDEX).flatten().nonzero().squeeze(1)
    if bool(kl["attention_mask"].all()):  # as the trainer leaves out the batch's own (no padding to mask)
        del kl["attention_mask"]
    kl["weight"] = torch.tensor(weights)
    batch.update({MISMATCHED + k: v for k, v in kl.items()})
    return batch


def _prompt_length(row: Example) -> int:
    """The untrained tokens a row starts with: its prompt."""
    trained = np.flatnonzero(np.asarray(row.labels) != IGNORE_INDEX)
    return int(trained[0]) if len(trained) else len(row.labels)


def mismatched_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """collate_kto's mismatched rows as a batch of their own."""
    return {k[len(MISMATCHED):]: v for k, v in batch.items() if k.startswith(MISMATCHED)}
