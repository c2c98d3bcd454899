"""Trainable adapters attached to frozen base layers."""

from qshard.adapters.dora import DoRALinear
from qshard.adapters.lora import LoRALinear, adapters_disabled

__all__ = ["DoRALinear", "LoRALinear", "adapters_disabled"]
