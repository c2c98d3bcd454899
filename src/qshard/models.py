"""Architecture lookup: from a model's config.json (read by `hf_config`), build its skeleton on the meta
device, find its transformer blocks and their linear layers, and swap those for quantized / adapter modules.

Nothing here knows about parallelism or checkpoint files; `loading` fills the skeleton afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from qshard.adapters import DoRALinear, LoRALinear
from qshard.config import DORA_TRAIN_TYPES, PAIR_OBJECTIVES, QUANTIZED_TRAIN_TYPES, Config, QuantConfig
from qshard.errors import QShardError
from qshard.precision import precision
from qshard.quant import QUANT_METHODS, QuantizedExperts, QuantizedLinear, experts_methods, fused_expert_params

log = logging.getLogger("qshard")


def build_skeleton(hf_config: PretrainedConfig, cfg: Config) -> nn.Module:
    """The causal LM with every parameter on the meta device: no memory, no initialization cost."""
    # Asked up front: transformers' own error lists every causal-LM config class it knows, hundreds of them.
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise QShardError(
            f"{type(hf_config).__name__} (model_type '{hf_config.model_type}') has no causal-LM class in "
            "transformers, so qshard cannot train it"
        )
    attn = cfg.model.attn_implementation
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=precision(cfg).compute,
                                                     trust_remote_code=False)
        except ValueError as exc:  # e.g. an attn_implementation this architecture lacks
            if attn != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise QShardError(f"cannot build {type(hf_config).__name__} ({exc})") from None
            # Some architectures (Gemma 2's logit soft-capping) have eager attention only.
            log.warning("%s has no sdpa attention; using eager", type(hf_config).__name__)
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                                     dtype=precision(cfg).compute, trust_remote_code=False)
    return model


def position_limit(hf_config: PretrainedConfig) -> tuple[int | None, str]:
    """The longest sequence the model's positions cover, and where that figure comes from: its
    max_position_embeddings, or with rope scaling (linear, dynamic, yarn, llama3, ...) the scaling's factor times
    the length it extends (original_max_position_embeddings where stated, else max_position_embeddings)."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None, "no max_position_embeddings"
    origin = f"max_position_embeddings {limit}"
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    # Per attention type (Gemma 3): every one of them must reach the length.
    parts = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    extended = []
    for part in parts:
        kind, factor = part.get("rope_type", part.get("type", "default")), part.get("factor")
        if kind == "default" or not isinstance(factor, (int, float)) or factor <= 1:
            extended.append((limit, origin))
            continue
        original = part.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None) or limit
        reach = max(limit, int(factor * original))
        extended.append((reach, f"rope scaling {kind} x{factor:g} over {original} positions"))
    return min(extended)


def check_positions(hf_config: PretrainedConfig, longest: int, max_length: int) -> None:
    """Refuse sequences that use more positions (`longest`, of data cut to `max_length`) than the model was
    trained for, unless its config's rope scaling says how to reach that far (`position_limit`)."""
    limit, origin = position_limit(hf_config)
    if limit is None or longest <= limit:
        return
    hint = "" if "rope scaling" in origin else ", and its config has no rope_scaling saying how to extend them"
    raise QShardError(
        f"data: sequences of up to {longest} tokens (data.max_length {max_length}) exceed the {limit} positions "
        f"of {type(hf_config).__name__} ({origin}){hint}; set data.max_length to at most {limit}")


def prompt_sharing_blocker(hf_config: PretrainedConfig, attn_implementation: str) -> str | None:
    """Why this model cannot run pref.share_prompt's rows, or None where it can. Their attention is sdpa's, two
    causal passes a row (attention.py), which transformers' sdpa attention alone runs; and the passes keep no sliding
    window, nor do they run a hybrid model's linear-attention or state-space layers."""
    if attn_implementation != "sdpa":
        return f"{attn_implementation} attention"
    text = hf_config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        return "sliding-window attention layers" if getattr(text, "sliding_window", None) is not None else None
    others = sorted({t for t in layer_types if t != "full_attention"})
    if not others:
        return None
    # Hybrid models' linear-attention or state-space layers take no rows either.
    return ("sliding-window attention layers" if others == ["sliding_attention"]
            else f"layers other than full attention ({', '.join(others)})")


