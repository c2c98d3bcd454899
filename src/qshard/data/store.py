"""Tokenized examples on disk: token ids and labels in flat int32 files, read through memory maps, so a
dataset larger than RAM costs only its page cache; and index views that select, repeat and join them."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qshard.data.example import Example

IDS, LABELS, OFFSETS, META = "input_ids.bin", "labels.bin", "offsets.npy", "meta.json"


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class StoreWriter:
    """Appends examples to a directory; `close` writes the offsets and the metadata that marks it complete.
    Everything is on disk (fsynced) before the metadata is written, so even a machine that loses power
    right after cannot leave metadata that describes missing tokens."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ids = (directory / IDS).open("wb")
        self._labels = (directory / LABELS).open("wb")
        self._offsets = [0]

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        self._ids.write(np.asarray(ids, dtype=np.int32).tobytes())
        self._labels.write(np.asarray(labels, dtype=np.int32).tobytes())
        self._offsets.append(self._offsets[-1] + len(ids))

    def close(self, meta: dict) -> None:
        """Complete the store; `meta` is saved with the counts that opening it checks the files against."""
        meta = {**meta, "examples": len(self._offsets) - 1, "tokens": self._offsets[-1]}
        for f in (self._ids, self._labels):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with (self.directory / OFFSETS).open("wb") as f:
            np.save(f, np.asarray(self._offsets, dtype=np.int64))
            f.flush()
            os.fsync(f.fileno())
        _write_synced(self.directory / META, json.dumps(meta, indent=1).encode())

    def abort(self) -> None:
        self._ids.close()
        self._labels.close()


class DamagedStore(Exception):
    """A store directory whose files do not agree with its metadata (or are missing or unreadable)."""


class TokenStore:
    """A complete store directory, opened read-only. `lock` is an open file holding a shared lock on the
    directory (see cache.py): it lives, and so the lock holds, as long as this store, so that no other job
    evicts the directory meanwhile; the lock goes when the file is closed or the process ends.

    Its files are checked against the metadata's counts first; DamagedStore says what is wrong."""

    # Preference runs with pref.precompute_reference: each row's reference log-prob (train/reference.py).
    reference: np.ndarray | None = None

    def __init__(self, directory: Path, lock: BinaryIO | None = None):
        self.directory, self.lock = directory, lock
        self.meta, self.offsets = _checked(directory)
        total = int(self.offsets[-1])
        # np.memmap refuses empty files; a store with no tokens has no examples to read anyway.
        self.ids = np.memmap(directory / IDS, np.int32, "r", shape=(total,)) if total else np.zeros(0, np.int32)
        self.labels = np.memmap(directory / LABELS, np.int32, "r", shape=(total,)) if total else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> Example:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return Example(self.ids[start:end].tolist(), self.labels[start:end].tolist())


def _checked(directory: Path) -> tuple[dict, np.ndarray]:
    """(metadata, offsets) of a store, once its files agree with them."""
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedStore(f"{META} unreadable: {e}") from None
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("examples", "tokens")):
        raise DamagedStore(f"{META} lacks the example and token counts")
    try:
        offsets = np.load(directory / OFFSETS, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DamagedStore(f"{OFFSETS} unreadable: {e}") from None
    if offsets.dtype != np.int64 or offsets.shape != (meta["examples"] + 1,):
        raise DamagedStore(f"{OFFSETS} holds {offsets.dtype} {offsets.shape}, not {meta['examples'] + 1} int64 offsets")
    if offsets[0] != 0 or offsets[-1] != meta["tokens"] or (np.diff(offsets) < 0).any():
        raise DamagedStore(f"{OFFSETS} does not run from 0 up to the {meta['tokens']} tokens")
    expected = 4 * meta["tokens"]  # int32
    for name in (IDS, LABELS):
        try:
            size = (directory / name).stat().st_size
        except OSError as e:
            raise DamagedStore(f"{name} unreadable: {e}") from None
        if size != expected:
            raise DamagedStore(f"{name} has {size} bytes, not the {expected} of {meta['tokens']} tokens")
    return meta, offsets


class ExampleView(Sequence):
    """Examples picked from stores by (store, index) pairs: a subset, a repetition or a join of them."""

    def __init__(self, stores: list[TokenStore], refs: np.ndarray):
        self.stores, self.refs = stores, refs  # refs: (n, 2) int64 of (store number, example number)

    @classmethod
    def of(cls, store: TokenStore) -> ExampleView:
        n = len(store)
        return cls([store], np.stack([np.zeros(n, np.int64), np.arange(n, dtype=np.int64)], axis=1))

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> Example:
        s, j = self.refs[i]
        return self.stores[s].example(int(j))

    def lengths(self) -> np.ndarray:
        out = np.empty(len(self.refs), np.int64)
        for s, store in enumerate(self.stores):
            mine = self.refs[:, 0] == s
            out[mine] = store.lengths()[self.refs[mine, 1]]
        return out

    def subset(self, indices: Sequence[int] | np.ndarray) -> ExampleView:
        return ExampleView(self.stores, self.refs[np.asarray(indices, dtype=np.int64)].reshape(-1, 2))

    @staticmethod
    def concat(views: list[ExampleView]) -> ExampleView:
        stores, parts = [], []
        for view in views:
            refs = view.refs.copy()
            refs[:, 0] += len(stores)
            stores += view.stores
            parts.append(refs)
        return ExampleView(stores, np.concatenate(parts) if parts else np.zeros((0, 2), np.int64))
