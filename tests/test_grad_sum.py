"""parallel.defer_grad_accumulation: under cpu_offload, the earlier micro-batches' gradients are set aside before each
backward (so FSDP2 finds no gradient to add to, and copies to the host as for a first micro-batch) and added after
it. The step's gradients, weights and optimizer state are FSDP2's accumulation's bit for bit, at world size 1 and 2,
over three micro-batches; the planner counts the held sum in host memory."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import free_port, spawn

from qshard.config import resolve
from qshard.errors import QShardError

STEPS = 3
MICRO_BATCHES = 3


def _trainer(model_dir: str, env, defer: bool):
    from qshard.build import build_model
    from qshard.data import Example
    from qshard.train.loop import Trainer

    cfg = resolve(None, [
        ("train.train_type", "qlora"), ("train.precision", "fp32"), ("parallel.quant_sharding", "dtensor"),
        ("parallel.cpu_offload", "true"), ("parallel.defer_grad_accumulation", str(defer).lower()),
        ("lora.modules_to_save", "[lm_head]"), ("optim.lr", "1e-2"), ("optim.max_grad_norm", "0.05"),
        ("train.micro_batch_size", "2"), ("train.grad_accum", str(MICRO_BATCHES)), ("train.max_steps", str(STEPS)),
    ])
    model, _ = build_model(cfg, env, model_dir)
    g = torch.Generator().manual_seed(0)
    examples = [Example(ids := torch.randint(3, 200, (24,), generator=g).tolist(), ids) for _ in range(32)]
    return Trainer(cfg, env, model, examples, [], 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _trained(model_dir: str, env, defer: bool) -> dict:
    """Losses, each backward's view of the gradients at its start (all None?), the last step's gradients (kept by
    skipping its zero_grad), the trained weights and their optimizer state."""
    trainer = _trainer(model_dir, env, defer)
    starts: list[bool] = []
    scale = trainer.scaler.scale

    def observed(loss):  # backward begins at the loss: what FSDP2 will find in .grad from here on
        loss = scale(loss)
        loss.register_hook(lambda g: starts.append(all(p.grad is None for p in trainer.params)) or g)
        return loss

    trainer.scaler.scale = observed
    losses = [trainer.step(s)["loss"] for s in range(STEPS - 1)]
    trainer.update.zero_grad = lambda: None  # the last step's gradients stay for the comparison
    losses.append(trainer.step(STEPS - 1)["loss"])
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    return {"losses": losses, "starts": starts, "grads": [_local(p.grad) for p in params],
            "params": [_local(p) for p in params],
            "states": [{k: _local(v) for k, v in trainer.optimizer.state[p].items()} for p in params]}


def _compare(model_dir: str, env) -> list[float]:
    fsdp, deferred = (_trained(model_dir, env, defer) for defer in (False, True))
    # FSDP2 adds into the gradient of the step's first micro-batch; deferred, it never finds one.
    assert fsdp["starts"] == [True, False, False] * STEPS
    assert deferred["starts"] == [True, True, True] * STEPS
    assert deferred["losses"] == fsdp["losses"]
    for key in ("grads", "params"):
        assert len(deferred[key]) == len(fsdp[key]) and all(map(torch.equal, deferred[key], fsdp[key])), key
    assert any(g.abs().sum() > 0 for g in deferred["grads"])
    for state, want in zip(deferred["states"], fsdp["states"], strict=True):
        assert all(torch.equal(state[k], want[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    return fsdp["losses"]


def test_deferred_sum_is_fsdp2s_bit_for_bit(tiny_models, dist_env):
    _compare(str(tiny_models("llama")), dist_env)


def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    torch.save(_compare(model_dir, env), f"{result_dir}/rank{rank}.pt")
    shutdown()


def test_deferred_sum_world_size_2(tmp_path, tiny_models):
    """Each rank's gradient shards, weights and state are FSDP2's accumulation's; the ranks agree on the losses."""
    spawn(_worker, (2, free_port(), str(tiny_models("llama")), str(tmp_path)))
    assert torch.load(tmp_path / "rank0.pt") == torch.load(tmp_path / "rank1.pt")


def test_deferred_sum_needs_cpu_offload_and_the_planner_counts_it():
    from qshard.train.grad_sum import defers_grad_sum

    with pytest.raises(QShardError, match="parallel.defer_grad_accumulation: only has an effect with parallel.cpu_"):
        resolve(None, [("parallel.defer_grad_accumulation", "true")])
    on = [("parallel.cpu_offload", "true"), ("parallel.defer_grad_accumulation", "true")]
    assert defers_grad_sum(resolve(None, [*on, ("train.grad_accum", "2")]))
    assert not defers_grad_sum(resolve(None, on))  # one micro-batch: nothing to set aside


def test_a_weight_no_micro_batch_after_the_first_reaches_keeps_its_sum():
    """Plain tensors, as autograd accumulates them: a weight that the second micro-batch does not reach keeps the
    first's gradient; one reached by both gets the sum; nothing is held once backward has ended."""
    from qshard.train.grad_sum import SummedAfterBackward

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    summed = SummedAfterBackward([a, b])
    for uses_b in (True, False):
        summed.before_backward()
        assert (a.grad, b.grad) == (None, None)
        ((a * 2).sum() + ((b * 3).sum() if uses_b else 0)).backward()
        summed.after_backward()
        assert summed.held is None
    assert torch.equal(a.grad, torch.full((3,), 4.0)) and torch.equal(b.grad, torch.full((2,), 3.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 copies gradients asynchronously only to pinned memory")
def test_every_copy_stays_asynchronous_on_a_gpu(tiny_models, dist_env, monkeypatch):
    """On a GPU (pinned host memory), FSDP2 leaves an event for each unit's gradient copy, which it waits for at the
    end of backward, only where the copy was asynchronous: with the sum deferred, in every micro-batch; without it,
    in each step's first only."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    finalize = FSDPParamGroup.finalize_backward
    for defer, want in ((False, [True, False, False]), (True, [True, True, True])):
        seen: list[bool] = []

        def record(group, seen=seen):
            if group.fsdp_params and any(fp.offload_to_cpu and fp.sharded_param.requires_grad
                                         for fp in group.fsdp_params):
                seen.append(all(fp.grad_offload_event is not None for fp in group.fsdp_params
                                if fp.sharded_param.requires_grad))
            return finalize(group)

        monkeypatch.setattr(FSDPParamGroup, "finalize_backward", record)
        trainer = _trainer(str(tiny_models("llama")), dist_env, defer)
        per_backward: list[list[bool]] = []
        for step in range(2):
            start = len(seen)
            trainer.step(step)
            per_backward.append(seen[start:])
        # Units per backward: the same number each micro-batch; each micro-batch's units all async or all not.
        for records in per_backward:
            units = len(records) // MICRO_BATCHES
            assert units and len(records) == units * MICRO_BATCHES
            assert [all(records[i * units:(i + 1) * units]) for i in range(MICRO_BATCHES)] == want, (defer, records)
