"""How a step's micro-batches add up their gradients: inside backward, as FSDP2 does, or (parallel.
defer_grad_accumulation, under cpu_offload) after it.

Why: under cpu_offload FSDP2 copies each block unit's reduced gradient to the host in the unit's post-backward.
For the first micro-batch of a step the copy is asynchronous and overlaps the rest of backward; for every later
one FSDP2 adds the copy to the gradient already on the host, and since that add needs the copy, it copies
synchronously: the host waits for the device at every unit, and backward's next kernels are queued only then.
Deferred, the sum of the earlier micro-batches is set aside before backward (the parameters' gradients set to
None), so FSDP2 copies as for a first micro-batch, and is added back once backward has ended: `backward()`
returns after FSDP2's post-backward callback, which waits for every copy (`finalize_backward`; it runs in every
backward as long as nothing tells FSDP2 a backward is not the last). Each unit reduces once per backward, so each
micro-batch adds once to the running sum, on one side or the other: float addition commutes, and the gradients
are FSDP2's own, bit for bit. What it saves is the wait at every unit; the adds themselves (as many bytes as
FSDP2's) run after backward, on this thread. The cost: the held sum and the new gradients exist together during
backward, one more set of the trained weights' gradients in host memory, which torch's pinned-memory cache then
keeps for the run."""

from __future__ import annotations

import torch

from qshard.config import Config
from qshard.parallel.mesh import local_tensor


class SummedInBackward:
    """FSDP2 (or autograd, without FSDP2) adds each micro-batch's gradients into the earlier ones'."""

    def before_backward(self) -> None:
        pass

    def after_backward(self) -> None:
        pass


class SummedAfterBackward:
    """The earlier micro-batches' gradients set aside during each backward and added after it."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.held: list[torch.Tensor | None] | None = None

    def before_backward(self) -> None:
        self.held = None
        held = [p.grad for p in self.params]
        if all(g is None for g in held):  # the step's first micro-batch: nothing to set aside
            return
        for p in self.params:
            p.grad = None
        self.held = held

    @torch.no_grad()
    def after_backward(self) -> None:
        if self.held is None:
            return
        new, old = [], []
        for p, g in zip(self.params, self.held, strict=True):
            if g is None:
                continue
            if p.grad is None:  # no gradient reached it in this micro-batch
                p.grad = g
            else:
                new.append(local_tensor(p.grad))
                old.append(local_tensor(g))
        if new:
            torch._foreach_add_(new, old)
        self.held = None


def defers_grad_sum(cfg: Config) -> bool:
    """Whether the run sums its micro-batches' gradients after backward: parallel.defer_grad_accumulation (config.py
    allows it under cpu_offload only), where a step has more than one micro-batch."""
    return cfg.parallel.cpu_offload and cfg.parallel.defer_grad_accumulation and cfg.train.grad_accum > 1


def build_grad_sum(cfg: Config, params: list[torch.nn.Parameter]) -> SummedInBackward | SummedAfterBackward:
    return SummedAfterBackward(params) if defers_grad_sum(cfg) else SummedInBackward()
