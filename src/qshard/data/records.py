"""Reading records from data files: JSONL, JSON (an array of objects), Parquet, CSV, Hugging Face datasets
(`.arrow` files, `save_to_disk` directories; see hf.py), or a directory of them.

Every record comes with where it was found (``file:line`` or ``file:row``), so that an error can name it.
Every kind streams: JSONL and CSV line by line, a JSON array record by record, Parquet and Arrow batch by
batch, so a file larger than RAM goes through in bounded memory. A JSONL line is handed on undecoded
(bytes), so that decoding happens where the tokenizing does, possibly in a worker process.

A record larger than `max_record_bytes` is a BadRecord: tokenizing one takes memory many times its size.
Where the format allows, its size is known before it is parsed (a JSONL line, a JSON array element), and it
is skipped without ever being held whole.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import re
import sys
from collections.abc import Iterable, Iterator
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


def read_raw(path: Path, split: str | None = None, max_record_bytes: int | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (where, raw record) for every record of one data file (see `data_files`); raw is bytes (a JSONL
    line), a value, or a BadRecord found while reading (one larger than `max_record_bytes`; None: no limit).
    `split` chooses the split of a saved DatasetDict."""
    kind = file_kind(path)
    if kind == "saved":
        records = bounded(read_saved(path, split), max_record_bytes)
    elif split is not None:  # accepted and ignored, it would train on the whole file
        raise QShardError(
            f"{path}: split {split!r} asked for (a source's split option), but only hub datasets and saved "
            "datasets directories (save_to_disk) have splits"
        )
    elif kind == "jsonl":
        records = _jsonl(path, max_record_bytes)
    elif kind == "json":
        records = read_json(path, max_record_bytes=max_record_bytes)
    elif kind == "csv":
        records = bounded(_csv(path, max_record_bytes), max_record_bytes)
    else:
        records = bounded({"parquet": _parquet, "arrow": read_arrow}[kind](path), max_record_bytes)
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
        except ValueError as e:  # not a syntax error: a number of more digits than Python converts
            raise BadRecord(f"{where}: invalid JSON: {_first_clause(e)}") from None
        except RecursionError:
            raise BadRecord(f"{where}: {TOO_DEEP}") from None
    if not isinstance(raw, dict):
        raise BadRecord(f"{where}: a record must be a JSON object, got {json_type(raw)}")
    return raw


def _first_clause(error: Exception) -> str:
    return str(error).split(";")[0]


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


# ------------------------------------------------------------------------------------------------ record size

MAX_RECORD_OPTION = "data.max_record_mb"
TOO_DEEP = "JSON nested too deeply to decode"
SKIP_READ = 1 << 16  # bytes read at a time while skipping the rest of a line that is too long


