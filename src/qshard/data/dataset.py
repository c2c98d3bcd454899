"""From the data configuration to the training and held-out examples a run uses: sources, tokenization
cache, held-out split, source weights, packing.

Each source is tokenized once into an on-disk store under ``data.cache_dir``, named by a hash of its
files (path, size, modification time), the tokenizer and the tokenizing options, so a second run on the
same data reads it back (see cache.py for how entries are shared, locked and evicted). When running
distributed, local rank 0 of each node tokenizes while the other ranks wait, then all of them open the
store."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from qshard.data.batching import split_held_out
from qshard.data.cache import TokenCache
from qshard.data.example import Example
from qshard.data.hf import HubDataset
from qshard.data.packing import PackedExamples
from qshard.data.preference import PairView, preference_format
from qshard.data.records import data_files
from qshard.data.store import ExampleView, StoreWriter
from qshard.data.tokenize import Options, encode_source, make_options
from qshard.errors import QShardError

logger = logging.getLogger("qshard")
STORE_VERSION = 4  # bump when the store layout or the encoding changes


@dataclass(frozen=True)
class Source:
    path: str | None
    weight: float
    options: Options
    split: str | None = None  # of a saved DatasetDict (or of `hub`)
    hub: HubDataset | None = None  # instead of `path`

    @property
    def name(self) -> str:
        return str(self.hub) if self.hub is not None else str(self.path)

    @property
    def location(self) -> str | HubDataset:
        return self.hub if self.hub is not None else self.path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qshard" / "data"


def sources_of(data_cfg: Any, pref: Any = None) -> list[Source]:
    """`data.path` (if set) and every entry of `data.sources`; `pref`: (preference format, pref.max_prompt_length)
    for a preference objective's records."""
    out = [Source(data_cfg.path, 1.0, _options(data_cfg, data_cfg.format, pref=pref))] if data_cfg.path else []
    for i, s in enumerate(data_cfg.sources or []):
        hub = HubDataset(s.hub, s.split, s.subset, s.revision, f"data.sources[{i}].hub") if s.hub else None
        out.append(Source(s.path, s.weight, _options(data_cfg, s.format, vars(s.columns), pref), s.split, hub))
    return out


def _options(data_cfg: Any, fmt: str, columns: dict[str, str | None] | None = None, pref: Any = None) -> Options:
    fmt, max_prompt_length = pref or (fmt, None)
    return make_options(
        data_cfg.max_length,
        fmt,
        columns,
        max_prompt_length=max_prompt_length,
        chat_template=data_cfg.chat_template,
        train_on=data_cfg.train_on,
        overlong=data_cfg.overlong,
        on_bad_record=data_cfg.on_bad_record,
        max_record_bytes=math.ceil(data_cfg.max_record_mb * 1e6) if data_cfg.max_record_mb else None,
    )


# ------------------------------------------------------------------------------------------------------ cache


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of everything in the tokenizer that changes token ids."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [
        getattr(tokenizer, "chat_template", None),
        tokenizer.bos_token,
        tokenizer.eos_token,
        str(tokenizer.bos_token_id),
        str(tokenizer.eos_token_id),
    ]
    h.update(json.dumps(extra).encode())
    return h.hexdigest()


