"""parallel.overlap_host_optimizer: under cpu_offload each block's host AdamW runs in a host thread while the next
forward runs, which waits for a block's update before the block's FSDP2 unit copies its weights to the GPU. The
update is optimizer.step()'s bit for bit (losses, weights and optimizer state), at world size 1 and 2, with
gradient clipping, gradient accumulation, LoRA+'s groups and a head trained in full (updated before the step
returns); a checkpoint saved after a step holds its update; an exception in the thread is raised on the main one."""

from __future__ import annotations

import json
import os
import time
from importlib import resources

import pytest
import torch
from conftest import free_port, spawn

from qshard.config import resolve
from qshard.errors import QShardError
from qshard.train import host_step

STEPS = 4  # the first creates the optimizer's state (on the main thread); the other three overlap
TOTAL = STEPS + 2  # the run's steps (the schedule's length): two more for the exception's test


def _options(overlap: bool) -> list[tuple[str, str]]:
    return [("train.train_type", "qlora"), ("quant.method", "nf4"), ("train.precision", "fp32"),
            ("parallel.quant_sharding", "dtensor"), ("parallel.cpu_offload", "true"),
            ("parallel.overlap_host_optimizer", str(overlap).lower()), ("lora.dropout", "0"),
            ("lora.plus_lr_ratio", "4"), ("lora.modules_to_save", "[lm_head]"), ("optim.lr", "1e-2"),
            ("optim.weight_decay", "0.1"), ("optim.max_grad_norm", "0.05"), ("optim.warmup_steps", "2"),
            ("train.micro_batch_size", "2"), ("train.grad_accum", "2")]


def _trainer(model_dir: str, env, overlap: bool, steps: int):
    from qshard.build import build_model
    from qshard.data import Example
    from qshard.train.loop import Trainer

    cfg = resolve(None, [*_options(overlap), ("train.max_steps", str(steps))])
    model, _ = build_model(cfg, env, model_dir)
    g = torch.Generator().manual_seed(0)
    examples = [Example(ids := torch.randint(3, 200, (24,), generator=g).tolist(), ids) for _ in range(32)]
    return Trainer(cfg, env, model, examples, [], 0)


def _state(trainer) -> tuple[list[torch.Tensor], list[dict]]:
    """This rank's shards of the trained weights, and their optimizer state, in the optimizer's order."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    return [local(p) for p in params], [{k: local(v) for k, v in trainer.optimizer.state[p].items()} for p in params]


def _trained(model_dir: str, env, overlap: bool):
    trainer = _trainer(model_dir, env, overlap, TOTAL)
    losses = [trainer.step(s)["loss"] for s in range(STEPS)]
    trainer.update.wait()
    return trainer, losses, *_state(trainer)


def _assert_same(got, want) -> None:
    _, losses, params, states = got
    _, want_losses, want_params, want_states = want
    assert losses == want_losses
    assert len(params) == len(want_params) and all(torch.equal(a, b) for a, b in zip(params, want_params))
    for state, want_state in zip(states, want_states, strict=True):
        assert state.keys() == want_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], want_state[k]) for k in state)


def _record(trainer, events: list) -> None:
    """Append ("forward", i) to `events` when block i's forward has begun (after its unit's pre-forward)."""
    from qshard.parallel.fsdp import block_units

    for i, block in enumerate(block_units(trainer.model)):
        block.register_forward_pre_hook(lambda _m, _a, i=i: events.append(("forward", i)))


def test_overlapped_update_is_the_blocking_one_and_each_forward_waits_for_its_block(tiny_models, dist_env,
                                                                                    monkeypatch):
    """Bit for bit optimizer.step()'s. The second block's update of step 2 is held back until the next forward
    has begun (then slowed): that forward runs its first block on that block's new weights while the second
    block is still being updated, and the second block's forward begins only once its update is done."""
    model_dir = str(tiny_models("llama"))
    blocking = _trained(model_dir, dist_env, overlap=False)

    events = []
    update = host_step.update_share

    def held(share):
        if share is trainer.update.blocks[1]:
            held.calls += 1
            if held.calls == 2:  # the update of step 2 (the first overlapped one is step 1's)
                held.since = len(events)
                deadline = time.monotonic() + 30
                while ("forward", 0) not in events[held.since:]:
                    assert time.monotonic() < deadline, "the next forward did not begin while a block was updated"
                    time.sleep(0.001)
                time.sleep(0.2)  # the next block's forward would read its old weights now, if it did not wait
        update(share)
        events.append(("updated", trainer.update.blocks.index(share)))

    held.calls, held.since = 0, 0
    monkeypatch.setattr(host_step, "update_share", held)
    trainer = _trainer(model_dir, dist_env, overlap=True, steps=TOTAL)
    assert isinstance(trainer.update, host_step.OverlappedUpdate)
    assert len(trainer.update.blocks) == 2 and trainer.update.rest is not None  # the head trains in full
    _record(trainer, events)
    losses = [trainer.step(s)["loss"] for s in range(STEPS)]
    trainer.update.wait()
    _assert_same((trainer, losses, *_state(trainer)), blocking)
    after = events[held.since:]
    assert after.index(("forward", 0)) < after.index(("updated", 1)) < after.index(("forward", 1))

    # An exception in the thread is raised on the main thread, by the forward that waits for that block.
    def failing(share):
        if share is trainer.update.blocks[1]:
            raise RuntimeError("boom in the host optimizer")
        update(share)

    monkeypatch.setattr(host_step, "update_share", failing)
    trainer.step(STEPS)  # its update fails in the background
    assert trainer.update.in_flight is not None
    with pytest.raises(RuntimeError, match="boom in the host optimizer"):
        trainer.step(STEPS + 1)
    assert trainer.update.in_flight is None


