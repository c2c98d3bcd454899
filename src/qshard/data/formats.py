"""Record formats: what a record's fields mean, turned into a conversation or a plain text.

* instruction (Alpaca): ``instruction``, ``input`` (optional), ``output``
* chat (OpenAI style): ``messages``: [{``role``: system | user | assistant, ``content``}]
* sharegpt: ``conversations``: [{``from``: system | human | gpt, ``value``}]
* text (continued pre-training): ``text``

A column mapping renames fields: ``{"instruction": "question"}`` reads the instruction from ``question``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qshard.data.records import BadRecord, json_type

FORMATS = ("auto", "instruction", "chat", "sharegpt", "text")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# The field whose presence tells each format apart, in the order auto-detection tries them.
MARKERS = {"chat": "messages", "sharegpt": "conversations", "instruction": "instruction", "text": "text"}


def field_name(columns: Mapping[str, str | None], name: str) -> str:
    return columns.get(name) or name


def detect_format(record: dict[str, Any], where: str, columns: Mapping[str, str | None]) -> str:
    for fmt, marker in MARKERS.items():
        if field_name(columns, marker) in record:
            return fmt
    expected = ", ".join(f"'{field_name(columns, m)}' ({f})" for f, m in MARKERS.items())
    raise BadRecord(f"{where}: cannot tell the data format: the record has none of the fields {expected}")


def to_messages(
    record: dict[str, Any], fmt: str, where: str, columns: Mapping[str, str | None], input_separator: str
) -> list[dict[str, str]]:
    """A conversation for the instruction, chat and sharegpt formats."""
    if fmt == "instruction":
        return _instruction(record, where, columns, input_separator)
    if fmt == "chat":
        return _turns(record, where, field_name(columns, "messages"), "role", "content", {r: r for r in ROLES})
    return _turns(record, where, field_name(columns, "conversations"), "from", "value", SHAREGPT_ROLES)


def to_text(record: dict[str, Any], where: str, columns: Mapping[str, str | None]) -> str:
    return string_field(record, field_name(columns, "text"), where)


def string_field(record: dict[str, Any], name: str, where: str, optional: bool = False) -> str:
    if name not in record or (optional and record[name] is None):
        if optional:
            return ""
        raise BadRecord(f"{where}: missing field '{name}'")
    value = record[name]
    if not isinstance(value, str):
        raise BadRecord(f"{where}: field '{name}' must be a string, got {json_type(value)}")
    return value


def _instruction(record, where, columns, input_separator) -> list[dict[str, str]]:
    instruction = string_field(record, field_name(columns, "instruction"), where)
    extra = string_field(record, field_name(columns, "input"), where, optional=True)
    output = string_field(record, field_name(columns, "output"), where)
    if extra:
        instruction += input_separator + extra
    return [{"role": "user", "content": instruction}, {"role": "assistant", "content": output}]


def _turns(record, where, name, role_key, content_key, roles: dict[str, str]) -> list[dict[str, str]]:
    if name not in record:
        raise BadRecord(f"{where}: missing field '{name}'")
    turns = record[name]
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{where}: field '{name}' must be a non-empty array of {{{role_key}, {content_key}}} objects")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"{where}: field '{name}[{i}]' must be an object, got {json_type(turn)}")
        role = string_field(turn, role_key, f"{where}: {name}[{i}]")
        if role not in roles:
            raise BadRecord(
                f"{where}: field '{name}[{i}].{role_key}': unknown role {role!r} (expected one of {', '.join(roles)})"
            )
        content = string_field(turn, content_key, f"{where}: {name}[{i}]")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(f"{where}: the conversation has no assistant turn, so nothing in it is trained")
    return messages
