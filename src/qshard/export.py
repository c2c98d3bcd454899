"""Export trained LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors,
loadable by `peft.PeftModel.from_pretrained(base, dir)` with no missing or unexpected keys."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from qshard import outputs
from qshard.adapters import DoRALinear, LoRALinear
from qshard.adapters.dora import dora_merge
from qshard.adapters.from_base import as_plain_lora, factors_from_base, plain_lora_alpha
from qshard.config import LoRAConfig
from qshard.loading import WEIGHT_SUFFIXES, join_name, module_sources
from qshard.quant import QuantizedExperts, QuantizedLinear
from qshard.vocab import tied

if TYPE_CHECKING:
    from qshard.export_tokenizer import ExportTokenizer

# PEFT stores a causal LM's adapter under the PeftModel -> LoraModel -> original model path.
PEFT_PREFIX = "base_model.model."
# PEFT's name for a DoRA layer's magnitude vector in a saved adapter (no `.weight` suffix, unlike A and B).
DORA_MAGNITUDE = "lora_magnitude_vector"


def gather_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA tensors on CPU, keyed by PEFT's names, and those of the modules trained in full
    beside them (lora.modules_to_save). Adapters that started from their base (PiSSA, OLoRA) are written as the
    rank-2r LoRA of what training added, for the original base.

    A collective: every rank must call it, and every rank gets the result."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            a, b = _full(module.lora_A).cpu(), _full(module.lora_B).cpu()
            if module.initial is not None:  # PiSSA/OLoRA: what training added to the original weight
                a, b = as_plain_lora(a, b, *module.initial)
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.contiguous()
            if isinstance(module, DoRALinear):
                tensors[f"{PEFT_PREFIX}{name}.{DORA_MAGNITUDE}"] = _full(module.magnitude).cpu().contiguous()
    return tensors | _gather_trained_in_full(model)


def _trained_in_full(model: nn.Module) -> dict[str, nn.Module]:
    """The modules trained whole beside the adapters, by full name: both modules of a tied embedding and head."""
    adapter_params = {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in m.parameters(recurse=False)}
    return {fqn: m for fqn, m in model.named_modules()
            if any(p.requires_grad and id(p) not in adapter_params for p in m.parameters(recurse=False))}


def _gather_trained_in_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Their full tensors, under PEFT's names for modules_to_save (the original module's, e.g.
    `base_model.model.lm_head.weight`); a tied weight under each of its names, as PEFT saves it."""
    tensors: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for fqn, module in _trained_in_full(model).items():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in gathered:  # safetensors stores no two names for one tensor's memory
                full = gathered[id(param)].clone()
            else:
                full = gathered[id(param)] = _full(param).cpu().contiguous()
            tensors[f"{PEFT_PREFIX}{fqn}.{name}"] = full
    return tensors


def modules_to_save(model: nn.Module) -> dict | None:
    """adapter_config.json's entries for the modules trained in full (None: there are none): each by its leaf
    name, or by its full name where the leaf would match other modules too (PEFT matches names as suffixes), and
    PEFT's `ensure_weight_tying` for a tied embedding and head, which PEFT then keeps tied as qshard trained them."""
    saved = _trained_in_full(model)
    if not saved:
        return None
    names = [n for n, _ in model.named_modules()]
    unique = [fqn if any(n.endswith(fqn.rsplit(".", 1)[-1]) and n != fqn for n in names) else fqn.rsplit(".", 1)[-1]
              for fqn in saved]
    return {"modules_to_save": unique, "ensure_weight_tying": tied(model)}


def target_modules(model: nn.Module) -> list[str] | str:
    """Leaf names of the adapted linears, as PEFT users expect to read them; an exact regex over the full
    names instead when a leaf name also belongs to a linear that was not adapted (PEFT would adapt it too)."""
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    inside = set(adapted) | {f"{n}.base" for n in adapted}
    clash = any(
        n.rsplit(".", 1)[-1] in leaves and n not in inside
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    )
    if clash:
        return "^(?:" + "|".join(re.escape(n) for n in adapted) + ")$"
    return sorted(leaves)


def write_peft_adapter(
    dest: Path,
    tensors: dict[str, torch.Tensor],
    lora: LoRAConfig,
    targets: list[str] | str,
    base_model: str,
    tokenizer: ExportTokenizer | None = None,
    revision: str | None = None,
    saved_modules: dict | None = None,
) -> None:
    """Write the adapter to `dest` (see `outputs.staged`: complete or not at all, and replacing nothing but
    a previous adapter export), with `tokenizer`'s files and generation config. `base_model` and `revision`: the
    base's Hub id and commit, or its directory. PiSSA/OLoRA tensors (`gather_lora`) are a plain LoRA of twice
    the rank, with the alpha that keeps the scaling, as peft's own conversion writes them. `saved_modules`:
    `modules_to_save(model)`."""
    from_base = factors_from_base(lora.init) is not None  # PiSSA/OLoRA: written as a LoRA of twice the rank
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": lora.rank * 2 if from_base else lora.rank,
        "lora_alpha": plain_lora_alpha(lora.alpha, lora.use_rslora) if from_base else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": lora.use_rslora,
        "use_dora": any(k.endswith(DORA_MAGNITUDE) for k in tensors),  # DoRA adapters carry magnitudes
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(saved_modules or {}),
    }
    with outputs.staged(dest, kind="adapter") as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.write(tmp)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(layer, QuantizedLinear):
        # Gathers sharded storage itself, wherever it is kept (DTensor buffers, FSDP2, host memory).
        return layer.dequantized_weight(dtype)
    return _full(layer.weight).to(dtype)


