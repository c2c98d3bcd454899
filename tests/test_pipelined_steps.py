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


def test_fp16_records_hold_each_steps_own_loss_scale(tiny_models, tmp_path, dist_env, monkeypatch):
    model_dir = tiny_models("llama")
    ahead = _run(_config(model_dir, tmp_path / "ahead", "fp16_mixed", False), dist_env, monkeypatch, True)
    plain = _run(_config(model_dir, tmp_path / "plain", "fp16_mixed", False), dist_env, monkeypatch, False)
    assert ("finish", 0) in ahead[0] and ahead[0].index(("issue", 1)) < ahead[0].index(("finish", 0))
    assert len({r["loss_scale"] for r in plain[1]}) > 1, "the scale never moved: the test would not see a lag"
    _same_training(ahead, plain)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_stop_saves_one_checkpoint_of_the_last_step_run(tiny_models, tmp_path, dist_env, monkeypatch, pipelined):
    """Asked to stop once step 3 has been waited for: without queueing the run saves after step 4 (the next step's
    vote); queued, step 4 may already be queued with its vote taken, so it saves after step 5 at the latest."""
    out = tmp_path / "run"
    cfg = _config(tiny_models("llama"), out, evaluate=False)
    cfg.train.max_steps = 8
    _, records, _ = _run(cfg, dist_env, monkeypatch, pipelined, stop_after=2)
    [saved] = complete_checkpoints(out / "checkpoints")
    last = records[-1]["step"]
    assert saved.name.endswith(f"{last:08d}")
    assert last == (5 if pipelined else 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-timeline clock and pinned copies are CUDA's")
def test_on_a_gpu_a_queued_steps_values_and_time_are_its_own():
    """HostCopy reads what the device computed without waiting for work queued after it; StepClock times a step on
    the device's timeline, from the end of the step before it where that was later than its own start."""
    from qshard.train.loop import HostCopy, StepClock

    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    first = StepClock(device)
    for _ in range(20):
        a = a @ a / a.norm()
    snapshot = a.sum().reshape(1).double()
    copy = HostCopy(snapshot)
    first.stop()
    second = StepClock(device)  # queued behind the first: starts on the device when the first ends
    for _ in range(20):
        a = a @ a / a.norm()
    second.stop()
    assert copy.read() == [pytest.approx(snapshot.item())]
    t1, t2 = first.seconds(None), second.seconds(first)
    assert t1 > 0 and t2 > 0 and abs(t2 - t1) < 0.5 * t1, (t1, t2)
