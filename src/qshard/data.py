"""Training data: JSONL records -> token ids with loss labels, and the batch order for data parallelism.

Two record formats are accepted, one per file:

* instruction: ``{"instruction": str, "input": str (optional), "output": str}``
* chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``

Only assistant text (and the eos that ends it) is trained on; every other position gets IGNORE_INDEX.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch

from qshard.errors import QShardError

IGNORE_INDEX = -100
FORMATS = ("auto", "instruction", "chat")
ROLES = ("system", "user", "assistant")

logger = logging.getLogger("qshard")

# Used when the tokenizer has no chat template (typical of base models): the Alpaca layout. Separators
# precede turns rather than follow them, so an assistant turn ends exactly at its eos.
BUILTIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ '### Instruction:\\n' + message['content'] }}"
    "{%- else -%}{{ '### Response:\\n' + message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages -%}{{ '\\n\\n' }}{%- endif -%}{{ '### Response:\\n' }}"
    "{%- endif -%}"
)
# With the built-in template the input gets its own Alpaca section inside the user turn.
BUILTIN_INPUT_SEPARATOR = "\n\n### Input:\n"
CHAT_INPUT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX where the token is not trained on


# ---------------------------------------------------------------------------------------------- reading


def _read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Return (1-based line number, record) for every non-blank line of a JSONL file."""
    if not path.exists():
        raise QShardError(f"{path}: data file not found")
    if not path.is_file():
        raise QShardError(f"{path}: data path is not a regular file")
    records = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise QShardError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise QShardError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(record, dict):
                raise QShardError(f"{where}: a record must be a JSON object, got {_json_type(record)}")
            records.append((lineno, record))
    return records


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _detect_format(record: dict[str, Any], where: str) -> str:
    if "messages" in record:
        return "chat"
    if "instruction" in record:
        return "instruction"
    raise QShardError(
        f"{where}: cannot tell the data format: the record has neither 'messages' (chat format) "
        "nor 'instruction' (instruction format)"
    )


def _string_field(record: dict[str, Any], name: str, where: str, optional: bool = False) -> str:
    if name not in record or (optional and record[name] is None):
        if optional:
            return ""
        raise QShardError(f"{where}: missing field '{name}'")
    value = record[name]
    if not isinstance(value, str):
        raise QShardError(f"{where}: field '{name}' must be a string, got {_json_type(value)}")
    return value


def _instruction_messages(record: dict[str, Any], where: str, builtin: bool) -> list[dict[str, str]]:
    instruction = _string_field(record, "instruction", where)
    extra = _string_field(record, "input", where, optional=True)
    output = _string_field(record, "output", where)
    if extra:
        instruction += (BUILTIN_INPUT_SEPARATOR if builtin else CHAT_INPUT_SEPARATOR) + extra
    return [{"role": "user", "content": instruction}, {"role": "assistant", "content": output}]


