"""Random-weight Hugging Face checkpoints of any supported shape, for tests, the demo and benchmarks.

Written tensor by tensor from a meta skeleton, so an 8B-shaped checkpoint never needs the whole model
in memory: only the shard being written (`max_shard_bytes`)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from qshard.errors import QShardError

# Named shapes users and benchmarks can ask for. Values follow the public configs of these models.
NAMED_SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "llama-tiny": dict(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    ),
}


def named_config(shape: str, **overrides) -> PretrainedConfig:
    if shape not in NAMED_SHAPES:
        raise QShardError(f"unknown model shape '{shape}' (known: {', '.join(sorted(NAMED_SHAPES))})")
    kwargs = {**NAMED_SHAPES[shape], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


@torch.no_grad()
def write_random_checkpoint(
    dest: str | Path,
    hf_config: PretrainedConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 4 << 30,
    device: str | torch.device = "cpu",
    std: float = 0.02,
) -> Path:
    """Write config.json and safetensors weights (sharded with an index when over `max_shard_bytes`).

    Linear and embedding weights ~ N(0, std); 1-D weights (norm scales) are ones and biases zeros, so
    the model computes something sane."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(dest)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    # Shards are planned from the shapes first, so each can be generated and written on its own.
    plan: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, param in skeleton.named_parameters():  # tied weights appear once
        nbytes = param.numel() * dtype.itemsize
        if size and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append((name, tuple(param.shape)))
        size += nbytes
    meta = {"format": "pt"}
    if len(plan) == 1:
        save_file(_generate(plan[0], seed, device, dtype, std), dest / "model.safetensors", metadata=meta)
        return dest
    weight_map, total = {}, 0
    for i, names in enumerate(plan, start=1):
        fname = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        shard = _generate(names, seed, device, dtype, std)
        save_file(shard, dest / fname, metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
) -> torch.Tensor:
    """The random value of tensor `name`: a function of the seed and the name only, so that a checkpoint
    written here and a model initialized at random (`model.init: random`) hold the same weights, whatever
    the order or the process they are made in. 1-D tensors: zeros for biases, ones for norm scales."""
    if len(shape) == 1:
        return torch.full(shape, 0.0 if name.endswith("bias") else 1.0, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return out.mul_(std).to(dtype)


def _generate(names, seed, device, dtype, std) -> dict[str, torch.Tensor]:
    return {name: random_tensor(name, shape, seed, device, dtype, std).cpu() for name, shape in names}
