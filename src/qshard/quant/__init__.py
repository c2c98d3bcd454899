"""Quantized frozen layers whose packed storage FSDP2 shards and all-gathers as is."""

from qshard.quant.experts import NF4Experts
from qshard.quant.nf4 import NF4Linear, dequantize_nf4, quantize_nf4

__all__ = ["NF4Experts", "NF4Linear", "dequantize_nf4", "quantize_nf4"]
