"""Reading records from data files: JSONL, JSON (an array of objects), Parquet, CSV, Hugging Face datasets
(`.arrow` files, `save_to_disk` directories; see hf.py), or a directory of them.

Every record comes with where it was found (``file:line`` or ``file:row``), so that an error can name it.
Every kind streams: JSONL and CSV line by line, a JSON array record by record, Parquet and Arrow batch by
batch, so a file larger than RAM goes through in bounded memory. A JSONL line is handed on undecoded
(bytes), so that decoding happens where the tokenizing does, possibly in a worker process.
"""

from __future__ import annotations

import codecs
import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from qshard.data.hf import is_saved_dataset, read_arrow, read_saved
from qshard.errors import QShardError

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class BadRecord(QShardError):
    """A record that cannot be used; `data.on_bad_record: skip` skips these, every other error is fatal."""


def data_files(path: str | Path) -> list[Path]:
    """The data files of a source: the file itself, or a directory's data files (recursively, sorted). A
    directory written by `save_to_disk` counts as one data file, wherever it is found."""
    path = Path(path)
    if not path.exists():
        raise QShardError(f"{path}: data file not found")
    if path.is_dir():
        if is_saved_dataset(path):
            return [path]
        # Outermost saved datasets only: a DatasetDict's splits are saved datasets too.
        saved = sorted(
            {
                m.parent
                for name in ("dataset_dict.json", "state.json")
                for m in path.rglob(name)
                if is_saved_dataset(m.parent)
            }
        )
        saved = [d for d in saved if not any(o in d.parents for o in saved)]
        files = sorted(
            [
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in SUFFIXES and not any(d in p.parents for d in saved)
            ]
            + saved
        )
        if not files:
            raise QShardError(f"{path}: the directory holds no data files ({', '.join(SUFFIXES)})")
        return files
    if not path.is_file():
        raise QShardError(f"{path}: data path is not a regular file")
    return [path]


def file_kind(path: Path) -> str:
    """Any suffix other than the known ones is read as JSONL, the default format."""
    if path.is_dir():
        return "saved"
    return SUFFIXES.get(path.suffix.lower(), "jsonl")


