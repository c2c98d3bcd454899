"""Rendering records to token ids and loss labels: chat templates and the encoder that uses them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jinja2

from qshard.data.example import IGNORE_INDEX
from qshard.data.formats import to_messages, to_text
from qshard.data.records import BadRecord
from qshard.errors import QShardError

# Built-in templates, for tokenizers that have none (typical of base models). Separators precede turns
# rather than follow them, so an assistant turn ends exactly at its end-of-turn text. Each opens with the bos
# the encoder puts first anyway, so that an export's template renders what training trained on.
ALPACA = (
    "{{- bos_token -}}"
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
CHATML = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
BUILTIN_TEMPLATES = {"alpaca": ALPACA, "chatml": CHATML}
TEMPLATE_CHOICES = ("auto", "tokenizer", *BUILTIN_TEMPLATES)
TRAIN_ON = ("assistant", "all")
# With the Alpaca template the input gets its own section inside the user turn.
INPUT_SEPARATORS = {"alpaca": "\n\n### Input:\n"}
DEFAULT_INPUT_SEPARATOR = "\n\n"


def choose_template(tokenizer: Any, name: str) -> tuple[str | None, str]:
    """(template to pass to apply_chat_template, None for the tokenizer's own; its name)."""
    if name not in TEMPLATE_CHOICES:
        choices = ", ".join(TEMPLATE_CHOICES)
        raise QShardError(f"data.chat_template: unknown template {name!r} (expected one of {choices})")
    own = getattr(tokenizer, "chat_template", None)
    if name == "tokenizer" and not own:
        raise QShardError("data.chat_template: 'tokenizer' asked for, but the tokenizer has no chat template")
    if name in ("auto", "tokenizer"):
        return (None, "tokenizer") if own else (ALPACA, "alpaca")
    return BUILTIN_TEMPLATES[name], name


class Encoder:
    """Record -> (input_ids, labels). Only assistant turns (and the eos that ends them) are trained unless
    ``train_on == "all"``; plain text is trained everywhere."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str = "auto",
        train_on: str = "assistant",
        columns: Mapping[str, str | None] | None = None,
    ):
        if train_on not in TRAIN_ON:
            raise QShardError(f"data.train_on: must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.tokenizer = tokenizer
        self.template, self.template_name = choose_template(tokenizer, chat_template)
        self.input_separator = INPUT_SEPARATORS.get(self.template_name, DEFAULT_INPUT_SEPARATOR)
        self.train_on = train_on
        self.columns = dict(columns or {})
        self.bos_id = tokenizer.bos_token_id if tokenizer.bos_token is not None else None
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token is not None else None

    def encode(self, record: dict[str, Any], fmt: str, where: str) -> tuple[list[int], list[int]]:
        if fmt == "text":
            return self._text(to_text(record, where, self.columns))
        ids, labels = self._conversation(to_messages(record, fmt, where, self.columns, self.input_separator), where)
        return ids, (list(ids) if self.train_on == "all" else labels)

    def _text(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.bos_id is not None:
            ids = [self.bos_id] + ids
        if self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids, list(ids)

    def _tokens(self, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as e:
            raise BadRecord(f"{where}: the chat template rejected this record: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generation_prompt(self, messages: list[dict[str, str]], where: str) -> list[int]:
        """The ids a model is given to answer `messages`: rendered as training renders them, with the
        assistant's turn opened, and the bos first as training puts it."""
        ids = self._tokens(messages, True, where)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def _conversation(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
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


# Encoded as training encodes a record, to find what ends a trained answer; each content ends in a plain word.
END_PROBES = {
    "chat": {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]},
    "text": {"text": "Hello"},
}


def end_of_turn_ids(encoder: Encoder, fmt: str) -> list[int]:
    """The ids a trained answer ends with, where generation should stop: the single added tokens (e.g.
    <|im_end|>, <|eot_id|>) that follow an answer's content in what the encoder trains on, which includes
    the eos it appends when the template emits none. Found by encoding a probe record of `fmt` (chat, or
    text for a plain-text run) and reading its trained tokens back from the end, past whitespace."""
    try:
        _, labels = encoder.encode(END_PROBES[fmt], fmt, "the end-of-turn probe conversation")
    except BadRecord as e:
        raise QShardError(f"data.chat_template: cannot find the end-of-turn tokens: {e}") from None
    added = encoder.tokenizer.added_tokens_decoder
    ends: list[int] = []
    for token in reversed([t for t in labels if t != IGNORE_INDEX]):
        if token in added:
            if added[token].content.strip():
                ends.append(token)
        elif encoder.tokenizer.decode([token]).strip():
            break  # the answer's own text: what precedes it is not the turn's end
    return ends[::-1]
