"""The on-disk cache of tokenized data: one directory (a token store) per key, written atomically, shared by
the jobs that use it, and kept under a size cap by evicting the least recently used entries.

Each entry holds a lock file. A job that uses an entry holds a shared lock on it (`flock`) for as long as it
has the store open, i.e. until it ends; eviction takes the lock exclusively without waiting, so an entry in
use is never evicted, and a job that finds an entry being evicted tokenizes anew. An entry is built under a
temporary name and renamed into place once complete, so a job killed while building leaves only a
temporary directory, which no job opens and a later eviction pass removes.

An entry whose files do not agree with its metadata (damaged on disk, or by hand) is removed when a job
finds it, through the same path as eviction (so never while another job has it open), and built anew."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from qshard.data.store import META, DamagedStore, TokenStore

logger = logging.getLogger("qshard")
LOCK = "lock"  # its modification time is the entry's last use
BUILDING, EVICTING = ".tmp-", ".evict-"
# A temporary directory is locked by its builder within moments of being made; one this old and unlocked
# was left by a killed job.
ABANDONED_AFTER_S = 300.0


def _lock(path: Path, mode: int) -> BinaryIO | None:
    """`path` opened and flock-ed in `mode` without waiting; None if it is missing or locked incompatibly."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(f, mode | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return f


def _same_file(f: BinaryIO, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Entry:
    path: Path
    size: int  # bytes
    last_used: float  # seconds since the epoch


class TokenCache:
    """Token stores under `root`, one per key; `max_bytes` None means no size cap."""

    def __init__(self, root: Path, max_bytes: int | None):
        self.root, self.max_bytes = root, max_bytes

    # ---------------------------------------------------------------------------------------------- use
    def open(self, key: str) -> TokenStore | None:
        """The complete entry `key`, locked shared for as long as the store lives; None if there is none
        (or it is being evicted right now, or was damaged and has just been removed)."""
        directory = self.root / key
        lock = _lock(directory / LOCK, fcntl.LOCK_SH)
        if lock is None:
            if directory.is_dir() and not (directory / LOCK).exists():  # every entry is made with one
                self._remove_damaged(directory, f"no {LOCK} file")
            return None
        # Between opening the lock file and locking it, the entry may have been evicted (renamed away).
        if not _same_file(lock, directory / LOCK):
            lock.close()
            return None
        try:
            store = TokenStore(directory, lock)
        except DamagedStore as e:
            lock.close()
            self._remove_damaged(directory, str(e))
            return None
        with contextlib.suppress(PermissionError):  # a cache shared read-only is still usable
            os.utime(directory / LOCK)  # last use, for the LRU order
        return store

    def _remove_damaged(self, directory: Path, problem: str) -> None:
        try:
            outcome = "removed" if self._remove(directory) else "left in place, as another job has it open"
        except OSError as e:  # a cache this job may not write to
            outcome = f"left in place ({e.strerror})"
        logger.warning("data cache entry %s is damaged (%s): %s; tokenizing anew", directory, problem, outcome)

    def build(self, key: str, write: Callable[[Path], None]) -> TokenStore:
        """Make entry `key` with `write(directory)` under a temporary name, then rename it into place, locked
        shared like `open`'s. If another process completed the same entry first, that one is used. If a
        damaged entry that another job holds open is in the way, this job reads its own copy, which stays
        under the temporary name (for a later run to remove)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{key}{BUILDING}{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        (tmp / LOCK).touch()
        lock = _lock(tmp / LOCK, fcntl.LOCK_EX)
        assert lock is not None, "a directory made just now is locked by no one else"
        try:
            write(tmp)
            # Shared from here on: this job uses the entry, and eviction must find it in use.
            fcntl.flock(lock, fcntl.LOCK_SH)
            placed = self._put_in_place(tmp, key)
        except BaseException:
            lock.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if isinstance(placed, TokenStore):  # another process's copy
            lock.close()
            shutil.rmtree(tmp, ignore_errors=True)
            return placed
        if placed is None:
            logger.warning("data cache entry %s is in the way; this run reads its own copy, %s", self.root / key, tmp)
            return TokenStore(tmp, lock)
        _sync_directory(self.root)  # the rename itself must survive a crash, or the entry is lost
        return TokenStore(placed, lock)

    def _put_in_place(self, tmp: Path, key: str) -> Path | TokenStore | None:
        """Rename `tmp` to entry `key`: the entry's path; or the complete entry another process put there
        first; or None if an entry that cannot be opened (a damaged one in use) stays in the way."""
        for _ in range(2):  # once more after a damaged entry in the way has been removed
            try:
                os.rename(tmp, self.root / key)
                return self.root / key
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            store = self.open(key)
            if store is not None or (self.root / key).exists():
                return store
        return None

    # ----------------------------------------------------------------------------------------- eviction
    def entries(self) -> list[Entry]:
        """Complete entries, oldest use first; removes what killed jobs left on the way."""
        out = []
        for path in self.root.iterdir() if self.root.is_dir() else []:
            if not path.is_dir():
                continue
            if EVICTING in path.name:  # an eviction that was killed halfway
                shutil.rmtree(path, ignore_errors=True)
            elif BUILDING in path.name:
                self._remove_if_abandoned(path)
            else:
                marker = path / LOCK if (path / LOCK).exists() else path / META
                try:
                    last_used = marker.stat().st_mtime
                    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                except FileNotFoundError:  # evicted by another job meanwhile
                    continue
                out.append(Entry(path, size, last_used))
        return sorted(out, key=lambda e: e.last_used)

    def evict(self) -> list[Path]:
        """Remove least recently used entries not in use until the cache fits `max_bytes`; returns them."""
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for entry in entries:
            if total <= self.max_bytes:
                break
            if self._remove(entry.path):
                total -= entry.size
                removed.append(entry.path)
        if removed:
            logger.info(
                "data cache %s: evicted %d least recently used entries (%.2f GB) to stay under %.2f GB",
                self.root,
                len(removed),
                sum(e.size for e in entries if e.path in removed) / 1e9,
                self.max_bytes / 1e9,
            )
        if total > self.max_bytes:
            logger.warning(
                "data cache %s: %.2f GB, over its cap of %.2f GB, held by running jobs (this one "
                "included); raise data.cache_max_gb or use a larger disk",
                self.root,
                total / 1e9,
                self.max_bytes / 1e9,
            )
        return removed

    def _remove(self, directory: Path) -> bool:
        """Remove an entry unless some job has it open. Renamed first, so that it vanishes at once: no job
        can open it half deleted."""
        has_lock = (directory / LOCK).exists()
        lock = _lock(directory / LOCK, fcntl.LOCK_EX) if has_lock else None
        if has_lock and (lock is None or not _same_file(lock, directory / LOCK)):
            if lock is not None:
                lock.close()
            return False  # in use, or already replaced by another job
        try:
            doomed = directory.with_name(f"{directory.name}{EVICTING}{uuid.uuid4().hex[:8]}")
            os.rename(directory, doomed)
        except FileNotFoundError:  # another job evicted it first
            return False
        finally:
            if lock is not None:
                lock.close()
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _remove_if_abandoned(self, tmp: Path) -> None:
        try:
            if time.time() - tmp.stat().st_mtime < ABANDONED_AFTER_S:
                return
        except FileNotFoundError:
            return
        lock = _lock(tmp / LOCK, fcntl.LOCK_EX)
        if lock is None and (tmp / LOCK).exists():
            return  # its builder is still at work
        try:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if lock is not None:
                lock.close()