def read_raw(path: Path, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (where, raw record) for every record of one data file (see `data_files`); raw is bytes (a JSONL
    line) or a value. `split` chooses the split of a saved DatasetDict."""
    kind = file_kind(path)
    if kind == "saved":
        records = read_saved(path, split)
    elif split is not None:  # accepted and ignored, it would train on the whole file
        raise QShardError(
            f"{path}: split {split!r} asked for (a source's split option), but only hub datasets and saved "
            "datasets directories (save_to_disk) have splits"
        )
    else:
        records = {"jsonl": _jsonl, "json": read_json, "parquet": _parquet, "csv": _csv, "arrow": read_arrow}[kind](
            path
        )
    count = 0
    for item in records:
        count += 1
        yield item
    if not count:
        raise QShardError(f"{path}: the data file has no records")


def decode(where: str, raw: Any) -> dict[str, Any]:
    """Raw record -> dict, or BadRecord naming where it is."""
    if isinstance(raw, BadRecord):  # found bad while reading (a CSV row of the wrong width)
        raise raw
    if isinstance(raw, bytes):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRecord(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadRecord(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(raw, dict):
        raise BadRecord(f"{where}: a record must be a JSON object, got {json_type(raw)}")
    return raw


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _jsonl(path: Path) -> Iterator[tuple[str, bytes]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield f"{path}:{lineno}", raw


JSON_CHUNK = 1 << 18  # bytes read at a time from a .json file
MAX_JSON_RECORD = 64 << 20  # characters; a record that does not end within this is taken as malformed
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class _JsonText:
    """A JSON file's text read chunk by chunk, so that only the current record and one chunk are in memory,
    with the line and column of any position still held."""

    def __init__(self, path: Path, f: BinaryIO, chunk: int):
        self.path, self.file, self.chunk = path, f, chunk
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()
        self.text, self.pos, self.eof, self.bytes_read = "", 0, False, 0
        # Line of text[0] and its column (0-based); a cursor that counts newlines as positions advance.
        self.line0, self.col0 = 1, 0
        self.counted_to, self.counted_lines = 0, 0
        while not self.text and not self.eof:  # a chunk may end inside the first character
            self.more(chunk)
        if self.text.startswith("\ufeff"):  # a UTF-8 byte order mark, as some editors write
            self.pos = 1

    def more(self, size: int) -> None:
        """Read `size` more bytes (fewer at the end of the file) and decode them."""
        data = self.file.read(size)
        pending = len(self.utf8.getstate()[0])
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise QShardError(
                f"{self.path}: not valid UTF-8 ({e.reason} at byte {self.bytes_read - pending + e.start})"
            ) from None
        self.bytes_read += len(data)
        self.eof = not data
        if self.pos > self.chunk:  # drop what has been parsed, keeping the line and column it ended at
            last_newline = self.text.rfind("\n", 0, self.pos)
            self.col0 = self.pos - last_newline - 1 if last_newline >= 0 else self.col0 + self.pos
            self.line0 += self.text.count("\n", 0, self.pos)
            self.text, self.pos, self.counted_to, self.counted_lines = self.text[self.pos :] + text, 0, 0, 0
        else:
            self.text += text

    def line(self, pos: int) -> int:
        """Line number of `pos` (positions asked for only grow, so newlines are counted once)."""
        if pos < self.counted_to:
            return self.line0 + self.text.count("\n", 0, pos)
        self.counted_lines += self.text.count("\n", self.counted_to, pos)
        self.counted_to = pos
        return self.line0 + self.counted_lines

    def column(self, pos: int) -> int:
        last_newline = self.text.rfind("\n", 0, pos)
        return pos - last_newline if last_newline >= 0 else self.col0 + pos + 1

    def error(self, pos: int, message: str) -> QShardError:
        return QShardError(f"{self.path}:{self.line(pos)}: invalid JSON: {message} (column {self.column(pos)})")

    def peek(self) -> str | None:
        """The next character that is not whitespace (now at `pos`), or None at the end of the file."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if self.eof:
                return None
            self.more(self.chunk)

    def expect(self, allowed: str, message: str) -> str:
        char = self.peek()
        if char is None or char not in allowed:
            raise self.error(self.pos, message)
        self.pos += 1
        return char

    def value(self) -> Any:
        """Decode the next JSON value, reading on while it may just be cut off by the end of the text."""
        self.peek()  # raw_decode takes no leading whitespace
        while True:
            try:
                value, self.pos = self.decoder.raw_decode(self.text, self.pos)
                return value
            except json.JSONDecodeError as e:
                # Cut-off input fails at its very end, except a string, which fails where it starts. Any
                # other failure is a real error; so is one that persists with the whole file read.
                cut_off = e.pos >= len(self.text) - 16 or e.msg.startswith("Unterminated string")
                if self.eof or not cut_off:
                    raise self.error(e.pos, e.msg) from None
                pending = len(self.text) - self.pos
                if pending > MAX_JSON_RECORD:
                    raise self.error(
                        self.pos,
                        f"a record that does not end within {MAX_JSON_RECORD >> 20} MiB "
                        "(an unclosed string or bracket?)",
                    ) from None
                self.more(max(self.chunk, pending))  # doubling: a long record is re-parsed O(log) times


def read_json(path: Path, chunk: int = JSON_CHUNK) -> Iterator[tuple[str, Any]]:
    """Records of a JSON array, or of the array in an object's "data" field, parsed one at a time."""
    with path.open("rb") as f:
        text = _JsonText(path, f, chunk)
        first = text.peek()
        if first == "[":
            yield from _json_array(text)
        elif first == "{":
            yield from _json_wrapped(text)
        elif first is not None:
            got = json_type(text.value())
            raise QShardError(f"{path}: a .json data file must hold an array of records, got {got}")
        if text.peek() is not None:
            raise text.error(text.pos, "Extra data after the top-level value")


def _json_array(text: _JsonText) -> Iterator[tuple[str, Any]]:
    text.expect("[", "Expecting '['")
    if text.peek() == "]":
        text.pos += 1
        return
    count = 0
    while True:
        text.peek()  # the record's line is that of its first character
        line = text.line(text.pos)
        record = text.value()
        count += 1
        yield f"{text.path}:{line}: record {count}", record
        if text.expect(",]", "Expecting ',' delimiter") == "]":
            return


def _json_wrapped(text: _JsonText) -> Iterator[tuple[str, Any]]:
    """{"data": [...], ...}, a common wrapping; other fields are parsed and ignored."""
    text.expect("{", "Expecting '{'")
    found = False
    if text.peek() == "}":
        text.pos += 1
    else:
        while True:
            if text.peek() != '"':
                raise text.error(text.pos, "Expecting property name enclosed in double quotes")
            key = text.value()
            text.expect(":", "Expecting ':' delimiter")
            if key == "data" and text.peek() == "[":
                found = True
                yield from _json_array(text)
            else:
                value = text.value()
                if key == "data":
                    raise QShardError(
                        f'{text.path}: the "data" field must be an array of records, got {json_type(value)}'
                    )
            if text.expect(",}", "Expecting ',' delimiter") == "}":
                break
    if not found:
        raise QShardError(
            f'{text.path}: a .json data file must hold an array of records (or {{"data": [...]}}), '
            "got an object without a data field"
        )


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise QShardError(f"{path}: reading Parquet needs pyarrow: pip install 'qshard[parquet]'") from None
    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for every kind of bad file
        raise QShardError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in reader.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


def _csv(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            for record in reader:
                # line_num is the physical line where the record ends (a quoted field may span lines).
                where = f"{path}:{reader.line_num}"
                if None in record:
                    yield where, BadRecord(f"{where}: more fields than the header has")
                elif any(v is None for v in record.values()):
                    yield where, BadRecord(f"{where}: fewer fields than the header has")
                else:
                    yield where, record
        except UnicodeDecodeError as e:
            raise QShardError(f"{path}: not valid UTF-8 ({e.reason})") from None
        except csv.Error as e:
            raise QShardError(f"{path}:{reader.line_num}: invalid CSV: {e}") from None