def too_large(size: int, limit: int) -> str:
    return f"a record of {size:,} bytes, more than {MAX_RECORD_OPTION} allows ({limit:,} bytes)"


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def record_size(value: Any) -> int:
    """Bytes of the text (strings, as UTF-8, and bytes) in a record, at any depth; walked without recursion,
    so that no nesting is too deep for it."""
    size, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            size += utf8_size(item)
        elif isinstance(item, bytes | bytearray):
            size += len(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return size


def bounded(records: Iterable[tuple[str, Any]], limit: int | None) -> Iterator[tuple[str, Any]]:
    """Records read whole (rows of CSV, Parquet, Arrow), a BadRecord in place of one larger than `limit`."""
    for where, raw in records:
        if limit is not None and not isinstance(raw, BadRecord):
            size = record_size(raw)
            if size > limit:
                raw = BadRecord(f"{where}: {too_large(size, limit)}")
        yield where, raw


# ------------------------------------------------------------------------------------------------------ JSONL


def _jsonl(path: Path, limit: int | None) -> Iterator[tuple[str, bytes | BadRecord]]:
    """Lines read at most `limit` + 1 bytes at a time, so that a longer one is never held whole: the rest of
    it is read past in pieces, only to count its size."""
    with path.open("rb") as f:
        lineno = 0
        while raw := (f.readline() if limit is None else f.readline(limit + 1)):
            lineno += 1
            where = f"{path}:{lineno}"
            if limit is not None and len(raw) > limit and not raw.endswith(b"\n"):
                yield where, BadRecord(f"{where}: {too_large(_rest_of_line(f, len(raw)), limit)}")
            elif raw.strip():
                yield where, raw


def _rest_of_line(f: BinaryIO, size: int) -> int:
    """Read past the rest of the current line; the size of the whole line, without its line ending."""
    while piece := f.readline(SKIP_READ):
        size += len(piece)
        if piece.endswith(b"\n"):
            return size - 1
    return size


# ------------------------------------------------------------------------------------------------------- JSON

JSON_CHUNK = 1 << 18  # bytes read at a time from a .json file
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# Skipping a value unparsed: a string's characters up to its closing quote (or a backslash that ends the text),
# and outside strings, a quote or a run of opening or of closing brackets.
_STRING_BODY = re.compile(r'(?:[^"\\]++|\\.)*+', re.DOTALL)
_STRUCTURE = re.compile(r'"|[\[{]+|[\]}]+')
_SCALAR_END = re.compile(r"[,\]} \t\n\r]")
# A value's type, from its first character (the rest of it need not be read).
_TYPE_BY_FIRST = {"{": "an object", "[": "an array", '"': "a string", "t": "a boolean", "f": "a boolean", "n": "null"}
_TYPE_BY_FIRST |= dict.fromkeys("-0123456789", "a number")


class _Unusable(Exception):
    """A JSON value too large or too deeply nested to parse; `pos` has been moved past it."""


class _JsonText:
    """A JSON file's text read chunk by chunk, so that only the current record and one chunk are in memory,
    with the line and column of any position still held."""

    def __init__(self, path: Path, f: BinaryIO, chunk: int, max_bytes: int | None = None):
        self.path, self.file, self.chunk, self.max_bytes = path, f, chunk, max_bytes
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
        """Decode the next JSON value, reading on while it may just be cut off by the end of the text. One
        larger than `max_bytes`, or nested deeper than the parser can recurse, raises _Unusable, skipped."""
        self.peek()  # raw_decode takes no leading whitespace
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.pos)
            except RecursionError:
                self.skip_value()
                raise _Unusable(TOO_DEEP) from None
            except json.JSONDecodeError as e:
                # Cut-off input fails at its very end, except a string, which fails where it starts. Any
                # other failure is a real error; so is one that persists with the whole file read.
                cut_off = e.pos >= len(self.text) - 16 or e.msg.startswith("Unterminated string")
                if self.eof or not cut_off:
                    raise self.error(e.pos, e.msg) from None
                read = len(self.text) - self.pos  # all of it is the value's
            except ValueError as e:  # not a syntax error: a number of more digits than Python converts
                self.skip_value()
                raise _Unusable(f"invalid JSON: {_first_clause(e)}") from None
            else:  # only a number (1234, 1e5) may parse although the end of the text cut it off
                if self.eof or end <= len(self.text) - 16 or type(value) not in (int, float):
                    return self._sized(value, end)
                read = end - self.pos
            if self.max_bytes is not None and read > self.max_bytes:  # characters: at least as many bytes
                raise _Unusable(too_large(self.skip_value(), self.max_bytes))
            # Doubling: a long record is re-parsed O(log) times.
            self.more(max(self.chunk, len(self.text) - self.pos))

    def _sized(self, value: Any, end: int) -> Any:
        """`value`, which ends at `end`, once `pos` is moved there and its size is found within the limit."""
        start, self.pos = self.pos, end
        # Only a value of more than a quarter of the limit in characters can exceed it in bytes.
        if self.max_bytes is not None and 4 * (end - start) > self.max_bytes:
            size = utf8_size(self.text[start:end])
            if size > self.max_bytes:
                raise _Unusable(too_large(size, self.max_bytes))
        return value

    def skip_value(self) -> int:
        """Move past the value at `pos` without parsing it, by its brackets and quotes alone, holding about a
        chunk of text at a time; its size in bytes. A value that does not end is an error."""
        start_line, start_column = self.line(self.pos), self.column(self.pos)
        scalar = self.text[self.pos] not in '"[{'
        size, depth, in_string, escaped, pos = 0, 0, False, False, self.pos
        while True:
            if pos >= len(self.text):
                size += utf8_size(self.text[self.pos : pos])
                self.pos = pos
                if self.eof:
                    raise QShardError(
                        f"{self.path}:{start_line}: invalid JSON: a value that does not end (an unclosed string "
                        f"or bracket?) (column {start_column})"
                    )
                self.more(self.chunk)
                pos = self.pos
            elif escaped:  # the character after a backslash that ended the text
                pos, escaped = pos + 1, False
            elif in_string:
                pos = _STRING_BODY.match(self.text, pos).end()
                if pos < len(self.text) and self.text[pos] == '"':
                    pos, in_string = pos + 1, False
                    if depth == 0:
                        break
                elif pos < len(self.text):  # a backslash, the last character so far
                    pos, escaped = pos + 1, True
            elif scalar:
                found = _SCALAR_END.search(self.text, pos)
                if found is not None:
                    pos = found.start()
                    break
                pos = len(self.text)
            else:
                found = _STRUCTURE.search(self.text, pos)
                if found is None:
                    pos = len(self.text)
                    continue
                run = found.group()
                if run == '"':
                    pos, in_string = found.end(), True
                elif run[0] in "[{":
                    pos, depth = found.end(), depth + len(run)
                elif len(run) >= depth:  # the closing bracket of the value is in this run
                    pos = found.start() + depth
                    break
                else:
                    pos, depth = found.end(), depth - len(run)
        size += utf8_size(self.text[self.pos : pos])
        self.pos = pos
        return size


