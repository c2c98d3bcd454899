"""Llama-Pro block expansion (Wu et al., 2024): `qshard expand` writes a deeper copy of a checkpoint, and
`train.train_type: llama_pro` trains only the blocks it added (`models.new_blocks` finds them).

The L original blocks are split into N groups of L/N; after each group comes a copy of the group's last
block whose residual-stream writers (the attention output `o_proj` and the MLP output `down_proj`, per
expert in a mixture of experts) are zero. Such a block adds nothing to the residual stream, so the
expanded model computes exactly what the original did until the new blocks are trained.

The copy streams one tensor at a time from the source files into safetensors files whose headers are
written first (`SafetensorsWriter`), so the model is never in memory; the output appears only once
complete (written as a sibling `.tmp` directory and renamed).
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from qshard import outputs
from qshard.errors import QShardError
from qshard.hf_config import load_hf_config
from qshard.loading import INDEX_FILE, SINGLE_FILE, WEIGHT_SUFFIXES, Checkpoint
from qshard.loading.weight_files import SafetensorsWriter
from qshard.models import LLAMA_PRO_MARKER as MARKER

log = logging.getLogger("qshard")

# Module names of the linears that write into the residual stream, zeroed in a new block: the attention
# output, and the MLP output (dense, fused experts `experts.down_proj`, or Mixtral's per-expert `w2`).
ATTENTION_OUTPUTS = ("o_proj",)
MLP_OUTPUTS = ("down_proj", "w2")
_LAYER = re.compile(r"^(?P<stem>(?:.+\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class _Tensor:
    name: str  # in the expanded checkpoint
    source: str  # in the original one
    zero: bool  # a residual-stream writer of a new block


def layer_sources(layers: int, new_blocks: int) -> list[tuple[int, bool]]:
    """(source layer, is new) for each layer of the expanded model."""
    group = layers // new_blocks
    out: list[tuple[int, bool]] = []
    for g in range(new_blocks):
        out += [(g * group + j, False) for j in range(group)]
        out.append((g * group + group - 1, True))
    return out


def expand_checkpoint(
    model_dir: str | Path, out_dir: str | Path, new_blocks: int, max_shard_bytes: int | None = None
) -> list[int]:
    """Write the expanded checkpoint to `out_dir`; return the indices of the new layers.

    `max_shard_bytes`: the largest output file; by default the input's largest weight file (a single-file
    input stays a single file)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise QShardError(f"--output: {out_dir} already exists and is not an empty directory")
    hf_config = load_hf_config(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    if MARKER in raw:
        raise QShardError(f"{model_dir / 'config.json'}: this model is already expanded ({MARKER} is set)")
    layers = hf_config.num_hidden_layers
    if new_blocks < 1 or layers % new_blocks:
        divisors = [d for d in range(1, layers + 1) if layers % d == 0]
        raise QShardError(
            f"--new-blocks {new_blocks}: must divide the model's {layers} layers "
            f"(num_hidden_layers in config.json), e.g. one of {divisors}"
        )
    sources = layer_sources(layers, new_blocks)
    ckpt = Checkpoint(model_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    _remove_leftover(tmp)
    try:
        plan = _plan(ckpt, layers, sources)
        if max_shard_bytes is None:
            max_shard_bytes = max(p.stat().st_size for p in set(ckpt.files.values())) if ckpt.index else None
        tmp.mkdir(parents=True)
        (tmp / PARTIAL_MARKER).touch()  # says whose directory this is, until the rename below
        _write_config(tmp, raw, sources, layers)
        _check_layers(hf_config, load_hf_config(tmp), sources)
        for item in model_dir.iterdir():  # tokenizer, generation config, ...
            if _describes_model(item):
                shutil.copy2(item, tmp / item.name)
        _write_weights(tmp, ckpt, plan, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a refused or interrupted expansion leaves nothing behind
        raise
    finally:
        ckpt.close()
    (tmp / PARTIAL_MARKER).unlink()
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    tmp.rename(out_dir)
    return [k for k, (_, new) in enumerate(sources) if new]


# Written first into the temporary output directory: only a directory holding it is ours to delete.
PARTIAL_MARKER = ".qshard-expand-partial"


def _remove_leftover(tmp: Path) -> None:
    """Delete what an interrupted expansion left at `tmp`, and nothing else that may be there."""
    if not tmp.exists():
        return
    if not (tmp / PARTIAL_MARKER).is_file():
        raise QShardError(f"--output: {tmp} exists and was not left by an interrupted qshard expand; remove or "
                          "rename it")
    shutil.rmtree(tmp)


def _describes_model(item: Path) -> bool:
    """A file to copy as it is: not a weight file, nor config.json (rewritten), nor the marker of an export
    the source may be (the expansion is no export: a later export must not take it for one to replace)."""
    return (item.is_file() and item.name not in ("config.json", outputs.MARKER)
            and not item.name.endswith(WEIGHT_SUFFIXES))


def _plan(ckpt: Checkpoint, layers: int, sources: list[tuple[int, bool]]) -> list[_Tensor]:
    """Every tensor of the expanded checkpoint, where it comes from, and whether it is zeroed."""
    per_layer: dict[int, list[tuple[str, str]]] = {}
    others, stems = [], set()
    for name in sorted(ckpt.names()):
        match = _LAYER.match(name)
        if match is None:
            others.append(_Tensor(name, name, False))
            continue
        stems.add(match["stem"])
        per_layer.setdefault(int(match["index"]), []).append((match["rest"], name))
    if len(stems) != 1 or sorted(per_layer) != list(range(layers)):
        raise QShardError(
            f"{ckpt.dir}: cannot find the {layers} transformer layers as '<prefix>.layers.<i>.*' "
            f"tensors (found prefixes {sorted(stems)} and layers {sorted(per_layer)[:8]}...)"
        )
    stem = stems.pop()
    plan = others
    for k, (j, new) in enumerate(sources):
        for rest, source in per_layer[j]:
            plan.append(_Tensor(f"{stem}.{k}.{rest}", source, new and _writes_residual(rest)))
    for j in sorted({j for j, new in sources if new}):
        modules = {part for rest, _ in per_layer[j] for part in rest.split(".")}
        for what, names in (("attention output", ATTENTION_OUTPUTS), ("MLP output", MLP_OUTPUTS)):
            if not modules & set(names):
                raise QShardError(
                    f"{ckpt.dir}: layer {j} has no {what} projection ({' or '.join(names)}), which Llama-Pro "
                    "zeroes to make a copied block the identity; this architecture cannot be expanded"
                )
    return plan


def _writes_residual(rest: str) -> bool:
    parts = rest.split(".")
    return any(p in ATTENTION_OUTPUTS + MLP_OUTPUTS for p in parts[:-1]) or parts[-1] in ("down_proj",)


def _write_config(dest: Path, raw: dict, sources: list[tuple[int, bool]], layers: int) -> None:
    """config.json with the new depth; per-layer settings follow the layer each new one copies."""
    raw = dict(raw)
    raw["num_hidden_layers"] = len(sources)
    if isinstance(raw.get("layer_types"), list) and len(raw["layer_types"]) == layers:
        raw["layer_types"] = [raw["layer_types"][j] for j, _ in sources]
    if isinstance(raw.get("mlp_only_layers"), list):  # Qwen-MoE: layers with a dense MLP
        dense = set(raw["mlp_only_layers"])
        raw["mlp_only_layers"] = [k for k, (j, _) in enumerate(sources) if j in dense]
    raw[MARKER] = {"new_layers": [k for k, (_, new) in enumerate(sources) if new], "original_layers": layers}
    (dest / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def _layer_shapes(hf_config: PretrainedConfig) -> list[dict[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in range(hf_config.num_hidden_layers)]
    for name, param in model.named_parameters():
        match = _LAYER.match(name)
        if match:
            shapes[int(match["index"])][match["rest"]] = tuple(param.shape)
    return shapes


def _check_layers(old: PretrainedConfig, new: PretrainedConfig, sources: list[tuple[int, bool]]) -> None:
    """Each layer of the expanded model must be built like the layer it copies: a setting that depends on
    the layer index and that `_write_config` does not know (e.g. a sparse-layer step) would break that."""
    before, after = _layer_shapes(old), _layer_shapes(new)
    for k, (j, _) in enumerate(sources):
        if after[k] != before[j]:
            raise QShardError(
                f"config.json: layer {k} of the expanded {type(new).__name__} would not be built like layer {j} "
                "it copies (a per-layer setting such as decoder_sparse_step); qshard cannot expand this model"
            )


def _write_weights(dest: Path, ckpt: Checkpoint, plan: list[_Tensor], max_shard_bytes: int | None) -> None:
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in plan:
        nbytes = ckpt.dtype(t.source).itemsize * math.prod(ckpt.shape(t.source))
        if max_shard_bytes is not None and size and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards, strict=True):
        writer = SafetensorsWriter(dest / fname, [(t.name, ckpt.dtype(t.source), ckpt.shape(t.source)) for t in shard])
        for t in shard:
            shape, dtype = ckpt.shape(t.source), ckpt.dtype(t.source)
            tensor = torch.zeros(shape, dtype=dtype) if t.zero else ckpt.read(t.source)
            writer.write(t.name, tensor)
            total += tensor.nbytes
            del tensor
        writer.close()
        weight_map.update(dict.fromkeys((t.name for t in shard), fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dest / INDEX_FILE).write_text(json.dumps(index, indent=2))
