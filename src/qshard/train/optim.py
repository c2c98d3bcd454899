"""AdamW over the trainable parameters, the learning-rate schedule, and sharding-aware clipping."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from qshard.config import OptimConfig


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, loss_scaling: bool = False
) -> torch.optim.AdamW:
    """Decay matrices only: norms and biases (1-D) are not decayed, as is usual for transformers."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # The fused kernel is one launch per step on CUDA; on CPU the foreach path is the fast one. Under fp16
    # loss scaling the fused kernel is not usable: ShardedGradScaler hands it a 1-element overflow flag, which
    # fused AdamW subtracts in place from its 0-d step counters and fails ("output with shape [] doesn't match
    # the broadcast shape [1]"); the foreach path takes no flag (the scaler skips the step itself).
    fused = device.type == "cuda" and not loss_scaling
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients across every shard, and clip to `max_norm` if it is > 0.

    With FSDP2 each gradient is a DTensor holding one shard; the norm of the local pieces alone
    would differ per rank, so the total is reduced over the mesh (`full_tensor`) before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
