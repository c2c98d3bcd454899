"""Quantized frozen layers whose packed storage FSDP2 shards and all-gathers as is."""

from qshard.quant.experts import NF4Experts
from qshard.quant.hqq import HQQLinear, dequantize_hqq, quantize_hqq
from qshard.quant.nf4 import NF4Linear, dequantize_nf4, quantize_nf4

# Frozen linear layers whose integer storage is sharded along dim 0 (output rows) and dequantized on use.
QUANTIZED_LINEARS = (NF4Linear, HQQLinear)

__all__ = [
    "QUANTIZED_LINEARS",
    "HQQLinear",
    "NF4Experts",
    "NF4Linear",
    "dequantize_hqq",
    "dequantize_nf4",
    "quantize_hqq",
    "quantize_nf4",
]