def shares_prompt(cfg: Config, hf_config: PretrainedConfig, attn_implementation: str, say: bool = False) -> bool:
    """Whether each preference pair runs as one row [prompt, chosen, rejected] (pref.share_prompt; on by default
    for the pair objectives where the model allows); `say`: log once why a pair objective runs two rows instead."""
    if not prompt_sharing_asked(cfg):
        return False
    blocker = prompt_sharing_blocker(hf_config, attn_implementation)
    if blocker is not None and say:
        log.log(logging.WARNING if cfg.pref.share_prompt else logging.INFO,
                "pref.share_prompt: off, %s's %s cannot keep a pair's rejected tokens from its chosen ones in one "
                "row; each pair runs as two rows", type(hf_config).__name__, blocker)
    return blocker is None


def prompt_sharing_asked(cfg: Config) -> bool:
    """pref.share_prompt as the options alone say it: a pair objective, and not turned off."""
    return cfg.train.objective in PAIR_OBJECTIVES and cfg.pref.share_prompt is not False


def prompt_tokens_shared(cfg: Config, length: int) -> int:
    """The prompt tokens a shared pair of rows of `length` is taken to hold where its size is planned:
    pref.max_prompt_length, or 0 without it (the longest row a pair can make: a short prompt, long completions)."""
    return min(cfg.pref.max_prompt_length or 0, length - 1)


def dense_mask_bytes(cfg: Config, shared: bool = False) -> int:
    """Bytes of the [rows, L, L] attention mask transformers builds for each micro-batch where attention cannot
    run causally without one: packed rows (a block-diagonal mask), micro-batches of several (padded) rows, or
    eager attention. 0 for one unpacked row per micro-batch under sdpa, which gets no mask and runs SDPA's
    causal kernel (memory linear in the sequence). A preference pair is two padded rows, always masked; 0 where
    the pairs run as shared rows (`shared`: `shares_prompt` for the model), whose two causal passes need none."""
    if shared:
        return 0
    rows, length = _rows_per_micro_batch(cfg), cfg.data.max_length
    if cfg.model.attn_implementation == "sdpa" and not cfg.data.packing and rows == 1:
        return 0
    return rows * length * length


def _rows_per_micro_batch(cfg: Config) -> int:
    return cfg.train.micro_batch_size * (2 if cfg.train.objective in PAIR_OBJECTIVES else 1)


def warn_dense_mask(cfg: Config, shared: bool = False, threshold: int = 1 << 30) -> None:
    """One warning where `dense_mask_bytes` reaches `threshold`: at long context such a mask alone can outgrow
    the device, and how to avoid it is a setting away."""
    nbytes = dense_mask_bytes(cfg, shared)
    if nbytes >= threshold:
        log.warning("attention: with data.max_length %d, %s builds a dense attention mask of %.1f GiB per micro-"
                    "batch; for long sequences use train.micro_batch_size 1, data.packing false and "
                    "model.attn_implementation sdpa (causal attention without a mask)", cfg.data.max_length,
                    _mask_reason(cfg), nbytes / 2**30)


def _mask_reason(cfg: Config) -> str:
    if cfg.model.attn_implementation != "sdpa":
        return f"model.attn_implementation {cfg.model.attn_implementation}"
    if cfg.data.packing:
        return "data.packing"
    if cfg.train.objective in PAIR_OBJECTIVES:
        return (f"train.objective {cfg.train.objective} (each pair is two padded rows; pref.share_prompt, where the "
                f"model allows it, runs a pair as one row without a mask; or shorten data.max_length)")
    return f"train.micro_batch_size {cfg.train.micro_batch_size} (padded rows)"


