"""Random-weight Hugging Face checkpoints of any supported shape, for tests, the demo and benchmarks.

Written tensor by tensor from a meta skeleton, so an 8B-shaped checkpoint never needs the whole model
in memory: only the shard being filled (`max_shard_bytes`)."""

from __future__ import annotations

import json
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
    generator = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, param in skeleton.named_parameters():  # tied weights appear once
        tensor = _random_like(name, param, generator, device, std)
        if size and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.to("cpu", dtype)
        size += tensor.nbytes
    _save_shards(dest, shards)
    return dest


def _random_like(name: str, param: torch.Tensor, generator, device, std: float) -> torch.Tensor:
    if param.ndim == 1:
        fill = 0.0 if name.endswith("bias") else 1.0
        return torch.full(param.shape, fill, device=device)
    return torch.randn(param.shape, generator=generator, device=device).mul_(std)


def _save_shards(dest: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], dest / "model.safetensors", metadata=meta)
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, dest / fname, metadata=meta)
        weight_map.update({name: fname for name in shard})
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
