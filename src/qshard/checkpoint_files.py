"""A checkpoint's files as data, never as code: checksums of what DCP wrote, its `.metadata` read by an
unpickler that builds only the classes DCP's own metadata is made of, and its non-tensor entries read
with torch's weights-only unpickler.

torch's DCP reads `.metadata` with a plain pickle load, and the non-tensor entries of the shards (the
optimizer's settings) with `torch.load(weights_only=False)`: both run whatever a crafted file asks for.
A checkpoint is something a user may have downloaded or copied, so qshard reads the metadata itself,
first, and hands DCP the result, and gives DCP a planner that unpickles those entries safely. Checksums
(CRC-32: fast, and what a flipped bit or a truncated copy needs) are recorded per file at save time and
checked before a checkpoint's tensors are loaded.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from qshard.errors import QShardError

METADATA_FILE = ".metadata"
_CHUNK = 8 << 20
# A file's checksum is one CRC-32 per piece of this many bytes, so that the pieces of a large shard are
# checksummed on several threads at once (zlib releases the GIL): one thread alone would add seconds to
# every blocking save and every load of an 8B run's checkpoint (docs/benchmarks.md).
PIECE_BYTES = 64 << 20
_THREADS = max(1, min(8, os.cpu_count() or 1))

# (module, name) of everything a DCP `.metadata` pickle refers to: the metadata dataclasses, the file
# reader's per-item record, torch.Size, the layout lookup that torch.layout pickles through, and the
# checkpoint's own path. TensorProperties also has an older home in torch's sharded-tensor package, and
# pathlib's classes a newer one in Python's; names a given torch or Python lacks are simply never found.
_DCP = "torch.distributed.checkpoint.metadata"
_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"
_ALLOWED = frozenset({
    (_DCP, "Metadata"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"), (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"), (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "_MEM_FORMAT_ENCODING"), (_SHARDED, "TensorProperties"), (_SHARDED, "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the allowed classes and torch dtypes; any other global ends the read before it is looked up."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        if (module, name) in _ALLOWED:
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
        raise QShardError(f"{self.path}: refused: it asks to load {module}.{name}, which no DCP checkpoint's "
                          "metadata holds (a foreign or altered file)")


def read_metadata(path: Path, recorded: dict | None) -> Metadata:
    """The DCP metadata in `path` (a `.metadata` file), checked against its `recorded` size and checksum
    when the checkpoint has them, and unpickled without running anything the file asks for."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QShardError(f"{path}: cannot read checkpoint metadata ({exc.strerror or exc})") from None
    if recorded is not None:
        _check(path, len(data), bytes_record(data)["crc32"], recorded)
    try:
        metadata = _MetadataUnpickler(data, path).load()
    except QShardError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle makes the unpickler raise
        raise QShardError(f"{path}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise QShardError(f"{path}: not DCP checkpoint metadata (it holds a {type(metadata).__name__})")
    return metadata


def recorded_files(state: dict, state_file: Path) -> dict[str, dict] | None:
    """The per-file sizes and checksums a checkpoint's state records (None: saved before qshard kept them)."""
    files = state.get("files")
    if files is None:
        return None
    if not (isinstance(files, dict) and METADATA_FILE in files and all(_valid_record(n, r) for n, r in files.items())):
        raise QShardError(f"{state_file}: corrupt checkpoint state (its 'files' entry)")
    return files


def _valid_record(name: str, record: dict) -> bool:
    # A recorded name is a file in the checkpoint directory itself, never a path elsewhere.
    plain = name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
    if not (plain and isinstance(record, dict) and isinstance(record.get("bytes"), int) and record["bytes"] >= 0):
        return False
    crcs = record.get("crc32")
    return isinstance(crcs, list) and len(crcs) == _pieces(record["bytes"]) and all(
        isinstance(c, str) and re.fullmatch(r"[0-9a-f]{8}", c) for c in crcs)


def _pieces(size: int) -> int:
    return max(1, -(-size // PIECE_BYTES))


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a non-tensor entry is first read with `weights_only=True` and handed on
    re-serialized from that: DCP's own reading of it never sees the file's bytes."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__()
        self.directory, self.checked = directory, metadata

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            file = self.directory / self.checked.storage_data[read_item.storage_index].relative_path
            found = re.search(r"WeightsUnpickler error: (.*?)\.?(?: Please|$)", str(exc), re.MULTILINE)
            raise QShardError(f"{file}: refused: its entry {read_item.dest_index.fqn} is not plain data "
                              f"({found.group(1) if found else 'not loadable with weights_only'}): a foreign "
                              "or altered file") from None
        checked = io.BytesIO()
        torch.save(obj, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def data_files(metadata: Metadata, path: Path) -> set[str]:
    """The files (relative to the checkpoint directory) that hold what the metadata (read from `path`)
    describes."""
    storage = metadata.storage_data
    names = {getattr(info, "relative_path", None) for info in storage.values()} if isinstance(storage, dict) else {0}
    if not all(isinstance(name, str) for name in names):
        raise QShardError(f"{path}: not DCP checkpoint metadata (its storage entries name no files)")
    return names


def file_record(path: Path) -> dict:
    """What is recorded per file at save time: its size and the CRC-32 of each PIECE_BYTES of it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with ThreadPoolExecutor(min(_THREADS, _pieces(size))) as pool:
            crcs = list(pool.map(lambda i: _piece_crc(fd, i * PIECE_BYTES, size), range(_pieces(size))))
    finally:
        os.close(fd)
    return {"bytes": size, "crc32": crcs}


def bytes_record(data: bytes) -> dict:
    """`file_record` of a file holding `data`."""
    view = memoryview(data)
    crcs = [f"{zlib.crc32(view[i * PIECE_BYTES:(i + 1) * PIECE_BYTES]):08x}" for i in range(_pieces(len(data)))]
    return {"bytes": len(data), "crc32": crcs}


def _piece_crc(fd: int, start: int, size: int) -> str:
    """The CRC-32 of bytes [start, start + PIECE_BYTES) of the open file `fd` of `size` bytes (fewer at its end)."""
    end, crc = min(start + PIECE_BYTES, size), 0
    buf = memoryview(bytearray(min(_CHUNK, max(end - start, 1))))
    while start < end:
        n = os.preadv(fd, [buf[: min(len(buf), end - start)]], start)
        if not n:
            break  # shorter than it was a moment ago: the size comparison will say so
        crc = zlib.crc32(buf[:n], crc)
        start += n
    return f"{crc:08x}"


def check_sizes(directory: Path, recorded: dict[str, dict]) -> None:
    """Each recorded file is there with its recorded size (a stat per file: catches a truncated copy early)."""
    for name, entry in sorted(recorded.items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            raise QShardError(f"{path}: missing (the checkpoint had it when it was saved)") from None
        _check_size(path, size, entry)


def first_mismatch(directory: Path, recorded: dict[str, dict]) -> str | None:
    """The first of `recorded`'s files whose contents differ from what was saved, as a one-line message."""
    for name, entry in sorted(recorded.items()):
        path = directory / name
        try:
            actual = file_record(path)
        except OSError as exc:
            return f"{path}: cannot read checkpoint file ({exc.strerror or exc})"
        try:
            _check(path, actual["bytes"], actual["crc32"], entry)
        except QShardError as exc:
            return str(exc)
    return None


def _check(path: Path, size: int, crcs: list[str], entry: dict) -> None:
    _check_size(path, size, entry)
    differ = next((i for i, (a, b) in enumerate(zip(crcs, entry["crc32"])) if a != b), None)
    if differ is not None:
        start = differ * PIECE_BYTES
        raise QShardError(f"{path}: checksum mismatch in bytes [{start:,}, {min(start + PIECE_BYTES, size):,}) "
                          f"(crc32 {crcs[differ]}, saved {entry['crc32'][differ]}): the file changed after it was "
                          "saved; restore it, or use another checkpoint")


def _check_size(path: Path, size: int, entry: dict) -> None:
    if size != entry["bytes"]:
        raise QShardError(f"{path}: {size:,} bytes, but {entry['bytes']:,} were saved: the file was truncated "
                          "or changed after it was saved")
