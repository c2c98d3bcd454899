"""Trainable adapters attached to frozen base layers."""

from qshard.adapters.dora import DoRALinear
from qshard.adapters.lora import LoRALinear

__all__ = ["DoRALinear", "LoRALinear"]