def architecture(model: nn.Module) -> str:
    """The model's own class name: FSDP2 subclasses it as FSDP<Name>."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))


def find_blocks(model: nn.Module, block_class: str | None) -> list[nn.Module]:
    """The transformer blocks: modules whose class is named by `block_class` or, by default, by the
    model's `_no_split_modules` (the classes Hugging Face itself never splits across devices)."""
    if block_class:
        names = {block_class}
        origin = f"model.block_class={block_class}"
    else:
        names = set(getattr(model, "_no_split_modules", None) or [])
        origin = f"{type(model).__name__}._no_split_modules={sorted(names)}"
        if not names:
            raise QShardError(
                f"{type(model).__name__} does not declare _no_split_modules, so its transformer block is "
                "unknown: set model.block_class to the block's class name"
            )
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise QShardError(f"{type(model).__name__}: no module matches {origin}")
    nested = [b for b in blocks if any(o is not b and _contains(o, b) for o in blocks)]
    if nested:
        raise QShardError(f"{type(model).__name__}: block classes {sorted(names)} nest inside each other")
    return blocks


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


@dataclass
class SwapReport:
    adapted: list[str]  # fully qualified names of linears given a LoRA adapter
    quantized: list[str]  # ... whose base is quantized (quant.method)
    kept: list[str]  # block linears left in bf16 (shape not quantizable)


def prepare_modules(model: nn.Module, blocks: list[nn.Module], cfg: Config) -> SwapReport:
    """Swap block linears for the train type's modules and set requires_grad and storage dtypes.

    qlora: every block linear -> quant.method's QuantizedLinear (frozen); targeted ones wrapped in LoRALinear.
    lora:  targeted block linears wrapped in LoRALinear over the frozen bf16 linear.
    qdora, dora: as qlora and lora, with DoRALinear (LoRA plus a trained magnitude per output row).
    full:  nothing swapped; every parameter trains, stored in the master dtype (train.precision).
    llama_pro: nothing swapped; the blocks `qshard expand` added train in the master dtype, the rest stays frozen.
    """
    train_type = cfg.train.train_type
    frozen_dtype, master_dtype = precision(cfg).compute, precision(cfg).master
    if train_type == "full":
        cast_parameters(model, master_dtype).requires_grad_(True)
        return SwapReport(adapted=[], quantized=[], kept=[])
    if train_type == "llama_pro":
        model.requires_grad_(False)
        for block in new_blocks(model, blocks):
            cast_parameters(block, master_dtype).requires_grad_(True)
        return SwapReport(adapted=[], quantized=[], kept=[])
    model.requires_grad_(False)
    targets = _resolve_targets(model, blocks, cfg.lora.target_modules)
    report = SwapReport(adapted=[], quantized=[], kept=[])
    block_names = {id(b) for b in blocks}
    method = QUANT_METHODS[cfg.quant.method] if train_type in QUANTIZED_TRAIN_TYPES else None
    adapter = DoRALinear if train_type in DORA_TRAIN_TYPES else LoRALinear
    for name, module in list(model.named_modules()):
        if id(module) not in block_names:
            continue
        if method is not None:
            _quantize_experts(model, module, name, method, cfg.quant, report)
        for sub_name, linear in list(module.named_modules()):
            if not isinstance(linear, nn.Linear):
                continue
            fqn = f"{name}.{sub_name}"
            base: nn.Module = linear
            if method is not None:
                if method.can_quantize(linear.in_features, cfg.quant):
                    base = method.like(linear, cfg.quant, frozen_dtype)
                    report.quantized.append(fqn)
                else:
                    report.kept.append(fqn)
            if sub_name.rsplit(".", 1)[-1] in targets:
                _check_rank(cfg.lora.rank, fqn, linear)
                base = adapter(base, linear.in_features, linear.out_features, cfg.lora.rank, cfg.lora.alpha,
                               cfg.lora.dropout, dtype=master_dtype, use_rslora=cfg.lora.use_rslora, init=cfg.lora.init)
                report.adapted.append(fqn)
            if base is not linear:
                _set_submodule(module, sub_name, base)
    return report


# Written by `qshard expand` into the expanded config.json: which layers are new, for `train_type: llama_pro`
# to train.
LLAMA_PRO_MARKER = "qshard_llama_pro"


