"""Hugging Face `datasets` sources: directories written by `save_to_disk`, `.arrow` files, and hub dataset
names. All of them end up as memory-mapped Arrow tables, read a batch of rows at a time, so a dataset larger
than RAM streams through like a JSONL file.

`datasets` is an optional dependency (`pip install 'qshard[data]'`): it is imported only when such a
source is read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qshard.errors import QShardError

INSTALL_HINT = "pip install 'qshard[data]'"
ROWS_PER_BATCH = 1024


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise QShardError(f"{what}: reading Hugging Face datasets needs the datasets package: {INSTALL_HINT}") from None
    return datasets


def is_saved_dataset(directory: Path) -> bool:
    """Whether `directory` was written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    if (directory / "dataset_dict.json").is_file():
        return True
    return (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file()


def _rows(dataset: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row; a saved format (torch, numpy) is dropped so rows are plain Python."""
    row = 0
    for batch in dataset.with_format(None).iter(batch_size=ROWS_PER_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            row += 1
            yield f"{where}:row {row}", dict(zip(columns, values))


def read_saved(directory: Path, split: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of a `save_to_disk` directory; for a DatasetDict, of `split` (which may be left out when the
    directory holds only one)."""
    datasets = _datasets(str(directory))
    try:
        loaded = datasets.load_from_disk(str(directory), keep_in_memory=False)
    except Exception as e:  # datasets raises many types for a damaged directory
        raise QShardError(f"{directory}: not a readable saved Hugging Face dataset ({_first_line(e)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            asked = f"has no split {split!r}" if split is not None else "holds several splits"
            raise QShardError(
                f"{directory}: the saved DatasetDict {asked} (it has {', '.join(splits)}); choose one with the "
                f"source's split option, or give the split's own directory, {directory}/<split>"
            )
        yield from _rows(loaded[split], f"{directory} (split {split})")
    else:
        if split is not None:
            raise QShardError(f"{directory}: a saved Dataset has no splits, but split {split!r} was asked for")
        yield from _rows(loaded, str(directory))


def read_arrow(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of one `.arrow` file as `datasets` writes them (its cache files and save_to_disk shards)."""
    datasets = _datasets(str(path))
    try:
        dataset = datasets.Dataset.from_file(str(path))
    except Exception as e:  # pyarrow and datasets raise their own error types for a bad file
        raise QShardError(f"{path}: not a readable Arrow file ({_first_line(e)})") from None
    yield from _rows(dataset, str(path))


class HubDataset:
    """A dataset named on the Hugging Face Hub (or one already in the local Hugging Face cache).

    `load` downloads it into the Hugging Face cache (once; later calls on this object reuse it), where it
    is stored as Arrow files that are then memory-mapped; `option` is the configuration key that named it,
    for error messages."""

    def __init__(self, name: str, split: str | None, subset: str | None, revision: str | None, option: str):
        self.name, self.subset, self.revision, self.option = name, subset, revision, option
        self.split = split or "train"
        self._dataset: Any = None

    def __str__(self) -> str:
        details = [f"split {self.split}"] + [
            f"{k} {v}" for k, v in (("subset", self.subset), ("revision", self.revision)) if v
        ]
        return f"hub dataset {self.name} ({', '.join(details)})"

    def identity(self) -> dict[str, Any]:
        """What names the data, for the tokenization cache key: the request and the files it resolved to
        (a new revision of the dataset downloads new files)."""
        files = []
        for entry in self.load().cache_files:
            stat = os.stat(entry["filename"])
            files.append([entry["filename"], stat.st_size, stat.st_mtime_ns])
        return {"hub": self.name, "split": self.split, "subset": self.subset, "revision": self.revision, "files": files}

    def load(self) -> Any:
        if self._dataset is None:
            self._dataset = self._load()
        return self._dataset

    def _load(self) -> Any:
        datasets = _datasets(f"{self.option}: {self.name}")
        try:
            return datasets.load_dataset(self.name, self.subset, split=self.split, revision=self.revision)
        except Exception as e:  # network, hub and builder errors all end the same way: the user must act
            raise QShardError(self._load_error(datasets, e)) from None

    def _load_error(self, datasets: Any, error: Exception) -> str:
        where = f"{self.option}: cannot load {self}"
        if datasets.config.HF_HUB_OFFLINE:
            return (
                f"{where}: the Hugging Face Hub is switched off here (HF_HUB_OFFLINE=1) and the dataset is "
                "not in the local Hugging Face cache; download it on a machine with network access, or use "
                "a local copy (save_to_disk) as the source's path"
            )
        if isinstance(error, ConnectionError | TimeoutError):
            return (
                f"{where}: the Hugging Face Hub cannot be reached ({_first_line(error)}) and the dataset is "
                "not in the local Hugging Face cache; use a local copy (save_to_disk) as the source's path"
            )
        return f"{where}: {_first_line(error)}"

    def records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return _rows(self.load(), str(self))


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
