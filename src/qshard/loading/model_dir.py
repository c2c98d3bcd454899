"""A model directory's checkpoint: which weight file holds each tensor, and reads of one tensor at a time.

A Hugging Face model directory holds its weights in one safetensors file or in several with an index
(`model.safetensors.index.json`), or in the legacy PyTorch `.bin` equivalents. `Checkpoint` reads the index
and every file's header (shapes and dtypes, no weights), shows tensors stored in an older layout under the
names the model expects (`expert_layout`), and reads each tensor whole or says where its bytes are, so that
the read-ahead (`read_ahead`) can read it in pieces. The files themselves are read by `weight_files`.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path, PurePosixPath

import torch

from qshard.errors import QShardError
from qshard.loading import expert_layout
from qshard.loading.weight_files import SafetensorsFile, TensorInfo, TorchBinFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"
# Files of a model directory that hold weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class Checkpoint:
    """A single or sharded safetensors checkpoint (or a legacy PyTorch `.bin` one): which file holds each
    tensor, its shape and dtype from the file headers, and reads of one tensor at a time."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.files, self.index = self._tensor_files()
        if self.index is None:  # a single file holds every tensor
            single = self.dir / SINGLE_FILE
            paths = [single if single.is_file() else self.dir / BIN_FILE]
        else:
            paths = sorted(set(self.files.values()))
        self._readers = {p: (TorchBinFile if p.suffix == ".bin" else SafetensorsFile)(p) for p in paths}
        self._open_bin: TorchBinFile | None = None
        self._bin_lock = threading.Lock()  # reads come from several threads (load_weights)
        self._views: dict[str, expert_layout.Renamed | expert_layout.Stacked] = {}
        if self.index is None:
            self.files = dict.fromkeys(self._readers[paths[0]].tensors, paths[0])
        self._info: dict[str, TensorInfo] = {}
        for name, path in self.files.items():
            # The index is authoritative: a tensor that a shard holds but the index assigns elsewhere
            # (or nowhere) has no file to be read from.
            if name not in self._readers[path].tensors:
                raise QShardError(f"{path}: tensor '{name}' listed in {self.index.name} is absent")
            self._info[name] = self._readers[path].tensors[name]
        self._stored_files = dict(self.files)  # `files` lists what `adapt` shows; this, what is on disk

    def _tensor_files(self) -> tuple[dict[str, Path], Path | None]:
        for index_name in (INDEX_FILE, BIN_INDEX_FILE):
            index = self.dir / index_name
            if not index.is_file():
                continue
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {str(name): self._shard_path(index, name, fname) for name, fname in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise QShardError(f"{index}: not a valid checkpoint index ({exc})") from None
            missing = sorted({p for p in files.values() if not p.is_file()})
            if missing:
                raise QShardError(f"{index}: shard file {missing[0].name} is missing from {self.dir}")
            return files, index
        if (self.dir / SINGLE_FILE).is_file() or (self.dir / BIN_FILE).is_file():
            return {}, None
        raise QShardError(f"{self.dir}: no {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE} or {BIN_INDEX_FILE}")

    def _shard_path(self, index: Path, name: str, fname) -> Path:
        """The file an index entry names: a path inside the model directory, spelled relative to it.
        (A file there may be a symlink to elsewhere, as in the Hugging Face cache, whose snapshot files
        all point into its blob store: the directory's owner put it there, the index cannot.)"""
        if not isinstance(fname, str):
            raise TypeError(f"entry for '{name}' is {fname!r}, not a file name")
        parts = PurePosixPath(fname).parts
        if not parts or PurePosixPath(fname).is_absolute() or ".." in parts:
            raise QShardError(f"{index}: entry '{name}' names {fname!r}, which is not a file inside {self.dir}")
        return self.dir / fname

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name].dtype

    def adapt(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Show the tensors that an older layout stores differently (per-expert MoE tensors, renamed
        modules) under the names `expected` holds; the stored tensors they are made of are no longer listed."""
        found = expert_layout.views(expected, {n: (i.shape, i.dtype) for n, i in self._info.items()},
                                    lambda n: str(self.files[n]))
        for name, view in found.items():
            sources = view.sources()
            first = self._info[sources[0]]
            shape = expected[name] if isinstance(view, expert_layout.Stacked) else first.shape
            self.files[name] = self.files[sources[0]]
            self._info[name] = TensorInfo(first.dtype, shape, 0, first.dtype.itemsize * math.prod(shape))
            self._views[name] = view
        for view in found.values():
            for source in view.sources():
                self._info.pop(source, None)
                self.files.pop(source, None)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor, in its stored dtype, in memory of its own (no mapping of the file stays)."""
        if name in self._views:
            return self._views[name].read(self._read_stored)
        return self._read_stored(name)

    def segments(self, name: str) -> list[tuple[SafetensorsFile, str, int]] | None:
        """Where the tensor's bytes are, as (file, stored tensor, its byte count) whose bytes, one after the
        other, are the tensor's: the stored tensor itself, or for per-expert tensors stacked into a fused
        [experts, rows, cols] one, the experts' tensors in `sources()` order (each fills whole rows of its
        expert, so their bytes follow each other). Lets `load_weights` read a tensor in pieces, straight
        where it goes. None when a part is in a legacy .bin file, which is only read whole."""
        view = self._views.get(name)
        if view is not None and not isinstance(view, (expert_layout.Renamed, expert_layout.Stacked)):
            return None  # a layout not known to be a concatenation (none yet): read whole, through the view
        found = []
        for stored in view.sources() if view is not None else [name]:
            reader = self._readers[self._stored_files[stored]]
            if not isinstance(reader, SafetensorsFile):
                return None
            found.append((reader, stored, reader.tensors[stored].nbytes))
        # Stacked parts share the fused tensor's dtype (expert_layout checks it), so bytes add up to its bytes.
        assert sum(n for *_, n in found) == self._info[name].nbytes, (name, found)
        return found

    def _read_stored(self, name: str) -> torch.Tensor:
        reader = self._readers[self._stored_files[name]]
        if isinstance(reader, TorchBinFile):
            with self._bin_lock:
                if reader is not self._open_bin:
                    if self._open_bin is not None:
                        self._open_bin.close()  # at most one .bin mapping at a time
                    self._open_bin = reader
                return reader.read(name)
        return reader.read(name)

    def close(self) -> None:
        if self._open_bin is not None:
            self._open_bin.close()
            self._open_bin = None