def new_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks `qshard expand` added, from the marker it wrote into config.json."""
    marker = getattr(model.config, LLAMA_PRO_MARKER, None)
    if not isinstance(marker, dict) or not isinstance(marker.get("new_layers"), list):
        raise QShardError(
            f"train.train_type llama_pro: the model's config.json has no '{LLAMA_PRO_MARKER}' entry naming its "
            "new blocks; expand the model first (qshard expand --model DIR --output NEW_DIR --new-blocks N)"
        )
    indices = marker["new_layers"]
    if not indices or any(not isinstance(i, int) or not 0 <= i < len(blocks) for i in indices):
        raise QShardError(
            f"config.json: {LLAMA_PRO_MARKER}.new_layers {indices} does not name blocks of the model's "
            f"{len(blocks)} blocks"
        )
    return [blocks[i] for i in indices]


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters only: `module.to(dtype)` would cast buffers too, and rotary `inv_freq` must stay
    fp32 (bf16 positions lose whole tokens at long context). `.data` keeps tied parameters tied."""
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module


def _check_rank(rank: int, fqn: str, linear: nn.Linear) -> None:
    """An adapter's rank beyond min(in_features, out_features) adds numbers but nothing the product B A can
    express (PEFT warns likewise); refused here, on the meta skeleton, before any of it is allocated."""
    limit = min(linear.in_features, linear.out_features)
    if rank > limit:
        raise QShardError(
            f"lora.rank {rank} exceeds what layer {fqn} (in_features {linear.in_features}, out_features "
            f"{linear.out_features}) can use: an adapter's rank is at most min(in_features, out_features) = {limit}"
        )


# Each adapter weight trains with a gradient and AdamW's two moments, all of its own size and dtype.
TRAINED_COPIES = 4


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the LoRA/DoRA adapters' own parameters (not their frozen base), as stored."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, LoRALinear)
               for name, p in m.named_parameters() if not name.startswith("base."))


def machine_memory(device: torch.device) -> int | None:
    """The host's physical memory plus `device`'s own (a GPU's): more than one process can ever hold."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None
    return host + (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0)


def check_adapter_memory(model: nn.Module, cfg: Config, world_size: int, memory: int | None) -> None:
    """Refuse adapters that cannot fit even when perfectly sharded over every rank, before they are allocated:
    their weights, gradients and optimizer state, a share of `memory` bytes per rank at most."""
    trained = adapter_bytes(model) * TRAINED_COPIES
    if memory is not None and trained / world_size > memory:
        raise QShardError(
            f"lora.rank {cfg.lora.rank}: the adapters, with their gradients and AdamW state, take {trained:,} bytes, "
            f"{trained // world_size:,} per rank over {world_size} rank(s), more than the {memory:,} bytes of "
            "memory a rank has here; lower lora.rank or lora.target_modules"
        )


@contextmanager
def allocation_errors(model: nn.Module, cfg: Config, device: torch.device) -> Iterator[None]:
    """An allocator's failure to make room for the model (its shards, its adapters) as one line that says
    what was asked for, and how much of it the adapters are, instead of a traceback."""
    try:
        yield
    except RuntimeError as exc:  # torch.OutOfMemoryError included
        text = str(exc)
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in text:
            raise
        asked = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        adapters = adapter_bytes(model)
        what = f"lora.rank {cfg.lora.rank}: " if adapters else ""
        share = f"; the adapters alone take {adapters:,} bytes, {TRAINED_COPIES}x that once trained" if adapters else ""
        resident = cfg.parallel.resident_blocks
        share += f"; parallel.resident_blocks {resident} keeps that many blocks' storage there" if resident else ""
        raise QShardError(f"{what}cannot allocate the model on {device} ({asked}){share}") from None


def _quantize_experts(model: nn.Module, block: nn.Module, block_name: str, method: type[QuantizedLinear],
                      quant: QuantConfig, report: SwapReport) -> None:
    """Swap each fused-experts module (3-D [experts, out, in] weights, transformers 5's MoE layout) of a
    block for a QuantizedExperts of `method`; refuse an experts module holding anything else, which qshard
    cannot run, and any where `method` holds no experts."""
    for sub_name, module in list(block.named_modules()):
        shapes = fused_expert_params(module)
        if not shapes:
            continue
        fqn = f"{block_name}.{sub_name}"
        if not method.EXPERTS:
            raise QShardError(
                f"{type(model).__name__}: experts module '{fqn}' holds fused MoE weights, which quant.method "
                f"{quant.method} does not quantize yet; use quant.method {' or '.join(experts_methods())}"
            )
        other = [n for n, p in module.named_parameters() if p.ndim != 3 or "." in n]
        if other:
            raise QShardError(
                f"{type(model).__name__}: experts module '{fqn}' ({type(module).__name__}) has parameters "
                f"besides 3-D [experts, out, in] weights ({', '.join(other)}), which qshard cannot quantize; "
                "use train.train_type lora or full"
            )
        if not all(method.can_quantize(shape[2], quant) for shape in shapes.values()):
            report.kept.append(fqn)
            continue
        _set_submodule(block, sub_name, QuantizedExperts(module, method, quant))
        report.quantized.append(fqn)


def _resolve_targets(model: nn.Module, blocks: list[nn.Module], requested: list[str] | None) -> set[str]:
    available = {n.rsplit(".", 1)[-1] for b in blocks for n, m in b.named_modules() if isinstance(m, nn.Linear)}
    if not available:
        raise QShardError(f"{type(model).__name__}: its blocks contain no nn.Linear layers to adapt")
    if requested is None:
        return available
    unknown = sorted(set(requested) - available)
    if unknown:
        raise QShardError(
            f"lora.target_modules: {unknown} not found in the blocks of {type(model).__name__} "
            f"(available: {sorted(available)})"
        )
    return set(requested)


def _set_submodule(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, leaf = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def computed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Values of the non-persistent buffers (rotary frequencies, embedding scales): no checkpoint holds
    them, and building on meta left them empty. Each owning module is recomputed on a CPU copy whose
    buffers alone are real, first by transformers' own `_init_weights` (how it fills them after its own
    meta-device loading), else by building the module afresh from the model config."""
    values: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if getattr(module, n, None) is not None]
        if names:
            fresh = _recompute(model, prefix, module, names)
            values.update({f"{prefix}.{n}" if prefix else n: fresh[n] for n in names})
    return values


