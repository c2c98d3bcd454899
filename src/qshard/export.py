"""Export trained LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors,
loadable by `peft.PeftModel.from_pretrained(base, dir)` with no missing or unexpected keys."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from qshard.adapters import LoRALinear
from qshard.config import LoRAConfig
from qshard.loading import join_name, module_sources
from qshard.quant import NF4Linear, dequantize_nf4

# PEFT stores a causal LM's adapter under the PeftModel -> LoraModel -> original model path.
PEFT_PREFIX = "base_model.model."


def gather_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA tensors on CPU, keyed by PEFT's names.

    A collective: every rank must call it, and every rank gets the result."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for part in ("lora_A", "lora_B"):
                param = getattr(module, part)
                full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                tensors[f"{PEFT_PREFIX}{name}.{part}.weight"] = full.cpu().contiguous()
    return tensors


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
) -> None:
    """Write atomically: into a sibling temporary directory, renamed into place once complete."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def base_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16):
    """Yield (checkpoint name, full tensor on CPU) for the frozen base, NF4 layers dequantized: the
    weights the trained adapters were fitted to. A collective: every rank iterates it in step."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    seen: set[int] = set()
    for module, prefix in module_sources(model):
        if isinstance(module, NF4Linear):
            yield join_name(prefix, "weight"), dequantize_nf4(full(module.packed), full(module.absmax), dtype).cpu()
            if module.bias is not None:
                yield join_name(prefix, "bias"), full(module.bias).to(dtype).cpu()
        elif not isinstance(module, LoRALinear):
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield join_name(prefix, name), full(param).to(dtype).cpu()
