"""Tiny random-weight models with the locally built demo tokenizer: the embedded demo, and the models
the tests build for each supported architecture."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.random_model import write_random_checkpoint

# Small enough to train in a few minutes on two CPU cores, big enough to learn the demo tasks. Widths are
# multiples of 64 so every block linear is NF4-quantizable at the default blocksize.
TINY_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
)


def write_tiny_model(dest: str | Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A model directory (config.json, model.safetensors, tokenizer files) for `model_type`."""
    tokenizer = build_demo_tokenizer()
    hf_config = AutoConfig.for_model(
        model_type,
        **{**TINY_SHAPE, **overrides},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # A larger init than pretraining's 0.02: the embeddings and head stay frozen and random, and with
    # small ones the logits are too flat for the adapters to move the loss far.
    dest = write_random_checkpoint(dest, hf_config, seed=seed, std=0.2)
    tokenizer.save_pretrained(dest)
    return dest


def write_demo_model(dest: str | Path, seed: int = 0) -> Path:
    return write_tiny_model(dest, "llama", seed=seed)
