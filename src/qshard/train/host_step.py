"""The optimizer's update at the end of a step: on the calling thread, or (parallel.overlap_host_optimizer, under
cpu_offload) block by block in a host thread while the next step's forward runs.

Why: under cpu_offload AdamW steps on the host, and the GPU idles until it is done. Overlapped, the step returns
once the update has begun; each block's update runs in forward order, and the next forward waits for a block's
update in a forward pre-hook that runs before the block's FSDP2 pre-forward, the one that copies its host shards
to the GPU. Each block's update is torch's own optimizer step over that block's share of every param group, on
the optimizer's own state (so checkpoints and resume see one optimizer), with the hyperparameters its groups held
when the step began (before the schedule moves the learning rate). The fused AdamW kernel updates each tensor on
its own, so the result is `optimizer.step()`'s bit for bit (tests/test_host_step.py). Whatever reads or writes
the weights or the optimizer state between steps (backward, evaluation, samples, checkpoints, the end of training)
calls `wait` first."""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from qshard.config import Config
from qshard.parallel.distributed import DistEnv
from qshard.parallel.fsdp import block_units
from qshard.precision import precision

log = logging.getLogger("qshard")


class BlockingUpdate:
    """The update on the calling thread: the optimizer's step (through fp16's loss scaler, which skips a step
    whose gradients overflowed), then every gradient dropped."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, scaler) -> None:
        """The step through `scaler`, the trainer's (its loss scaler, or fp32/bf16's pass-through)."""
        scaler.step(self.optimizer)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def wait(self) -> None:
        """Nothing runs in the background."""


@dataclass
class _Share:
    """An optimizer of the run's optimizer's class over some of its parameters (one block's, or those of no
    block), a group for each of the run's groups that holds any of them (`groups`: their indices)."""

    optimizer: torch.optim.Optimizer
    groups: list[int]
    params: list[torch.Tensor]


@dataclass
class _InFlight:
    """One step's update in the background: an event per block, set once its update is done or the thread
    failed (`failed`), and the thread's job, which holds its exception."""

    done: list[threading.Event]
    job: Future | None = None
    failed: bool = False


class OverlappedUpdate:
    """The update of each block's parameters in a host thread, in forward order, waited for block by block by
    the next forward (a pre-hook on each block's unit); the parameters of no block are updated before `step`
    returns. The first step, which creates the optimizer's state, runs on the calling thread. `device`: the
    rank's compute device."""

    def __init__(self, optimizer: torch.optim.Optimizer, blocks: list[nn.Module], device: torch.device) -> None:
        self.optimizer = optimizer
        shares = [(block, _share(optimizer, [p for p in block.parameters() if p.requires_grad])) for block in blocks]
        shares = [(block, share) for block, share in shares if share is not None]
        self.blocks = [share for _, share in shares]
        in_blocks = {id(p) for share in self.blocks for p in share.params}
        rest = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_blocks]
        self.rest = _share(optimizer, rest)
        # The thread's current GPU is the rank's: a new thread's is the first, where anything torch might place
        # there would open a context on another rank's GPU.
        on_gpu = device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="qshard-host-optimizer",
                                       initializer=torch.cuda.set_device if on_gpu else None,
                                       initargs=(device,) if on_gpu else ())
        self.in_flight: _InFlight | None = None
        for i, (block, _) in enumerate(shares):
            # Prepended: before FSDP2's own pre-forward, which copies the unit's host shards to the GPU.
            block.register_forward_pre_hook(functools.partial(self._before_forward, i), prepend=True)

    def step(self, scaler) -> None:
        """Update the parameters of no block now, and begin the blocks' updates in the background. `scaler`: the
        trainer's, a pass-through here (build_update keeps loss-scaled runs on BlockingUpdate)."""
        self.wait()
        if not self.optimizer.state:  # the first step creates the state, in torch's own order
            self.optimizer.step()
            return
        for share in [*self.blocks, *([self.rest] if self.rest else [])]:
            self._take_hyperparameters(share)
        if self.rest is not None:
            self.rest.optimizer.step()
        in_flight = _InFlight([threading.Event() for _ in self.blocks])
        in_flight.job = self.pool.submit(self._update_blocks, in_flight)
        self.in_flight = in_flight

    def zero_grad(self) -> None:
        """Drop the gradients the background thread does not: each block's go once its update is done."""
        if self.in_flight is None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.rest is not None:
            for p in self.rest.params:
                p.grad = None

    def wait(self) -> None:
        """Wait for the update in the background, if any; an exception the thread raised is raised here."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            in_flight.job.result()

    def _take_hyperparameters(self, share: _Share) -> None:
        """The run's groups' hyperparameters as they are now (the learning rate before the schedule's next
        move), and its state (a checkpoint's load replaces the state's dict)."""
        share.optimizer.state = self.optimizer.state
        for group, i in zip(share.optimizer.param_groups, share.groups, strict=True):
            group.update((k, v) for k, v in self.optimizer.param_groups[i].items() if k != "params")

    def _update_blocks(self, in_flight: _InFlight) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                for share, done in zip(self.blocks, in_flight.done, strict=True):
                    update_share(share)
                    done.set()
        except BaseException:
            in_flight.failed = True
            raise
        finally:
            for done in in_flight.done:  # a failed update leaves no forward waiting
                done.set()

    def _before_forward(self, i: int, _module: nn.Module, _args) -> None:
        in_flight = self.in_flight
        if in_flight is None:
            return
        in_flight.done[i].wait()
        if in_flight.failed:
            self.wait()


def update_share(share: _Share) -> None:
    """One block's update (in the background thread), then its gradients dropped."""
    share.optimizer.step()
    for p in share.params:
        p.grad = None


def _share(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> _Share | None:
    """An optimizer of `optimizer`'s class over `params` (None if none of them is in `optimizer`): each group
    `optimizer`'s with the same keys, holding the same tensors in the same order; it shares `optimizer`'s state."""
    chosen = {id(p) for p in params}
    groups, indices = [], []
    for i, group in enumerate(optimizer.param_groups):
        mine = [p for p in group["params"] if id(p) in chosen]
        if mine:
            groups.append({**group, "params": mine})
            indices.append(i)
    if not groups:
        return None
    share = type(optimizer)(groups)
    share.state = optimizer.state
    return _Share(share, indices, [p for g in groups for p in g["params"]])


def build_update(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
                 env: DistEnv) -> BlockingUpdate | OverlappedUpdate:
    """The update parallel.overlap_host_optimizer asks for (config.py allows it with cpu_offload only), where
    the run can take it: fp16's loss scaler steps the optimizer itself (skipping steps that overflowed), so fp16
    runs update on the calling thread."""
    if not cfg.parallel.overlap_host_optimizer:
        return BlockingUpdate(optimizer)
    if precision(cfg).loss_scaling:
        if env.is_main:
            log.warning("parallel.overlap_host_optimizer: off under train.precision fp16_mixed (the loss scaler steps "
                        "the optimizer itself)")
        return BlockingUpdate(optimizer)
    return OverlappedUpdate(optimizer, block_units(model), env.device)