def read_json(path: Path, chunk: int = JSON_CHUNK, max_record_bytes: int | None = None) -> Iterator[tuple[str, Any]]:
    """Records of a JSON array, or of the array in an object's "data" field, parsed one at a time; one
    larger than `max_record_bytes` or nested too deeply comes as a BadRecord, skipped unparsed."""
    with path.open("rb") as f:
        text = _JsonText(path, f, chunk, max_record_bytes)
        first = text.peek()
        if first == "[":
            yield from _json_array(text)
        elif first == "{":
            yield from _json_wrapped(text)
        elif first is not None:
            got = _type_at(text)
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
        count += 1
        where = f"{text.path}:{line}: record {count}"
        try:
            record = text.value()
        except _Unusable as e:
            record = BadRecord(f"{where}: {e}")
        yield where, record
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
            line = text.line(text.pos)
            try:
                key = text.value()
            except _Unusable as e:
                raise QShardError(f"{text.path}:{line}: a field name: {e}") from None
            text.expect(":", "Expecting ':' delimiter")
            if key == "data" and text.peek() == "[":
                found = True
                yield from _json_array(text)
            elif key == "data":
                raise QShardError(f'{text.path}: the "data" field must be an array of records, got {_type_at(text)}')
            else:
                with contextlib.suppress(_Unusable):  # ignored: it may be as large or as deep as it likes
                    text.value()
            if text.expect(",}", "Expecting ',' delimiter") == "}":
                break
    if not found:
        raise QShardError(
            f'{text.path}: a .json data file must hold an array of records (or {{"data": [...]}}), '
            "got an object without a data field"
        )


def _type_at(text: _JsonText) -> str:
    """The type of the value at `pos`, told by its first character; an invalid one is a JSON error."""
    first = text.peek()
    if first not in _TYPE_BY_FIRST:
        text.value()  # raises the parser's own message
    return _TYPE_BY_FIRST[first]


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


def _csv(path: Path, limit: int | None) -> Iterator[tuple[str, Any]]:
    """Rows of a CSV file; csv's own limit on a field's size is `limit` (characters), since a CSV record
    cannot be skipped without parsing it whole."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        try:
            while True:
                with _csv_field_limit(sys.maxsize if limit is None else limit):
                    record = next(reader, None)
                if record is None:
                    return
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
            line = reader.reader.line_num  # DictReader's own line_num is that of the last record it returned
            if limit is not None and str(e).startswith("field larger than field limit"):
                raise QShardError(
                    f"{path}:{line}: a CSV field of more than {limit:,} characters, more than "
                    f"{MAX_RECORD_OPTION} allows; a CSV record cannot be skipped without reading it whole, so "
                    f"raise {MAX_RECORD_OPTION} (0: no limit) or remove the record"
                ) from None
            raise QShardError(f"{path}:{line}: invalid CSV: {e}") from None


@contextlib.contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    """csv's field size limit is global to the process: set it only while this reader parses a row."""
    old = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(old)
