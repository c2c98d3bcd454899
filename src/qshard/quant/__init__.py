"""Quantized frozen layers whose packed storage FSDP2 shards and all-gathers as is.

`QUANT_METHODS` names each method's layer (a `QuantizedLinear`) by its quant.method value. A new method is
one file with its subclass and one entry here, or a `register_quant_method` call from outside the package."""

from qshard.config import QUANT_BITS
from qshard.quant.experts import QuantizedExperts, fused_expert_params
from qshard.quant.hqq import HQQLinear, dequantize_hqq, quantize_hqq
from qshard.quant.linear import QuantizedLinear
from qshard.quant.nf4 import NF4DoubleQuantLinear, NF4Linear, dequantize_nf4, quantize_nf4

QUANT_METHODS: dict[str, type[QuantizedLinear]] = {"nf4": NF4Linear, "hqq": HQQLinear}
# config.py's torch-free copy of the methods' bits (what it validates quant.bits against) says the same.
assert {name: layer.BITS for name, layer in QUANT_METHODS.items()} == QUANT_BITS, QUANT_BITS


def register_quant_method(name: str, layer: type[QuantizedLinear]) -> None:
    """Make `layer` quant.method `name`: config validation then accepts the name at the quant.bits in
    `layer.BITS`, and models.py builds its layers, which are loaded, sharded, offloaded and exported as every
    `QuantizedLinear` is. Register before the config is read (in every process of a run)."""
    if name in QUANT_METHODS:
        raise ValueError(f"quant.method {name} is taken by {QUANT_METHODS[name].__name__}")
    QUANT_METHODS[name] = layer
    QUANT_BITS[name] = layer.BITS


def experts_methods() -> list[str]:
    """The methods whose layers may hold fused MoE experts."""
    return [name for name, layer in QUANT_METHODS.items() if layer.EXPERTS]


__all__ = [
    "QUANT_METHODS",
    "HQQLinear",
    "NF4DoubleQuantLinear",
    "NF4Linear",
    "QuantizedExperts",
    "QuantizedLinear",
    "dequantize_hqq",
    "dequantize_nf4",
    "experts_methods",
    "fused_expert_params",
    "quantize_hqq",
    "quantize_nf4",
    "register_quant_method",
]