def _file_identity(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def source_identity(source: Source) -> Any:
    """What names a source's data: its files' paths, sizes and modification times (every file of a saved
    dataset directory), or for a hub dataset the request and the files it resolved to."""
    if source.hub is not None:
        return source.hub.identity()
    files = []
    for f in data_files(source.path):
        members = sorted(p for p in f.rglob("*") if p.is_file()) if f.is_dir() else [f]
        files += [_file_identity(p) for p in members]
    return {"files": files, "split": source.split}


def cache_key(source: Source, tokenizer_hash: str) -> str:
    key = {
        "version": STORE_VERSION,
        "data": source_identity(source),
        "tokenizer": tokenizer_hash,
        # Preference records' prompt cut is left out where empty, so that SFT sources keep the keys their stores
        # had before it existed.
        "options": {k: v for k, v in vars(source.options).items() if not (k == "max_prompt_length" and v is None)},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def build_store(source: Source, tokenizer: Any, directory: Path, num_workers: int, progress: bool) -> None:
    """Tokenize `source` into the store `directory` (see cache.TokenCache.build for how it appears)."""
    writer = StoreWriter(directory)
    try:
        gen = encode_source(source.location, tokenizer, source.options, num_workers, progress, source.split)
        while True:
            try:
                writer.add(*next(gen))
            except StopIteration as stop:
                stats = stop.value
                break
        stats.report(source.name, source.options)
        writer.close({"source": source.name, "stats": {k: v for k, v in vars(stats).items() if k != "first_bad"}})
    except BaseException:
        writer.abort()
        raise


def tokenized(
    source: Source, tokenizer: Any, cache: TokenCache, num_workers: int = 1, leader: bool = True, is_main: bool = True
) -> ExampleView:
    """The source's examples from the cache, tokenizing them first if needed (on the leader only); the
    main rank reports how many there are and how many were left out."""
    if source.hub is not None:
        _fetch_first(source.hub, leader)
    key = cache_key(source, tokenizer_fingerprint(tokenizer))
    store, error = None, None
    if leader:
        store = cache.open(key)
        if store is None:
            try:
                store = cache.build(key, lambda d: build_store(source, tokenizer, d, num_workers, is_main))
            except QShardError as e:
                error = e
    _agree_on_error(error)
    store = store or cache.open(key)
    if store is None:
        raise QShardError(
            f"{cache.root / key}: the tokenized data of {source.name} is missing, although local rank 0 of this "
            "node has just written it; data.cache_dir must be one directory that every rank of a node sees"
        )
    if is_main:
        left_out = {k: v for k, v in store.meta.get("stats", {}).items() if v and k not in ("records", "examples")}
        logger.info(
            "%s: %d examples (%s) from %s",
            source.name,
            len(store),
            ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in left_out.items()) or "none left out",
            store.directory,
        )
    return ExampleView.of(store)


def _fetch_first(hub: HubDataset, leader: bool) -> None:
    """The leader downloads a hub dataset (if it is not in the Hugging Face cache yet) before the other
    ranks look for it, so that each node fetches it once."""
    error = None
    if leader:
        try:
            hub.load()
        except QShardError as e:
            error = e
    _agree_on_error(error)


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


def load_datasets(
    cfg: Any, tokenizer: Any, local_rank: int = 0, is_main: bool = True
) -> tuple[Sequence[Example], Sequence[Example]]:
    """(training, held-out) examples for a run's configuration. Sources are split one by one (each keeps
    `data.eval_fraction` apart) before their weights repeat or subsample the training part."""
    d = cfg.data
    cache_dir = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    cache = TokenCache(cache_dir, None if d.cache_max_gb is None else int(d.cache_max_gb * 1e9))

    def load(source: Source) -> ExampleView:
        return tokenized(source, tokenizer, cache, d.num_workers, leader=local_rank == 0, is_main=is_main)

    fmt = preference_format(cfg.train.objective)
    pref = (fmt, cfg.pref.max_prompt_length) if fmt else None
    # A preference store holds two rows per record: read back as pairs, which split, weigh and join as examples do.
    as_items, concat = (PairView, PairView.concat) if pref else (lambda view: view, ExampleView.concat)
    sources = sources_of(d, pref)
    train_parts, held_parts = [], []
    for i, source in enumerate(sources):
        view = as_items(load(source))
        if not d.eval_path and d.eval_fraction > 0:
            view, held = split_held_out(view, d.eval_fraction, cfg.train.seed)
            held_parts.append(held)
        train_parts.append(weighted(view, source.weight, cfg.train.seed + i) if source.weight != 1 else view)
    train = concat(train_parts)
    if d.eval_path:
        held_out = as_items(load(Source(d.eval_path, 1.0, _options(d, d.format, pref=pref))))
    else:
        held_out = concat(held_parts)
    if local_rank == 0:
        cache.evict()  # only now: every entry this run uses is open, and so locked against eviction
    if d.packing:
        seed = cfg.train.seed
        held_packed = PackedExamples(held_out, d.max_length, seed) if len(held_out) else []
        return PackedExamples(train, d.max_length, seed), held_packed
    return train, held_out
