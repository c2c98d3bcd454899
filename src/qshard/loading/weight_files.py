"""Read checkpoint files tensor by tensor, without keeping them memory-mapped.

A memory-mapped file's touched pages count as the process's resident memory until it is unmapped, so
streaming a whole checkpoint through a mapping costs as much RSS as the checkpoint (16 GiB for an 8B
model). Here each tensor (or a piece of it) is read with plain file reads into a buffer the caller owns: the
file's pages stay in the kernel's page cache (shared, reclaimable, not ours) and the process holds only the
few tensors or pieces it is reading.

safetensors layout: an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and [begin, end) byte offsets into the data that follows the header.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qshard.errors import QShardError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute position in the file
    nbytes: int


class SafetensorsFile:
    """The header of one safetensors file, checked against the file's size; tensors read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    self._fail(f"{size} bytes, too short for a header")
                header_len = int.from_bytes(head, "little")
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    self._fail(f"header length {header_len} exceeds the file's {size} bytes (truncated?)")
                raw = f.read(header_len)
        except OSError as exc:
            self._fail(str(exc))
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, or nesting deep enough to overflow
            self._fail(f"header is not valid JSON ({type(exc).__name__}: {exc})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}  # safetensors reads `null` as no metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            self._fail("__metadata__ is not a map of strings to strings")
        self.tensors = {name: self._entry(name, e, 8 + header_len, size) for name, e in header.items()}
        self._check_tiling(8 + header_len, size)

    def _fail(self, reason: str, name: str | None = None):
        what = f"tensor '{name}': " if name else ""
        raise QShardError(f"{self.path}: cannot read safetensors file ({what}{reason})")

    def _entry(self, name: str, entry, data_start: int, size: int) -> TensorInfo:
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape, offsets = entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError):
            self._fail(f"malformed header entry {entry!r}", name)
        # As safetensors reads them: lists of non-negative JSON integers (not floats, strings or booleans).
        if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int and x >= 0 for x in shape + offsets)):
            self._fail(f"malformed header entry {entry!r}", name)
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes:
            self._fail(f"offsets {[begin, end]} do not fit dtype {entry['dtype']} shape {shape}", name)
        if data_start + end > size:
            self._fail(f"data ends at byte {data_start + end}, past the file's end at {size} (truncated?)", name)
        return TensorInfo(dtype, tuple(shape), data_start + begin, nbytes)

    def _check_tiling(self, data_start: int, size: int) -> None:
        """The tensors' byte ranges, in file order, must cover the data area exactly, as safetensors' own
        reader requires: no two tensors share bytes, and no bytes lie between them or after the last."""
        spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in self.tensors.items())
        reached, previous = data_start, None
        for begin, end, name in spans:
            if begin < reached:
                self._fail(f"bytes [{begin - data_start}, {end - data_start}) of the data overlap those of tensor "
                           f"'{previous}'", name)
            if begin > reached:
                self._fail(f"starts at byte {begin - data_start} of the data, leaving bytes "
                           f"[{reached - data_start}, {begin - data_start}) that no tensor holds", name)
            reached, previous = end, name
        if reached != size:
            self._fail(f"the last tensor's data ends at byte {reached}, but the file goes on to byte {size}")

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_range(name, 0, memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out

    def read_range(self, name: str, start: int, out) -> None:
        """Bytes [start, start + len(out)) of tensor `name` into the writable buffer `out`: a piece of a tensor,
        so that several threads can read one large tensor at once, or so that it lands straight in a reused
        (pinned) staging buffer. Each call opens the file itself, so calls from several threads are safe."""
        info = self.tensors[name]
        view = memoryview(out).cast("B")
        if start < 0 or start + len(view) > info.nbytes:
            raise ValueError(f"bytes [{start}, {start + len(view)}) are outside tensor '{name}' ({info.nbytes} bytes)")
        try:
            # Unbuffered: straight from the page cache into `out`, no intermediate copy (and without the GIL).
            with open(self.path, "rb", buffering=0) as f:
                f.seek(info.offset + start)
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        self._fail("file ended while reading (truncated since it was opened?)", name)
                    done += n
        except OSError as exc:
            self._fail(str(exc), name)


class TorchBinFile:
    """A legacy PyTorch `.bin` state dict, read safely: `weights_only=True` runs no pickled code.

    `mmap=True` keeps the tensors in the file until touched; the mapping lives only while this file is
    the one being read (the caller keeps at most one open), so its resident pages are bounded by one shard."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._state: dict[str, torch.Tensor] | None = None
        state = self._load()
        self.tensors = {name: TensorInfo(t.dtype, tuple(t.shape), 0, t.nbytes) for name, t in state.items()}
        self.close()

    def _load(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            try:
                state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - unpickling raises anything from RuntimeError to EOFError
                raise QShardError(f"{self.path}: cannot read PyTorch weights file ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise QShardError(f"{self.path}: not a state dict of tensors")
            self._state = state
        return self._state

    def read(self, name: str) -> torch.Tensor:
        return self._load()[name].clone()  # a copy: the mapping goes when the file is closed

    def close(self) -> None:
        self._state = None


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in a planned order.

    Every tensor's name, dtype and shape is known before any is read (from the source headers), so the
    header (with every offset) goes first and each tensor is written the moment it is ready: the
    writer holds none of them, unlike `safetensors.torch.save_file`, which needs the whole dict."""

    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in plan:
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        self.path = path
        self._order = [(name, dtype, tuple(shape)) for name, dtype, shape in plan]
        self._next = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close(), after the last tensor
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next]
        assert (name, tensor.dtype, tuple(tensor.shape)) == expected, ((name, tensor.dtype, tensor.shape), expected)
        self._file.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        assert self._next == len(self._order), f"{self.path}: {len(self._order) - self._next} tensor(s) unwritten"
