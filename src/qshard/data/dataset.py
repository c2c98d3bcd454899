"""From the data configuration to the training and held-out examples a run uses: sources, tokenization
cache, held-out split, source weights, packing.

Each source is tokenized once into an on-disk store under ``data.cache_dir``, named by a hash of its
files (path, size, modification time), the tokenizer and the tokenizing options, so a second run on the
same data reads it back. When running distributed, local rank 0 of each node tokenizes while the other
ranks wait, then all of them open the store."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from qshard.data.batching import split_held_out
from qshard.data.example import Example
from qshard.data.packing import PackedExamples
from qshard.data.records import data_files
from qshard.data.store import META, ExampleView, StoreWriter, TokenStore
from qshard.data.tokenize import Options, encode_source, make_options
from qshard.errors import QShardError

logger = logging.getLogger("qshard")
STORE_VERSION = 1  # bump when the store layout or the encoding changes


@dataclass(frozen=True)
class Source:
    path: str
    weight: float
    options: Options


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qshard" / "data"


def sources_of(data_cfg: Any) -> list[Source]:
    """`data.path` (if set) and every entry of `data.sources`."""
    out = [Source(data_cfg.path, 1.0, _options(data_cfg, data_cfg.format))] if data_cfg.path else []
    for s in data_cfg.sources or []:
        out.append(Source(s.path, s.weight, _options(data_cfg, s.format, vars(s.columns))))
    return out


def _options(data_cfg: Any, fmt: str, columns: dict[str, str | None] | None = None) -> Options:
    return make_options(data_cfg.max_length, fmt, columns, chat_template=data_cfg.chat_template,
                        train_on=data_cfg.train_on, overlong=data_cfg.overlong, on_bad_record=data_cfg.on_bad_record)


# ------------------------------------------------------------------------------------------------------ cache


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything in the tokenizer that changes token ids."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token,
             str(tokenizer.bos_token_id), str(tokenizer.eos_token_id)]
    h.update(json.dumps(extra).encode())
    return h.hexdigest()


def cache_key(source: Source, tokenizer_hash: str) -> str:
    files = []
    for f in data_files(source.path):
        stat = f.stat()
        files.append([str(f.resolve()), stat.st_size, stat.st_mtime_ns])
    key = {"version": STORE_VERSION, "files": files, "tokenizer": tokenizer_hash, "options": vars(source.options)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def build_store(source: Source, tokenizer: Any, directory: Path, num_workers: int, progress: bool) -> None:
    """Tokenize `source` into `directory`, written under a temporary name and renamed into place, so a
    store that exists is complete (a race with another node ends with one of the two kept)."""
    tmp = directory.with_name(f"{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    writer = StoreWriter(tmp)
    try:
        gen = encode_source(source.path, tokenizer, source.options, num_workers, progress)
        while True:
            try:
                writer.add(*next(gen))
            except StopIteration as stop:
                stats = stop.value
                break
        stats.report(Path(source.path), source.options)
        writer.close({"source": source.path, "stats": {k: v for k, v in vars(stats).items() if k != "first_bad"}})
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, directory)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)


def tokenized(source: Source, tokenizer: Any, cache_dir: Path, num_workers: int = 1, leader: bool = True,
              is_main: bool = True) -> ExampleView:
    """The source's examples from the cache, tokenizing them first if needed (on the leader only); the
    main rank reports how many there are and how many were left out."""
    directory = cache_dir / cache_key(source, tokenizer_fingerprint(tokenizer))
    error = None
    if leader and not (directory / META).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            build_store(source, tokenizer, directory, num_workers, progress=is_main and sys.stderr.isatty())
        except QShardError as e:
            error = e
    _agree_on_error(error)
    store = TokenStore(directory)
    if is_main:
        left_out = {k: v for k, v in store.meta["stats"].items() if v and k not in ("records", "examples")}
        logger.info("%s: %d examples (%s) from %s", source.path, len(store),
                    ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in left_out.items()) or "none left out", directory)
    return ExampleView.of(store)


def _agree_on_error(error: QShardError | None) -> None:
    """Every rank raises the leaders' first error, or none does; also the wait for the leaders."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, str(error) if error is not None else None)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise error if error is not None else QShardError(first)
    elif error is not None:
        raise error


# ---------------------------------------------------------------------------------------------------- weights


def weighted(view: ExampleView, weight: float, seed: int) -> ExampleView:
    """Each example `weight` times: whole repeats, then a seeded choice for the fraction left over."""
    n = len(view)
    target = round(weight * n)
    if target < 1:
        raise QShardError(f"a source weight of {weight} leaves none of its {n} examples")
    whole, rest = divmod(target, n)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()[:rest]
    indices = np.concatenate([np.tile(np.arange(n), whole), np.sort(chosen)])
    return view.subset(indices)


# ------------------------------------------------------------------------------------------------------- public


def load_datasets(cfg: Any, tokenizer: Any, local_rank: int = 0, is_main: bool = True
                  ) -> tuple[Sequence[Example], Sequence[Example]]:
    """(training, held-out) examples for a run's configuration. Sources are split one by one (each keeps
    `data.eval_fraction` apart) before their weights repeat or subsample the training part."""
    d = cfg.data
    cache_dir = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()

    def load(source: Source) -> ExampleView:
        return tokenized(source, tokenizer, cache_dir, d.num_workers, leader=local_rank == 0, is_main=is_main)

    sources = sources_of(d)
    train_parts, held_parts = [], []
    for i, source in enumerate(sources):
        view = load(source)
        if not d.eval_path and d.eval_fraction > 0:
            view, held = split_held_out(view, d.eval_fraction, cfg.train.seed)
            held_parts.append(held)
        train_parts.append(weighted(view, source.weight, cfg.train.seed + i) if source.weight != 1 else view)
    train = ExampleView.concat(train_parts)
    if d.eval_path:
        held_out = load(Source(d.eval_path, 1.0, _options(d, d.format)))
    else:
        held_out = ExampleView.concat(held_parts)
    if d.packing:
        return PackedExamples(train, d.max_length), PackedExamples(held_out, d.max_length) if len(held_out) else []
    return train, held_out
