"""QuantizedLinear: the one interface of a frozen quantized linear layer, whatever its format.

A quantization method is a subclass (its storage, how rows of a float weight become that storage and back)
and an entry in `QUANT_METHODS` (quant/__init__.py). The rest of qshard uses only what this class declares:
models.py builds the layers (`can_quantize`, `like`, `from_config`), loading quantizes each rank's rows into
them (`quantize`), DoRA dequantizes its local rows (`dequantize`), export and the matmuls the whole weight
(`dequantized_weight`), and parallel/ shards, carries, probes and offloads the storage by name (`STORAGE`,
`CARRIERS`, `offloaded`).

What every method's storage must be, so that all of that holds without knowing the format:
- integer tensors (parameters, so that FSDP2 shards them), never floats: FSDP2 casts floating parameters to
  its param_dtype before gathering them (see nf4.py);
- each of shape [out_features, ...]: dim 0 is the output row, and a row's codes and scales depend on that
  row's weights only (no quantization block straddles two rows). Then FSDP2's dim-0 shards hold whole rows
  with their own scales, each rank quantizes only the rows it keeps, and any block of whole rows dequantizes
  on its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from qshard.config import QuantConfig
from qshard.quant.matmul import RefetchingMatmul


def gathered(t: torch.Tensor) -> torch.Tensor:
    # Under FSDP2 the block's pre-forward all-gather has already put full tensors here; storage sharded
    # as DTensor buffers (torch versions whose FSDP2 refuses integer params) is gathered on use. A mesh
    # of one holds everything locally: skipping DTensor's dispatch there saves CPU time in every call.
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()


def full_storage(layer: QuantizedLinear, after: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A quantized layer's whole storage (`layer.STORAGE`, in that order) on the compute device. Where
    `parallel.cpu_offload` put it in host memory, `layer.offloaded` (parallel/storage_offload.py, attached at build
    time) brings this rank's shards over and gathers them (`after`: in a backward pass, the gradient the weight
    multiplies, which a compiled backward fetches after); otherwise the layer's own tensors are gathered."""
    if layer.offloaded is not None:
        return layer.offloaded.full(after)
    return tuple(gathered(getattr(layer, name)) for name in layer.STORAGE)


class QuantizedLinear(nn.Module):
    """A frozen linear layer y = x W^T + b whose W is kept as integer storage (see the module docstring).
    The storage and bias are parameters (not buffers) so that FSDP2 shards them; nothing here trains."""

    # The storage tensors' names, in the order `dequantize` takes them.
    STORAGE: tuple[str, ...] = ()
    # Storage name -> the float dtype FSDP2 carries its bytes in where it holds no integer parameters
    # (parallel/fsdp.py): one whose size divides a row's bytes.
    CARRIERS: dict[str, torch.dtype] = {}
    # The quant.bits values the method takes. config.py keeps a copy (QUANT_BITS) to check a config before
    # torch is imported.
    BITS: tuple[int, ...] = ()
    # Whether the method may hold fused MoE experts (quant/experts.py: each expert's rows in turn).
    EXPERTS = False
    # Set at build time (parallel/storage_offload.py) when the storage is kept in host memory.
    offloaded = None
    # Set at build time (`in_traced_checkpoint`) by a method whose `forward_beside_low_rank` computes a LoRA layer's
    # base and B factor in one matmul (quant/nf4.py); adapters/lora.py asks it.
    joins_low_rank = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        storage: dict[str, tuple[int, torch.dtype]],
        bias_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        """`storage`: name -> (row width, integer dtype) of each storage tensor, in `STORAGE` order."""
        super().__init__()
        assert tuple(storage) == self.STORAGE, (tuple(storage), self.STORAGE)
        self.in_features, self.out_features = in_features, out_features
        for name, (width, dtype) in storage.items():
            tensor = torch.empty(out_features, width, dtype=dtype, device=device)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # Each method defines can_quantize, from_config, quantize and dequantize.

    @classmethod
    def can_quantize(cls, in_features: int, quant: QuantConfig) -> bool:
        """Whether rows of `in_features` weights can be stored under `quant` (else the linear stays unquantized)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, in_features: int, out_features: int, bias: bool, quant: QuantConfig,
                    bias_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        """An empty layer of this shape, in the format `quant` describes (its weights are loaded later)."""
        raise NotImplementedError

    @classmethod
    def like(cls, linear: nn.Linear, quant: QuantConfig, bias_dtype: torch.dtype) -> QuantizedLinear:
        """An empty layer on `linear`'s device with its shape (weights are loaded later)."""
        return cls.from_config(linear.in_features, linear.out_features, linear.bias is not None, quant,
                               bias_dtype=bias_dtype, device=linear.weight.device)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The storage of `weight` (any block of whole rows, on its device), by name: what loading writes into
        this rank's shard."""
        raise NotImplementedError

    def dequantize(self, storage: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The dense rows that `storage` (tensors in `STORAGE` order, whole rows of each; or float carriers of
        their bytes, which this views back) holds, in `dtype`."""
        raise NotImplementedError

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a full weight into this (unsharded) layer's storage."""
        for name, tensor in self.quantize(weight).items():
            getattr(self, name).view(tensor.dtype).copy_(tensor)

    def in_traced_checkpoint(self) -> None:
        """Called once at build time on each layer of a block whose checkpoint is traced into its compiled graph
        (parallel/compile.py, compile_blocks), where the dequantization is recomputed in backward, never kept: a method
        may then have its matmul save the dense weight, which the backward graph dequantizes once for the
        recomputed forward and the input's gradient both, and offer a LoRA layer on it one matmul for both
        (`joins_low_rank`, `forward_beside_low_rank`). By default nothing changes."""

    def forward_beside_low_rank(self, x: torch.Tensor, low: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`self(x) + F.linear(low, b)`, a LoRA layer's output (`low` its A x, `b` its scaled B), computed as one
        matmul: only for a method that set `joins_low_rank` (quant/nf4.py)."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16, after: torch.Tensor | None = None
                           ) -> torch.Tensor:
        """The whole weight, dense, in `dtype`, wherever the storage is kept (gathered from its shards);
        `after`: in a backward pass, the gradient the weight multiplies (`full_storage`)."""
        return self.dequantize(full_storage(self, after), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # RefetchingMatmul saves only the layer and fetches again in backward: offloaded storage needs nothing more.
        y = RefetchingMatmul.apply(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