def _chat_messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "messages" not in record:
        raise QShardError(f"{where}: missing field 'messages'")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise QShardError(f"{where}: field 'messages' must be a non-empty array of {{role, content}} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise QShardError(f"{where}: field 'messages[{i}]' must be an object, got {_json_type(message)}")
        role = _string_field(message, "role", f"{where}: messages[{i}]")
        if role not in ROLES:
            raise QShardError(
                f"{where}: field 'messages[{i}].role': unknown role {role!r} "
                f"(expected one of {', '.join(ROLES)})"
            )
        content = _string_field(message, "content", f"{where}: messages[{i}]")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise QShardError(f"{where}: the conversation has no assistant turn, so nothing in it is trained")
    return checked


# ------------------------------------------------------------------------------------------- tokenizing


class _Encoder:
    """Renders conversations with a chat template and labels the assistant tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.builtin = not getattr(tokenizer, "chat_template", None)
        self.template = BUILTIN_CHAT_TEMPLATE if self.builtin else None
        self.bos_id = tokenizer.bos_token_id if tokenizer.bos_token is not None else None
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token is not None else None

    def _tokens(self, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as e:
            raise QShardError(f"{where}: the chat template rejected this record: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        """Return (input_ids, labels) for a whole conversation."""
        ids = self._tokens(messages, False, where)
        labels = [IGNORE_INDEX] * len(ids)
        last_start = None
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # The turn's tokens are what rendering it adds after the generation prompt that precedes it;
            # that is only well defined if each render is a token prefix of the next.
            prompt = self._tokens(messages[:i], True, where)
            turn = ids if i == len(messages) - 1 else self._tokens(messages[: i + 1], False, where)
            if turn[: len(prompt)] != prompt or ids[: len(turn)] != turn:
                raise QShardError(
                    f"{where}: the chat template is not prefix-consistent (rendering the first {i} messages "
                    "is not a token prefix of rendering more), so the assistant tokens cannot be located"
                )
            labels[len(prompt) : len(turn)] = turn[len(prompt) :]
            last_start = len(prompt)
        ends_with_answer = messages[-1]["role"] == "assistant"
        if ends_with_answer and self.eos_id is not None and self.eos_id not in ids[last_start:]:
            # The model must learn to stop: make sure the final response ends with a trained eos.
            ids, labels = ids + [self.eos_id], labels + [self.eos_id]
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids, labels = [self.bos_id] + ids, [IGNORE_INDEX] + labels
        return ids, labels


# ----------------------------------------------------------------------------------------------- public


def load_examples(path: str | Path, tokenizer: Any, max_length: int, fmt: str = "auto") -> list[Example]:
    """Read a JSONL file of instruction or chat records and tokenize it into truncated Examples.

    ``fmt`` is "instruction", "chat" or "auto" (decided by the first record, then required of all).
    Examples with no trained token left after truncation to ``max_length`` are dropped with a warning.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise QShardError(
            f"data format option: unknown format {fmt!r} for {path} (expected one of {', '.join(FORMATS)})"
        )
    if not isinstance(max_length, int) or max_length < 1:
        raise QShardError(f"max_length option: must be a positive integer, got {max_length!r} ({path})")
    records = _read_records(path)
    if not records:
        raise QShardError(f"{path}: the data file has no records")
    if fmt == "auto":
        fmt = _detect_format(records[0][1], f"{path}:{records[0][0]}")
    encoder = _Encoder(tokenizer)
    examples = []
    for lineno, record in records:
        where = f"{path}:{lineno}"
        if fmt == "chat":
            messages = _chat_messages(record, where)
        else:
            messages = _instruction_messages(record, where, encoder.builtin)
        ids, labels = encoder.encode(messages, where)
        example = Example(ids[:max_length], labels[:max_length])
        if any(label != IGNORE_INDEX for label in example.labels):
            examples.append(example)
    dropped = len(records) - len(examples)
    if not examples:
        raise QShardError(
            f"{path}: no usable examples: all {len(records)} lose every trained token when truncated to "
            f"max_length={max_length}"
        )
    if dropped:
        logger.warning(
            "%s: dropped %d of %d examples that have no trained token left after truncation to max_length=%d",
            path, dropped, len(records), max_length,
        )
    return examples


def split_held_out(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
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
    train = [e for i, e in enumerate(examples) if i not in held]
    held_out = [e for i, e in enumerate(examples) if i in held]
    return train, held_out


class GlobalBatchSampler:
    """Which examples each rank uses for each optimizer step.

    Epoch ``e`` shuffles all examples with seed ``seed + e``; global step ``s`` of the epoch is the
    ``s``-th run of G = micro_batch_size * grad_accum * world_size indices (the incomplete tail is
    dropped). Rank ``r`` takes the ``r``-th contiguous block of micro_batch_size * grad_accum of them,
    split into ``grad_accum`` micro-batches. So the examples of a step depend only on G, not on how G is
    factored into ranks and accumulation: a run can change GPU count and keep the same data order.
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


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest example; padding is masked out of attention and loss."""
    assert examples, "collate needs at least one example"
    width = max(len(e.input_ids) for e in examples)
    shape = (len(examples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, example in enumerate(examples):
        assert len(example.input_ids) == len(example.labels), "input_ids and labels differ in length"
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(example.labels, dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
