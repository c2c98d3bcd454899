"""Precision modes: which dtype each kind of tensor is stored, computed and reduced in, chosen once per run.

| mode         | trainable params, grads, optimizer state | frozen unquantized weights, compute | grad reduction |
| ------------ | ---------------------------------------- | ----------------------------------- | -------------- |
| `fp32`       | fp32                                     | fp32                                | fp32           |
| `bf16`       | bf16 (pure: the tightest memory)         | bf16                                | fp32           |
| `bf16_mixed` | fp32 (master copy)                       | bf16                                | fp32           |
| `fp16_mixed` | fp32 (master copy), loss scaled          | fp16                                | fp32           |

Always fp32, whatever the mode: the loss (logits are upcast before the log-sum-exp), the rotary `inv_freq`
buffers (non-persistent buffers are never cast: FSDP2's policy casts parameters only, and the skeleton is cast
parameter by parameter), and the normalization math (transformers' RMSNorm/LayerNorm upcast their input to
fp32 and only the result is cast back). Norm *weights* are stored like the other weights of their kind: in
the compute dtype when frozen, in the master dtype when trained (`full`). NF4/HQQ codes and scales are never
cast: the FSDP2 units of blocks that hold them cast nothing (parallel/fsdp.py), so there the adapters'
master weights are gathered as they are and cast to the compute dtype where they are used.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from qshard.config import Config, precision_name

# ShardedGradScaler keeps its overflow flag as a 1-element tensor, which DTensor's dispatch of the fused
# check-and-unscale op promotes to a replicated DTensor with a warning at every first use; that is intended.
warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1 and ndim!=0")


@dataclass(frozen=True)
class Precision:
    name: str
    master: torch.dtype  # storage of trainable parameters, hence of their gradients and AdamW state
    compute: torch.dtype  # storage of frozen unquantized weights; forward and backward math
    reduce: torch.dtype  # dtype gradients are reduce-scattered / all-reduced in
    loss_scaling: bool  # fp16's range needs a dynamic loss scale

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2 casts each gathered floating parameter to `compute`; summing many ranks' gradients in fp32
        loses nothing, and FSDP2 casts the reduced shard back to the parameter's own dtype."""
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    def grad_scaler(self, device: torch.device, init_scale: float = 2.0**16) -> ShardedGradScaler:
        """A loss scaler for fp16, a pass-through otherwise (a disabled GradScaler's scale/unscale_/update do
        nothing and its step is the optimizer's), so the training step has one code path for every mode.
        ShardedGradScaler all-reduces its overflow flag, so every rank skips the same steps; with FSDP2 it
        checks each rank's DTensor gradient shard."""
        return ShardedGradScaler(device=device.type, init_scale=init_scale, enabled=self.loss_scaling)


MODES = {
    "fp32": Precision("fp32", torch.float32, torch.float32, torch.float32, False),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, torch.float32, False),
    "bf16_mixed": Precision("bf16_mixed", torch.float32, torch.bfloat16, torch.float32, False),
    "fp16_mixed": Precision("fp16_mixed", torch.float32, torch.float16, torch.float32, True),
}


def precision(cfg: Config) -> Precision:
    """The run's precision policy (`train.precision`)."""
    return MODES[precision_name(cfg)]
