"""Directories qshard writes where the user points (`--out`, a run's adapter/): nothing qshard did not write
is ever overwritten or deleted, and nothing half-written ever carries the final name.

Each is written into a fresh, uniquely named hidden directory beside its destination and renamed into
place once complete. An export also gets a marker file naming its kind and every file it wrote: only a
directory holding such a marker of the same kind, and nothing the marker does not list, counts as a
previous export that may be replaced; it is swapped aside first, and then only the files it lists are
deleted, so that a failure at any moment leaves the old export or the new one whole."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from qshard.errors import QShardError

log = logging.getLogger("qshard")

# Written into every export: {"kind": "adapter" | "merged", "files": [the names it wrote]}.
MARKER = ".qshard-export.json"


def check_target(dest: Path, what: str = "", kind: str | None = None) -> None:
    """Refuse `dest` (QShardError) unless it is absent, an empty directory, or, given `kind`, a previous
    qshard export of that kind holding nothing its marker does not list. `what` (e.g. `--out`) names the
    option in the message."""
    label = f"{what} {dest}" if what else str(dest)
    if dest.is_symlink():
        raise QShardError(f"{label}: is a symbolic link; give the directory it points to, or another one")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise QShardError(f"{label}: exists and is not a directory")
    entries = sorted(p.name for p in dest.iterdir())
    if not entries:
        return
    if kind is None:
        raise QShardError(f"{label}: already exists and is not an empty directory ({_some(entries)})")
    marker = read_marker(dest)
    if marker is None:
        raise QShardError(f"{label}: holds files qshard did not write there ({_some(entries)}); "
                          "move them away or choose another directory")
    if marker["kind"] != kind:
        raise QShardError(f"{label}: holds a qshard {marker['kind']} export, which `qshard export {kind}` "
                          "does not replace; choose another directory")
    foreign = [n for n in entries if n != MARKER and not (n in marker["files"] and _plain_file(dest / n))]
    if foreign:
        raise QShardError(f"{label}: holds files the qshard {kind} export there did not write ({_some(foreign)}); "
                          "move them away or choose another directory")


def read_marker(directory: Path) -> dict | None:
    """The export marker of `directory`, or None where there is none (or it is not one qshard wrote)."""
    path = directory / MARKER
    if not _plain_file(path):
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (not isinstance(marker, dict) or not isinstance(marker.get("kind"), str)
            or not isinstance(marker.get("files"), list) or not all(isinstance(f, str) for f in marker["files"])):
        return None
    return marker


@contextlib.contextmanager
def staged(dest: str | Path, what: str = "", kind: str | None = None) -> Iterator[Path]:
    """Yield a fresh directory to write `dest`'s contents into; when the block completes it takes `dest`'s
    place (with `kind`: marked as an export of that kind, replacing a previous one). `dest` is checked
    (`check_target`) before and again just before the swap; on any error the fresh directory is removed
    and `dest` is as it was."""
    dest = Path(os.path.abspath(dest))  # not resolved: a symbolic link must be refused, not followed
    check_target(dest, what, kind)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        yield tmp
        if kind is not None:
            files = sorted(p.name for p in tmp.iterdir() if p.name != MARKER)
            (tmp / MARKER).write_text(json.dumps({"kind": kind, "files": files}, indent=2) + "\n")
        _publish(tmp, dest, what, kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, dest: Path, what: str, kind: str | None) -> None:
    check_target(dest, what, kind)  # again: a long export gives the user time to put files there
    if not dest.exists():
        tmp.rename(dest)  # fails, leaving it alone, should a non-empty directory appear there meanwhile
        return
    if not any(dest.iterdir()):
        dest.rmdir()
        tmp.rename(dest)
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex}"
    dest.rename(old)
    try:
        tmp.rename(dest)
    except BaseException:
        old.rename(dest)
        raise
    _remove_export(old)


def _remove_export(old: Path) -> None:
    """Delete the files a replaced export's marker lists, then its directory if nothing else is left."""
    marker = read_marker(old)
    assert marker is not None, old  # checked just before it was swapped aside
    for name in [*marker["files"], MARKER]:
        if _plain_file(old / name):
            (old / name).unlink()
    try:
        old.rmdir()
    except OSError:
        log.warning("kept %s: the export it replaced held files it did not write", old)


def _plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
