"""A run directory's safety: one qshard process at a time (`run_lock`), a previous run moved aside rather than
mixed with a new one (`move_previous_run`), files replaced whole (`write_atomic`), and a full disk reported
as one line naming what was being written (`writing`, `full_disk_error`).

Imports nothing heavy: the command line and `qshard export` use it before torch is loaded."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from qshard.errors import QShardError

log = logging.getLogger("qshard")

LOCK_FILE = ".qshard.lock"
# Everything qshard itself writes into a run directory (each may also have a `.tmp` sibling, left by a write
# that was killed). Nothing else in the directory is ever moved or deleted.
RUN_ENTRIES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json", "adapter", "merged", "checkpoints",
               "demo-model", "profile", "trackers")
PREVIOUS_PREFIX = ".previous-"

# flock fails with these where the filesystem cannot lock at all (Lustre mounted without -o flock, some FUSE).
_NO_LOCKING = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# How libraries that wrap the OSError word it: safetensors (Rust's io::Error) and Python's own strerror.
_FULL_WORDING = {"No space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC,
                 "Disk quota exceeded": errno.EDQUOT, "os error 122": errno.EDQUOT}


# ------------------------------------------------------------------------------------------------------ lock


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold `run_dir` exclusively for the duration (creating it if needed): another qshard process that asks
    for it meanwhile gets a QShardError naming the directory and the holder. The lock is an flock on
    RUN/.qshard.lock, so the kernel drops it when its process dies, however it dies: a lock file a dead
    process left behind blocks no one. Take it in one process per run (rank 0), before writing anything."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _acquire(path)
    try:
        yield path
    finally:
        if fd is not None:
            # Removed while still held: whoever opened the old file meanwhile sees it is gone (see _acquire).
            path.unlink(missing_ok=True)
            os.close(fd)
        if created:
            with contextlib.suppress(OSError):  # only if empty: a run that failed before writing anything
                run_dir.rmdir()


def _acquire(path: Path) -> int | None:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in _NO_LOCKING:
                log.warning("%s: this filesystem cannot lock files (%s): nothing stops a second qshard process "
                            "from writing into this directory at the same time", path.parent, exc.strerror)
                return None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise QShardError(
                f"{path.parent}: another qshard process is using this run directory ({holder}); wait for it "
                "to finish, or choose another directory"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it while we waited for the lock: lock the file there now
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)}
    with contextlib.suppress(OSError):  # only for the message of whoever is refused; the flock is the lock
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock, from what its holder wrote into the file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is just starting"


# ------------------------------------------------------------------------------------------ a previous run


def move_previous_run(run_dir: Path, keep: Collection[str] = ()) -> Path | None:
    """Move the files an earlier run wrote into `run_dir` (RUN_ENTRIES) into RUN/.previous-<time>/ and return
    that directory (None if there were none). The entries named in `keep` (the new run's own inputs, e.g. the
    demo model it has just written) and files qshard did not write stay where they are; nothing is deleted."""
    found = [run_dir / name for base in RUN_ENTRIES if base not in keep for name in (base, base + ".tmp")
             if os.path.lexists(run_dir / name)]
    if not found:
        return None
    dest = _new_previous_dir(run_dir)
    for entry in found:
        try:
            entry.rename(dest / entry.name)
        except OSError as exc:  # e.g. a mount point; what was moved so far stays in `dest`
            raise QShardError(f"--overwrite: cannot move {entry} into {dest} ({exc.strerror}); move or delete "
                              "it yourself, then run again") from None
    return dest


def _new_previous_dir(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        dest = run_dir / (PREVIOUS_PREFIX + stamp + (f"-{n}" if n else ""))
        try:
            dest.mkdir()
            return dest
        except FileExistsError:
            continue
    raise QShardError(f"{run_dir}: cannot name a directory for the previous run (too many {PREVIOUS_PREFIX}{stamp}*)")


# ----------------------------------------------------------------------------------------------- writing


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a sibling temporary file, then rename it over `path`: a failure (a full disk, a kill)
    leaves the previous `path` whole, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def writing(what: str | Path) -> Iterator[None]:
    """A full disk (or quota) met inside becomes one QShardError naming `what` was being written."""
    try:
        yield
    except Exception as exc:
        full = full_disk_error(exc, what)
        if full is None:
            raise
        raise full from None


def full_disk_error(exc: BaseException, what: str | Path | None = None) -> QShardError | None:
    """The one-line error for `exc` if it is (or wraps) a full disk or exceeded quota, else None. Our own
    QShardErrors are already one line (a failed checkpoint save says what it was saving)."""
    if isinstance(exc, QShardError):
        return None
    code = _full_errno(exc)
    if code is None:
        return None
    what = what or getattr(exc, "filename", None)
    return QShardError(f"{_FULL[code]} while writing {what}" if what else f"{_FULL[code]} ({_one_line(exc)})")


def _full_errno(exc: BaseException) -> int | None:
    seen = 0
    while exc is not None and seen < 8:  # the exception, then what it was raised from or during
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc.errno
        text = str(exc)
        for words, code in _FULL_WORDING.items():
            if words in text:
                return code
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
