"""`fit` queues each step before waiting for the one before it, where nothing is due between them (evaluation,
samples, a checkpoint, the end): the device goes on to the next step without waiting for the host. The records
(but their times and memory), held-out losses and weights are those of waiting for every step before queueing the
next, in fp32 and fp16 (whose loss scale each record holds as of its own step); a preemption saves one checkpoint,
of the last step run, at most one step after waiting for every step would have."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch

from qshard.checkpoint import complete_checkpoints
from qshard.config import Config
from qshard.train.loop import Trainer
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"
UNTIMED = ("step_time_s", "tokens_per_s", "peak_mem_gib", "mfu")


def _config(model_dir, out, precision: str = "fp32", evaluate: bool = True) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision = str(model_dir), precision
    cfg.data.path, cfg.data.max_length = str(DEMO / "train.jsonl"), 48
    if evaluate:
        cfg.data.eval_path, cfg.train.eval_every = str(DEMO / "eval.jsonl"), 3
    else:
        cfg.data.eval_fraction = 0.0
    cfg.train.max_steps, cfg.optim.lr = 6, 1e-2
    cfg.lora.dropout = 0.1  # each step's dropout masks are drawn from its own seed, queued early or not
    cfg.output.dir = str(out)
    return cfg.validate()


def _run(cfg: Config, dist_env, monkeypatch, pipelined: bool, stop_after: int | None = None):
    """Train `cfg`, recording the order of issue and finish; `stop_after`: a rank is asked to stop (as a signal
    would) right after the step of that index has been waited for."""
    events: list[tuple[str, int]] = []
    issue, finish = Trainer.issue, Trainer.finish

    def finished(self, issued):
        events.append(("finish", issued.step))
        record = finish(self, issued)
        if issued.step == stop_after:
            self.stop_requested = True
        return record

    monkeypatch.setattr(Trainer, "issue", lambda self, step: events.append(("issue", step)) or issue(self, step))
    monkeypatch.setattr(Trainer, "finish", finished)
    if not pipelined:  # as if something were due after every step: each is waited for before the next is queued
        monkeypatch.setattr(Trainer, "_due_after", lambda self, done: True)
    result = train(cfg, dist_env)
    monkeypatch.undo()
    metrics = Path(cfg.output.dir) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    weights = {n: p.detach().clone() for n, p in result.model.named_parameters() if p.requires_grad}
    return events, records, weights


def _same_training(a, b) -> None:
    (_, records, weights), (_, plain, plain_weights) = a, b
    assert len(records) == len(plain)
    for got, want in zip(records, plain, strict=True):
        assert {k: v for k, v in got.items() if k not in UNTIMED} == {k: v for k, v in want.items() if k not in UNTIMED}
        assert got["step_time_s"] > 0 and got["tokens_per_s"] > 0
    assert weights.keys() == plain_weights.keys() and weights
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)


def test_steps_are_queued_ahead_except_before_what_is_due(tiny_models, tmp_path, dist_env, monkeypatch):
    model_dir = tiny_models("llama")
    ahead = _run(_config(model_dir, tmp_path / "ahead"), dist_env, monkeypatch, True)
    # Evaluation after steps 3 and 6 (the last): steps 3 and 6 are waited for before anything else is queued.
    assert ahead[0] == [("issue", 0), ("issue", 1), ("finish", 0), ("issue", 2), ("finish", 1), ("finish", 2),
                        ("issue", 3), ("issue", 4), ("finish", 3), ("issue", 5), ("finish", 4), ("finish", 5)]
    plain = _run(_config(model_dir, tmp_path / "plain"), dist_env, monkeypatch, False)
    assert plain[0] == [(kind, s) for s in range(6) for kind in ("issue", "finish")]
    assert [r["step"] for r in ahead[1]] == list(range(1, 7)) and "eval_loss" in ahead[1][2]
    _same_training(ahead, plain)


def test_fp16_and_activation_offload_wait_for_every_step(tiny_models, tmp_path, dist_env, monkeypatch):
    """fp16_mixed reads its loss scale at the end of each step, and activation offload's copies hold a step's
    activations' memory until the device reaches them: neither queues a step early."""
    model_dir = tiny_models("llama")
    for name, option in (("fp16", ("train", "precision", "fp16_mixed")),
                         ("offload", ("parallel", "activation_offload", True))):
        cfg = _config(model_dir, tmp_path / name, evaluate=False)
        setattr(getattr(cfg, option[0]), option[1], option[2])
        events, records, _ = _run(cfg.validate(), dist_env, monkeypatch, True)
        assert events == [(kind, s) for s in range(6) for kind in ("issue", "finish")], name
        assert len(records) == 6


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("when", ["after_wait", "inside_step"])
def test_a_stop_saves_one_checkpoint_of_the_last_step_run(tiny_models, tmp_path, dist_env, monkeypatch, pipelined,
                                                          when):
    """Asked to stop once step 3 has been waited for, or while step 4 is being queued (after its first vote, before
    its totals): without queueing the run saves after step 4; queued, step 5 is queued by the time step 4's stop is
    read, and the run saves after it. One checkpoint either way, of the last step run."""
    out = tmp_path / "run"
    cfg = _config(tiny_models("llama"), out, evaluate=False)
    cfg.train.max_steps = 8
    if when == "inside_step":
        rows = Trainer._rows_to_device

        def asked_while_queueing(self, batch):
            if self.current_step == 4:
                self.stop_requested = True
            return rows(self, batch)

        monkeypatch.setattr(Trainer, "_rows_to_device", asked_while_queueing)
    _, records, _ = _run(cfg, dist_env, monkeypatch, pipelined, stop_after=2 if when == "after_wait" else None)
    [saved] = complete_checkpoints(out / "checkpoints")
    last = records[-1]["step"]
    assert saved.name.endswith(f"{last:08d}")
    assert last == (5 if pipelined else 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-timeline clock and pinned copies are CUDA's")
def test_on_a_gpu_a_queued_steps_values_and_time_are_its_own():
    """HostCopy reads what the device computed without waiting for the work queued after it; StepClock times each
    step on the device's timeline, a step queued behind another from that one's end."""
    from qshard.train.loop import HostCopy, StepClock

    device = torch.device("cuda")
    torch.ones(1, device=device).sum().item()  # the context and the first kernels loaded before any timing
    cycles = 200_000_000  # about 0.1 s of the device's time at 2 GHz
    first = StepClock(device)
    torch.cuda._sleep(cycles)
    value = torch.full((2,), 7.0, device=device, dtype=torch.float64)
    copy = HostCopy(value)
    first.stop()
    second = StepClock(device)  # queued behind the first
    torch.cuda._sleep(4 * cycles)
    second.stop()
    value.fill_(-1.0)  # the memory the copy read, changed after it
    assert copy.read() == [7.0, 7.0]
    assert not second.end.query(), "reading the first step's values waited for the second step"
    t1, t2 = first.seconds(), second.seconds()
    assert 2.5 * t1 < t2 < 6 * t1, (t1, t2)  # each step its own: the second four times the first
