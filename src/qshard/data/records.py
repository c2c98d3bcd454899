"""Reading records from data files: JSONL, JSON (an array of objects), Parquet and CSV, or a directory of them.

Every record comes with where it was found (``file:line`` or ``file:row``), so that an error can name it.
JSONL and CSV are read line by line and Parquet batch by batch, so a file larger than RAM streams through;
a JSON array is parsed whole. A JSONL line is handed on undecoded (bytes), so that decoding happens where
the tokenizing does, possibly in a worker process.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qshard.errors import QShardError

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class BadRecord(QShardError):
    """A record that cannot be used; `data.on_bad_record: skip` skips these, every other error is fatal."""


def data_files(path: str | Path) -> list[Path]:
    """The data files of a source: the file itself, or a directory's data files (recursively, sorted)."""
    path = Path(path)
    if not path.exists():
        raise QShardError(f"{path}: data file not found")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise QShardError(f"{path}: the directory holds no data files ({', '.join(SUFFIXES)})")
        return files
    if not path.is_file():
        raise QShardError(f"{path}: data path is not a regular file")
    return [path]


def file_kind(path: Path) -> str:
    """Any suffix other than the known ones is read as JSONL, the default format."""
    return SUFFIXES.get(path.suffix.lower(), "jsonl")


def read_raw(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (where, raw record) for every record of one file; raw is bytes (a JSONL line) or a value."""
    readers = {"jsonl": _jsonl, "json": _json, "parquet": _parquet, "csv": _csv}
    count = 0
    for item in readers[file_kind(path)](path):
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


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise QShardError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise QShardError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if isinstance(records, dict) and "data" in records:  # {"data": [...]}, a common wrapping
        records = records["data"]
    if not isinstance(records, list):
        raise QShardError(f"{path}: a .json data file must hold an array of records, got {json_type(records)}")
    for i, record in enumerate(records):
        yield f"{path}:record {i + 1}", record


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
