"""Records to tokenized examples, in this process or in a pool of workers, with the bad-record and
over-long policies applied and every outcome counted."""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qshard.data.example import IGNORE_INDEX, Example
from qshard.data.formats import FORMATS, detect_format
from qshard.data.hf import HubDataset
from qshard.data.preference import PREFERENCE_FORMATS, encode_preference
from qshard.data.records import BadRecord, bounded, data_files, decode, read_raw
from qshard.data.templates import Encoder
from qshard.errors import QShardError

logger = logging.getLogger("qshard")
CHUNK = 512  # records per task sent to a worker


@dataclass(frozen=True)
class Options:
    """Everything that decides how records become examples (and so part of the cache key)."""

    max_length: int
    format: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()  # (canonical field, record field)
    chat_template: str = "auto"
    train_on: str = "assistant"
    overlong: str = "truncate"
    on_bad_record: str = "error"
    # A record larger than this (bytes) is a bad record: tokenizing one takes memory many times its size.
    # None: no limit. The default is data.max_record_mb's.
    max_record_bytes: int | None = 16_000_000
    # Preference records (format preference or kto): the prompt's tokens kept before the completions are cut.
    max_prompt_length: int | None = None

    @property
    def columns_map(self) -> dict[str, str]:
        return dict(self.columns)

    def check(self, source: object) -> None:
        if self.format not in FORMATS + PREFERENCE_FORMATS:
            choices = ", ".join(FORMATS)
            raise QShardError(
                f"data format option: unknown format {self.format!r} for {source} (expected one of {choices})"
            )
        if not isinstance(self.max_length, int) or self.max_length < 1:
            raise QShardError(f"max_length option: must be a positive integer, got {self.max_length!r} ({source})")
        if self.overlong not in ("truncate", "drop"):
            raise QShardError(f"data.overlong: must be truncate or drop, got {self.overlong!r}")
        if self.on_bad_record not in ("error", "skip"):
            raise QShardError(f"data.on_bad_record: must be error or skip, got {self.on_bad_record!r}")
        limit = self.max_record_bytes
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise QShardError(f"data.max_record_mb: must be a positive size, got {self.max_record_bytes!r} bytes")


@dataclass
class Stats:
    records: int = 0
    examples: int = 0
    bad: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrainable: int = 0  # nothing left to train after truncation
    first_bad: list[str] = field(default_factory=list)

    def report(self, source: object, opts: Options) -> None:
        """Log what was left out or cut, then fail if nothing is left."""
        if self.bad:
            logger.warning(
                "%s: skipped %d bad records of %d (first: %s)",
                source,
                self.bad,
                self.records,
                "; ".join(self.first_bad),
            )
        if self.dropped_untrainable:
            logger.warning(
                "%s: dropped %d of %d examples that have no trained token left after truncation to max_length=%d",
                source,
                self.dropped_untrainable,
                self.records,
                opts.max_length,
            )
        if self.dropped_overlong:
            logger.warning(
                "%s: dropped %d of %d examples longer than max_length=%d (data.overlong: drop)",
                source,
                self.dropped_overlong,
                self.records,
                opts.max_length,
            )
        if self.truncated:
            logger.info(
                "%s: truncated %d of %d examples to max_length=%d",
                source,
                self.truncated,
                self.records,
                opts.max_length,
            )
        if not self.examples:
            raise QShardError(
                f"{source}: no usable examples: of {self.records} records, {self.bad} are bad, "
                f"{self.dropped_overlong} are longer than max_length={opts.max_length} and dropped, and "
                f"{self.dropped_untrainable} lose every trained token when truncated to max_length={opts.max_length}"
            )


# ---------------------------------------------------------------------------------------------------- encoding

_worker_state: tuple[Encoder, Options] | None = None


def _init_worker(tokenizer: Any, opts: Options) -> None:
    global _worker_state
    _worker_state = (Encoder(tokenizer, opts.chat_template, opts.train_on, dict(opts.columns)), opts)


def _encode_chunk(fmt: str, items: list[tuple[str, Any]]) -> list[tuple]:
    encoder, opts = _worker_state
    return [_encode_one(encoder, opts, fmt, where, raw) for where, raw in items]


def _encode_one(encoder: Encoder, opts: Options, fmt: str, where: str, raw: Any) -> tuple:
    """One outcome: ("ok", ids, labels, truncated) | ("bad", message) | ("overlong",) | ("untrainable",), or
    a preference record's ("rows", [(ids, labels), (ids, labels)], truncated)."""
    try:
        record = decode(where, raw)
        if fmt in PREFERENCE_FORMATS:
            return encode_preference(encoder, opts, fmt, record, where)
        if fmt == "auto":
            fmt = detect_format(record, where, opts.columns_map)
        ids, labels = encoder.encode(record, fmt, where)
    except BadRecord as e:
        return ("bad", str(e))
    truncated = len(ids) > opts.max_length
    if truncated:
        if opts.overlong == "drop":
            return ("overlong",)
        ids, labels = ids[: opts.max_length], labels[: opts.max_length]
    if all(label == IGNORE_INDEX for label in labels):
        return ("untrainable",)
    return ("ok", np.asarray(ids, np.int32), np.asarray(labels, np.int32), truncated)


