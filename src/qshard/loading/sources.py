"""Weights from elsewhere than this process's own files: random values, or rank 0's files over the network.

Under broadcast loading only rank 0 reads the model directory: it sends every other rank the directory's
non-weight files (`model_files_from_rank0`) and then each tensor (`BroadcastSource`).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from qshard.errors import QShardError
from qshard.hf_config import load_hf_config
from qshard.loading.model_dir import WEIGHT_SUFFIXES, Checkpoint
from qshard.loading.plan import expected_tensors
from qshard.parallel.distributed import from_rank0, one_line
from qshard.random_model import random_tensor


class RandomSource:
    """Random weights for a model with no checkpoint, generated tensor by tensor on `device` (so a 70B
    shape costs one tensor of host memory at most, none on a GPU run).

    Each tensor's values depend only on the seed and its name, so every rank, whatever the world size,
    generates the same full tensor and keeps its own slice; `random_model.write_random_checkpoint` writes
    the same values."""

    def __init__(self, model: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.expected = expected_tensors(model)
        self.seed, self.device, self.dtype = seed, device, dtype

    def read(self, name: str) -> torch.Tensor:
        return random_tensor(name, self.expected[name], self.seed, self.device, self.dtype)


class BroadcastSource:
    """Rank 0 reads each tensor from its files and broadcasts it; the other ranks need no files.

    Every rank first gets rank 0's view of the checkpoint (names, shapes, dtypes, which file) or its
    error, so all of them run the same checks and raise the same QShardError."""

    prefetch = False  # collectives stay on the main thread, in plan order

    def __init__(self, model_dir: str | Path, is_main: bool, device: torch.device) -> None:
        self._ckpt: Checkpoint | None = None
        self.device = device
        self._share(lambda: setattr(self, "_ckpt", Checkpoint(model_dir)) if is_main else None)

    def adapt(self, expected: dict[str, tuple[int, ...]]) -> None:
        """`Checkpoint.adapt` on rank 0; every rank then gets the names it shows (a collective)."""
        self._share(lambda: self._ckpt.adapt(expected) if self._ckpt is not None else None)

    def _share(self, on_main: Callable[[], None]) -> None:
        """Run `on_main` (a no-op on the other ranks), then give every rank rank 0's view, or its error."""
        meta: list = [None]
        try:
            on_main()
            if self._ckpt is not None:
                ckpt = self._ckpt
                meta[0] = ("ok", str(ckpt.dir), ckpt.index and str(ckpt.index),
                           {n: (ckpt.shape(n), ckpt.dtype(n), str(ckpt.files[n])) for n in ckpt.names()})
        except Exception as exc:  # any failure on rank 0 must reach the others, which wait in the broadcast
            meta[0] = ("error", one_line(exc))
        dist.broadcast_object_list(meta, src=0)
        if meta[0][0] == "error":
            raise QShardError(meta[0][1])
        _, directory, index, tensors = meta[0]
        self.dir, self.index = Path(directory), index and Path(index)
        self._info = {n: (tuple(shape), dtype) for n, (shape, dtype, _) in tensors.items()}
        self.files = {n: Path(p) for n, (_, _, p) in tensors.items()}

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name][1]

    def read(self, name: str) -> torch.Tensor:
        shape, dtype = self._info[name]
        if self._ckpt is not None:
            tensor = self._ckpt.read(name).to(self.device)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        # As bytes: every backend broadcasts uint8, not every one bf16 or bool.
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=0)
        return tensor

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


# Every file of a model directory but its weights (config, tokenizer, generation config) is what a rank needs
# besides the weights.
SHARED_FILE_MAX_BYTES = 256 << 20  # larger non-weight files (an optimizer dump left in the directory) stay


def model_files_from_rank0(model_dir: str | Path | None, is_main: bool) -> Path:
    """Under broadcast loading: rank 0's model directory on rank 0; on every other rank, a local temporary
    directory holding copies of its config.json and tokenizer files, sent by rank 0 (a collective). The
    other ranks need no access to the model directory at all."""

    def read() -> dict[str, bytes]:
        if model_dir is None:
            raise QShardError("model.path: no model directory given (and no model.shape)")
        load_hf_config(model_dir)  # checks the directory and config.json, as every load does
        return {f.name: f.read_bytes() for f in sorted(Path(model_dir).iterdir())
                if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size <= SHARED_FILE_MAX_BYTES}

    files = from_rank0(read, is_main)
    if is_main:
        return Path(model_dir)
    local = Path(tempfile.mkdtemp(prefix="qshard-model-files-"))
    atexit.register(shutil.rmtree, local, True)
    for name, data in files.items():
        (local / name).write_bytes(data)
    return local
