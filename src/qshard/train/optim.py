"""AdamW over the trainable parameters, the learning-rate schedule, and sharding-aware clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.lr_scheduler import LambdaLR

from qshard.adapters import DoRALinear, LoRALinear
from qshard.config import OptimConfig

# How a step runs (which kernels), as torch.optim keeps it in every param group: this run's choice (below), never
# a checkpoint's, which a run that chose otherwise (another precision, another qshard) may have written.
IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, loss_scaling: bool = False,
    plus_lr_ratio: float | None = None,
) -> torch.optim.AdamW:
    """Decay matrices only: norms and biases (1-D) are not decayed, as is usual for transformers. With LoRA+
    (`plus_lr_ratio`), the adapters' B factors and DoRA magnitudes train at lr * plus_lr_ratio in groups of
    their own, after the lr groups, so that the scheduler scales every group and group 0 keeps the base lr."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fast = lora_plus_params(model) if plus_lr_ratio else set()
    adapters = adapter_params(model)
    # Adapters and weights trained in full (lora.modules_to_save) in groups of their own: on one device the
    # adapters of blocks used in place are plain tensors and the others DTensors, which one fused or foreach
    # call does not take together. The split is by role, not by kind, so a checkpoint's groups are the same at
    # every world size.
    slow = [p for p in trainable if id(p) not in fast]
    parts = [part for part in ([p for p in slow if id(p) in adapters], [p for p in slow if id(p) not in adapters])
             if part]
    groups = [g for part in parts or [[]] for g in _decay_groups(part, cfg.lr, cfg.weight_decay)]
    if fast:
        groups += [g for g in _decay_groups([p for p in trainable if id(p) in fast], cfg.lr * plus_lr_ratio,
                                            cfg.weight_decay) if g["params"]]
    # The fused kernel: one launch per step on CUDA; on the host (CPU runs, and AdamW under cpu_offload) one
    # pass over each parameter's state, where the foreach path makes several and allocates a temporary the size
    # of the second moments (host memory at the step's peak). Under fp16 loss scaling the fused kernel is not
    # usable: ShardedGradScaler hands it a 1-element overflow flag, which fused AdamW subtracts in place from its
    # 0-d step counters and fails ("output with shape [] doesn't match the broadcast shape [1]"); the foreach
    # path takes no flag (the scaler skips the step itself).
    fused = not loss_scaling
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


def implementation(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's IMPLEMENTATION_FLAGS, as the optimizer holds them."""
    return [{k: group[k] for k in IMPLEMENTATION_FLAGS if k in group} for group in optimizer.param_groups]


def _decay_groups(params: list[torch.Tensor], lr: float, weight_decay: float) -> list[dict]:
    """Matrices decayed, 1-D parameters (norms, biases, magnitudes) not; the second group only if it has any."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "lr": lr}]
    no_decay = [p for p in params if p.ndim < 2]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr": lr})
    return groups


def adapter_params(model: nn.Module) -> set[int]:
    """ids of the adapters' own parameters (A, B, DoRA's magnitudes), not their frozen bases'."""
    return {id(p) for m in model.modules() if isinstance(m, LoRALinear) for n, p in m.named_parameters()
            if not n.startswith("base.")}


def lora_plus_params(model: nn.Module) -> set[int]:
    """ids of the parameters LoRA+ trains faster: every adapter's B, and DoRA's magnitude (peft's LoRA+ puts the
    1-D trainable parameters, the magnitudes among them, with the B factors)."""
    fast = set()
    for module in model.modules():
        if isinstance(module, LoRALinear):
            fast.add(id(module.lora_B))
        if isinstance(module, DoRALinear):
            fast.add(id(module.magnitude))
    return fast


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
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, norm: GradNorm | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients across every shard, and clip to `max_norm` if it is > 0.

    With FSDP2 each gradient is a DTensor holding one shard; the norm of the local pieces alone
    would differ per rank, so the total is reduced over the mesh (`full_tensor`) before clipping. Plain
    gradients (adapters of blocks used in place) beside DTensor ones are normed and clipped apart, then combined.
    `norm`: how the norm of a list of gradients is computed (`grad_norm`: the one that suits where they live)."""
    norm = norm or _norm
    with_grad = [p for p in params if p.grad is not None]
    sharded = [p for p in with_grad if isinstance(p.grad, DTensor)]
    plain = [p for p in with_grad if not isinstance(p.grad, DTensor)]
    kinds = [kind for kind in (sharded, plain) if kind] or [[]]
    norms = [norm([p.grad for p in kind]) for kind in kinds]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for kind in kinds:
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
    return total


GradNorm = Callable[[list[torch.Tensor]], torch.Tensor]


def grad_norm(device: torch.device) -> GradNorm:
    """The gradient norm for gradients on `device` (the optimizer's): one foreach call on a GPU; on the host
    (parallel.cpu_offload, CPU runs) the gradients split among up to HOST_NORM_WORKERS of the host's threads."""
    if device.type != "cpu":
        return _norm
    return HostNorm(max(1, min(torch.get_num_threads(), HOST_NORM_WORKERS)))


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


# A host norm is bound by memory bandwidth, which a few cores reach; more threads would only contend with the
# ranks' own work. The shares are fixed in number, so the norm's bits do not depend on the thread count.
HOST_NORM_WORKERS = 8
HOST_NORM_SHARES = 32


class HostNorm:
    """The L2 norm of host gradients, computed by `workers` threads at once: torch's norm of a host tensor
    runs on one core, which leaves the gradients of a large model's adapters (cpu_offload) waiting on one
    core's memory bandwidth while the GPU idles. The tensors go to HOST_NORM_SHARES shares balanced by size;
    each share's sum of squares is computed by some thread, and the shares are added in order, so the result
    is the same for any number of threads (and on every rank). Sharded gradients (DTensors over host shards)
    are reduced over the mesh dimensions that shard them, on the host (gloo)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="qshard-grad-norm") if workers > 1 else None

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return _norm(grads)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        shares = _shares(local, HOST_NORM_SHARES)
        partial = self.pool.map(_sum_of_squares, shares) if self.pool else map(_sum_of_squares, shares)
        total = torch.stack(list(partial)).sum()
        first = grads[0]
        if isinstance(first, DTensor) and first.device_mesh.size() > 1:
            mesh, placements = first.device_mesh, first.placements
            assert all(g.device_mesh == mesh and g.placements == placements for g in grads), "one layout"
            for dim, placement in enumerate(placements):
                if isinstance(placement, Shard):  # replicas hold the same gradients: summed over shards only
                    dist.all_reduce(total, group=mesh.get_group(dim))
        return total.sqrt()


def _shares(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """`tensors` split into at most `n` lists of about equal size, largest first (the same split every step)."""
    shares: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sizes = [0] * n
    for t in sorted(tensors, key=lambda t: -t.numel()):
        i = sizes.index(min(sizes))
        shares[i].append(t)
        sizes[i] += t.numel()
    return [share for share in shares if share]


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)]).square().sum()
