"""The embedded demo model: a tiny Llama with random weights and the locally built demo tokenizer."""

from __future__ import annotations

from pathlib import Path

from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.random_model import named_config, write_random_checkpoint

# Small enough to train in a few minutes on two CPU cores, big enough to learn the demo tasks.
DEMO_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)


def write_demo_model(dest: str | Path, seed: int = 0) -> Path:
    tokenizer = build_demo_tokenizer()
    hf_config = named_config(
        "llama-tiny",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DEMO_SHAPE,
    )
    # A larger init than pretraining's 0.02: the demo's embeddings and head stay frozen and random, and
    # with small ones the logits are too flat for the adapters to move the loss far.
    dest = write_random_checkpoint(dest, hf_config, seed=seed, std=0.2)
    tokenizer.save_pretrained(dest)
    return dest