def model_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16, merge_adapters: bool = False):
    """Yield (checkpoint name, full tensor on CPU), one at a time, under the base checkpoint's names:
    quantized layers dequantized; with `merge_adapters`, each adapted weight becomes W + (alpha/r) B A
    (DoRA: that rescaled to its magnitude per row), in fp32 before the cast. Without it, the base the
    adapters were fitted to.

    A collective (sharded tensors are gathered): every rank must iterate it in step."""
    skip: set[int] = set()
    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if id(module) in skip:
            continue
        if isinstance(module, LoRALinear):
            if merge_adapters:
                skip.add(id(module.base))
                delta = (_full(module.lora_B).float() @ _full(module.lora_A).float()) * module.scaling
                weight = _dense_weight(module.base, torch.float32) + delta
                if isinstance(module, DoRALinear):
                    weight = dora_merge(weight, _full(module.magnitude).float())
                yield join_name(prefix, "weight"), weight.to(dtype).cpu()
                if module.base.bias is not None:
                    yield join_name(prefix, "bias"), _full(module.base.bias).to(dtype).cpu()
            continue
        if isinstance(module, QuantizedExperts):  # fused MoE experts: one quantized layer per 3-D weight
            for name, shape in module.shapes.items():
                yield join_name(prefix, name), _dense_weight(getattr(module, name), dtype).view(shape).cpu()
            continue
        if isinstance(module, QuantizedLinear):
            yield join_name(prefix, "weight"), _dense_weight(module, dtype).cpu()
            if module.bias is not None:
                yield join_name(prefix, "bias"), _full(module.bias).to(dtype).cpu()
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield join_name(prefix, name), _full(param).to(dtype).cpu()


def base_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16):
    """The frozen base as the adapters saw it (dequantized), under the checkpoint's names."""
    return model_weights(model, dtype, merge_adapters=False)


def _retype_config(path: Path, dtype: torch.dtype, base_name: str | None = None,
                   vocab_size: int | None = None) -> None:
    """The merged weights are plain `dtype` tensors: say so, and drop any quantization the base declared; the
    embedding has `vocab_size` rows (data.add_special_tokens may have added some). Where the config says where
    the model came from, that becomes `base_name` if one is given."""
    config = json.loads(path.read_text())
    if base_name is not None and "_name_or_path" in config:
        config["_name_or_path"] = base_name
    config.pop("quantization_config", None)
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    path.write_text(json.dumps(config, indent=2))


def write_merged(
    dest: Path,
    weights,
    base_dir: Path,
    is_main: bool,
    max_shard_bytes: int = 2 << 30,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: ExportTokenizer | None = None,
    base_name: str | None = None,
    vocab_size: int | None = None,
) -> None:
    """Write a Hugging Face model directory (config, tokenizer, sharded safetensors) from `weights`, with
    `tokenizer`'s files and generation config in place of the base's copies,
    holding at most one shard in memory (see `outputs.staged`: complete or not at all, and replacing nothing
    but a previous merged export). Every rank consumes `weights` (it gathers shards); only the main rank
    writes. `vocab_size`: the embedding's rows, when they differ from the base's config.json."""
    if not is_main:
        for _ in weights:  # the gathers are collectives: take part in each
            pass
        return
    with outputs.staged(dest, kind="merged") as tmp:
        _copy_model_files(base_dir, tmp)
        if tokenizer is not None:
            tokenizer.write(tmp)
        _retype_config(tmp / "config.json", dtype, base_name, vocab_size)
        _write_shards(tmp, weights, max_shard_bytes)


def _copy_model_files(base_dir: Path, dest: Path) -> None:
    """The files that describe the model (config, tokenizer, generation config), not its weights, nor the
    marker of an export it may itself be: ownership is never copied."""
    for item in base_dir.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != outputs.MARKER:
            shutil.copy2(item, dest / item.name)


def _write_shards(dest: Path, weights, max_shard_bytes: int) -> None:
    shards: list[str] = []
    weight_map: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, dest / name, metadata={"format": "pt"})
            shards.append(name)
            weight_map.update(dict.fromkeys(current, name))
        current, size = {}, 0

    for name, tensor in weights:
        if size and size + tensor.nbytes > max_shard_bytes:
            flush()
        current[name] = tensor.contiguous()
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    # Name the shards "-of-N" now that N is known, as transformers' own checkpoints are named.
    final_names = {old: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, old in enumerate(shards, start=1)}
    for old, new in final_names.items():
        (dest / old).rename(dest / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final_names[v] for k, v in weight_map.items()}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