@torch.no_grad()
def _recompute(model: nn.Module, prefix: str, module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    copy = _buffers_only_copy(module, names)
    if hasattr(model, "_init_weights"):
        model._init_weights(copy)  # parameters stay on meta: their init is a no-op there
        computed = {n: getattr(copy, n) for n in names}
        if all(torch.isfinite(t).all() for t in computed.values() if t.is_floating_point()):
            return computed
    try:
        fresh = type(module)(module.config)
    except (AttributeError, TypeError) as exc:
        raise QShardError(
            f"{type(model).__name__}: module '{prefix}' ({type(module).__name__}) has computed buffers "
            f"{names} that qshard cannot rebuild ({exc})"
        ) from None
    return {n: getattr(fresh, n) for n in names}


def _buffers_only_copy(module: nn.Module, names: list[str]) -> nn.Module:
    """A shallow copy of `module` whose named buffers are NaN-filled CPU tensors (NaN shows what no
    initializer wrote) and whose parameters and children are the meta ones."""
    # An FSDP2-sharded module's class is a generated subclass whose __new__ constructs; the model's own class
    # is the first one FSDP2 did not generate.
    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    copy = object.__new__(cls)
    copy.__dict__ = dict(module.__dict__)
    copy._buffers = dict(module._buffers)
    for name in names:
        buf = module._buffers[name]
        empty = torch.empty(buf.shape, dtype=buf.dtype, device="cpu")
        copy._buffers[name] = empty.fill_(float("nan")) if buf.is_floating_point() else empty.zero_()
    return copy


@torch.no_grad()
def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move every plain buffer to `device` (DTensor buffers, the quantized storage, stay where they are sharded)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not isinstance(buf, DTensor) and buf.device != device:
                module._buffers[name] = buf.to(device)


def restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put the computed buffers back, on `device` (where the model computes, whatever holds its parameters)."""
    for name, value in saved.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._buffers[attr] = value.to(device=device, dtype=owner._buffers[attr].dtype)