def _file_chunks(records: Iterator[tuple[str, Any]], opts: Options) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """(format, records) chunks of one file's records. With format auto the first usable record decides the
    file's format; records before it (bad ones, with skip) are sent as auto and detected one by one."""
    fmt, chunk = opts.format, []
    for where, raw in records:
        if fmt == "auto":
            try:
                fmt = detect_format(decode(where, raw), where, opts.columns_map)
            except BadRecord:
                if opts.on_bad_record == "error":
                    raise
                chunk.append((where, raw))
                continue
            if chunk:
                yield "auto", chunk
                chunk = []
        chunk.append((where, raw))
        if len(chunk) == CHUNK:
            yield fmt, chunk
            chunk = []
    if chunk:
        yield fmt, chunk


def _records_of(
    source: str | Path | HubDataset, split: str | None, max_record_bytes: int | None
) -> Iterator[Iterator[tuple[str, Any]]]:
    """The records of each data file of a source (a hub dataset is one)."""
    if isinstance(source, HubDataset):
        yield bounded(source.records(), max_record_bytes)
        return
    for file in data_files(source):
        yield read_raw(file, split, max_record_bytes)


def encode_source(
    source: str | Path | HubDataset,
    tokenizer: Any,
    opts: Options,
    num_workers: int = 1,
    progress: bool = False,
    split: str | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (input_ids, labels) of every usable example of a file, directory or hub dataset, in file order
    (`split` picks a saved DatasetDict's split). Returns the Stats (the generator's return value); a bad
    record raises unless on_bad_record is skip. `progress` shows a bar on a terminal, log lines elsewhere."""
    source = source if isinstance(source, HubDataset) else Path(source)
    opts.check(source)
    encoder = Encoder(tokenizer, opts.chat_template, opts.train_on, opts.columns_map)  # option errors up front
    files = _records_of(source, split, opts.max_record_bytes)
    chunks = (item for records in files for item in _file_chunks(records, opts))
    if num_workers > 1:
        results = _parallel(chunks, tokenizer, opts, num_workers)
    else:
        results = ([_encode_one(encoder, opts, fmt, where, raw) for where, raw in items] for fmt, items in chunks)
    stats = Stats()
    bar = Progress(source) if progress else None
    for outcomes in results:
        for outcome in outcomes:
            stats.records += 1
            kind = outcome[0]
            if kind == "ok":
                stats.examples += 1
                stats.truncated += outcome[3]
                yield outcome[1], outcome[2]
            elif kind == "rows":  # a preference record: its two rows, always both (data/preference.py)
                stats.examples += 1
                stats.truncated += outcome[2]
                yield from outcome[1]
            elif kind == "bad":
                if opts.on_bad_record == "error":
                    raise BadRecord(outcome[1])
                stats.bad += 1
                if len(stats.first_bad) < 3:
                    stats.first_bad.append(outcome[1])
            elif kind == "overlong":
                stats.dropped_overlong += 1
            else:
                stats.dropped_untrainable += 1
        if bar is not None:
            bar.update(len(outcomes))
    if bar is not None:
        bar.close()
    return stats


def _parallel(chunks, tokenizer, opts: Options, num_workers: int) -> Iterator[list[tuple]]:
    """Results of the chunks in order, with at most 2 tasks per worker in flight, so that reading runs
    only a little ahead of tokenizing and memory stays bounded however large the file. Spawned, not
    forked: the parent may hold a process group's threads."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer, opts)) as pool:
        pending: deque = deque()
        for fmt, items in chunks:
            pending.append(pool.apply_async(_encode_chunk, (fmt, items)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """Records tokenized so far: a tqdm bar on a terminal; elsewhere (a batch job's log) a line every
    `every_s` seconds, so that a long tokenization does not look like a hang."""

    def __init__(self, source: Any, every_s: float = 30.0):
        self.name, self.every_s, self.count = getattr(source, "name", str(source)), every_s, 0
        self.started = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=f"tokenizing {self.name}", unit=" records", dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.count / (now - self.started)
            logger.info("tokenizing %s: %d records so far (%.0f/s)", self.name, self.count, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def load_examples(
    path: str | Path, tokenizer: Any, max_length: int, fmt: str = "auto", **options: Any
) -> list[Example]:
    """Tokenize a data file or directory into a list of Examples, in memory (small data and tests;
    training uses `dataset.load_datasets`, which stores them on disk).

    ``fmt`` is one of FORMATS; "auto" decides by each file's first record, then requires it of all.
    ``options`` are the other Options fields (columns as a dict, chat_template, train_on, overlong,
    on_bad_record)."""
    opts = make_options(max_length, fmt, **options)
    gen = encode_source(path, tokenizer, opts)
    examples = []
    while True:
        try:
            ids, labels = next(gen)
        except StopIteration as stop:
            stop.value.report(Path(path), opts)
            return examples
        examples.append(Example(ids.tolist(), labels.tolist()))


def make_options(
    max_length: int, fmt: str = "auto", columns: dict[str, str | None] | None = None, **rest: Any
) -> Options:
    pairs = tuple(sorted((k, v) for k, v in (columns or {}).items() if v))
    return Options(max_length=max_length, format=fmt, columns=pairs, **rest)
