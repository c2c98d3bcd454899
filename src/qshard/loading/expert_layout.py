"""Checkpoints in the layouts the Hub holds, read under the names transformers 5 models expect.

Mixtral and Qwen3-MoE checkpoints store each expert's projections as separate 2-D tensors
(`...block_sparse_moe.experts.3.w1.weight`, `...mlp.experts.3.gate_proj.weight`), while transformers 5
builds one fused 3-D parameter per projection kind: `experts.gate_up_proj` [experts, 2 * inter, hidden]
(each expert's gate rows, then its up rows) and `experts.down_proj` [experts, hidden, inter]. Mixtral's
checkpoints also name the MoE module `block_sparse_moe` where the model says `mlp`.

Only names the model expects and the checkpoint lacks are looked up this way, so a checkpoint already in
the fused layout (or a model that still wants per-expert tensors) is read as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qshard.errors import QShardError

# Fused parameter -> the per-expert tensors stacked into its rows, in order, as each family names them.
FUSED_PARTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}
# Module names older checkpoints use for what transformers 5 calls the first one.
OLD_MODULE_NAMES = {"mlp": ("block_sparse_moe",)}
_FUSED = re.compile(rf"^(?P<module>.+\.experts)\.(?P<param>{'|'.join(FUSED_PARTS)})$")

Info = tuple[tuple[int, ...], torch.dtype]  # a stored tensor's shape and dtype


@dataclass(frozen=True)
class Renamed:
    stored: str

    def sources(self) -> list[str]:
        return [self.stored]

    def read(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return read(self.stored)


@dataclass(frozen=True)
class Stacked:
    """A fused [experts, out, in] tensor assembled from `parts[e]`, expert e's tensors stacked by rows."""

    parts: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def sources(self) -> list[str]:
        return [name for expert in self.parts for name in expert]

    def read(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """One stored tensor at a time: beyond the fused result, at most one expert's part is held."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for e, names in enumerate(self.parts):
            row = 0
            for name in names:
                part = read(name)
                out[e, row : row + part.shape[0]] = part
                row += part.shape[0]
                del part
        return out


def _candidates(name: str) -> list[str]:
    """`name`, then `name` with a module renamed to an older name for it."""
    out = [name]
    for new, olds in OLD_MODULE_NAMES.items():
        out += [name.replace(f".{new}.", f".{old}.") for old in olds if f".{new}." in name]
    return out


def views(
    expected: dict[str, tuple[int, ...]], stored: dict[str, Info], where: Callable[[str], str]
) -> dict[str, Renamed | Stacked]:
    """For each expected tensor the checkpoint lacks, how to make it from the stored ones (where possible).
    What stays missing is left for the caller to report. `where(name)` names the file for errors."""
    found: dict[str, Renamed | Stacked] = {}
    for name, shape in expected.items():
        if name in stored:
            continue
        renamed = next((c for c in _candidates(name)[1:] if c in stored), None)
        if renamed is not None:
            found[name] = Renamed(renamed)
            continue
        match = _FUSED.match(name)
        if match and len(shape) == 3:
            stacked = _stacked(name, match["param"], shape, stored, where)
            if stacked is not None:
                found[name] = stacked
    return found


def _stacked(
    name: str, param: str, shape: tuple[int, ...], stored: dict[str, Info], where: Callable[[str], str]
) -> Stacked | None:
    experts, rows, cols = shape
    module = name.rsplit(".", 1)[0]
    for prefix in _candidates(module + "."):
        for kinds in FUSED_PARTS[param]:
            parts = tuple(tuple(f"{prefix}{e}.{kind}.weight" for kind in kinds) for e in range(experts))
            if not all(p in stored for p in parts[0]):
                continue
            missing = [p for expert in parts for p in expert if p not in stored]
            if missing:
                raise QShardError(
                    f"{where(parts[0][0])}: checkpoint has no tensor '{missing[0]}' needed to build "
                    f"'{name}' {list(shape)} from per-expert tensors"
                )
            dtype = stored[parts[0][0]][1]
            for expert in parts:
                got = [stored[p][0] for p in expert]
                if any(len(s) != 2 or s[1] != cols for s in got) or sum(s[0] for s in got) != rows:
                    raise QShardError(
                        f"{where(expert[0])}: per-expert tensors {list(expert)} have shapes {[list(s) for s in got]}, "
                        f"but config.json implies '{name}' {list(shape)}"
                    )
                if any(stored[p][1] != dtype for p in expert):
                    raise QShardError(f"{where(expert[0])}: per-expert tensors of '{name}' differ in dtype")
            return Stacked(parts, shape, dtype)
    return None