def test_an_update_that_fails_raises_at_the_next_wait(monkeypatch):
    """Waited for outside a forward (a checkpoint, evaluation): the thread's exception is raised there, once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    update = host_step.OverlappedUpdate(optimizer, list(model), torch.device("cpu"))
    for _ in range(2):
        model(torch.randn(4, 8)).square().sum().backward()
        update.step(None)
        update.zero_grad()
    update.wait()

    def failing(share):
        raise ValueError("the host optimizer failed")

    monkeypatch.setattr(host_step, "update_share", failing)
    model(torch.randn(4, 8)).square().sum().backward()
    update.step(None)
    with pytest.raises(ValueError, match="the host optimizer failed"):
        update.wait()
    update.wait()  # raised once: nothing in flight now


def _worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    blocking, overlapped = (_trained(model_dir, env, overlap) for overlap in (False, True))
    _assert_same(overlapped, blocking)
    torch.save(blocking[1], f"{result_dir}/rank{rank}.pt")
    shutdown()


def test_overlapped_update_world_size_2(tmp_path, tiny_models):
    """Each rank's shards and their state, bit for bit the blocking update's; the ranks agree on the losses."""
    spawn(_worker, (2, free_port(), str(tiny_models("llama")), str(tmp_path)))
    assert torch.load(tmp_path / "rank0.pt") == torch.load(tmp_path / "rank1.pt")


def test_a_checkpoint_saved_after_an_overlapped_step_resumes_exactly(tiny_models, tmp_path, dist_env, monkeypatch):
    """Saved at step 3 while the last block's update of step 3 is slowed down in the thread, resumed (overlapped
    from the first step: the state is loaded), the run's losses are the uninterrupted run's bit for bit."""
    from qshard.train.run import train

    update = host_step.update_share

    def slow(share):
        time.sleep(0.2)
        update(share)

    monkeypatch.setattr(host_step, "update_share", slow)
    demo = resources.files("qshard") / "demo_data"

    def run(out, *extra):
        options = [*_options(True), ("model.path", str(tiny_models("llama"))), ("data.path", str(demo / "train.jsonl")),
                   ("data.eval_fraction", "0"), ("data.max_length", "48"), ("train.max_steps", "5"),
                   ("checkpoint.every_steps", "3"), ("output.dir", str(out)), *extra]
        train(resolve(None, options), dist_env)
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", ("checkpoint.resume", str(tmp_path / "full" / "checkpoints" / "step-00000003")))
    assert len(full) == 5 and resumed == full[3:]


def test_overlap_needs_cpu_offload():
    with pytest.raises(QShardError, match="parallel.overlap_host_optimizer: only has an effect with parallel.cpu_"):
        resolve(None, [("parallel.overlap_host_optimizer", "true")])
