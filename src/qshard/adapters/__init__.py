"""Trainable adapters attached to frozen base layers."""

from qshard.adapters.lora import LoRALinear

__all__ = ["LoRALinear"]
