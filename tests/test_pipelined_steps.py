"""`fit` queues each step before waiting for the one before it, where nothing is due between them (evaluation,
samples, a checkpoint, the end): the device goes on to the next step without waiting for the host. The records,
held-out losses and weights are those of waiting for every step before queueing the next."""

from __future__ import annotations

import json
from importlib import resources

import torch

from qshard.config import Config
from qshard.train.loop import Trainer
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"


def _config(model_dir, out) -> Config:
    cfg = Config()
    cfg.model.path, cfg.train.precision = str(model_dir), "fp32"
    cfg.data.path, cfg.data.eval_path, cfg.data.max_length = str(DEMO / "train.jsonl"), str(DEMO / "eval.jsonl"), 48
    cfg.train.max_steps, cfg.train.eval_every, cfg.optim.lr = 6, 3, 1e-2
    cfg.lora.dropout = 0.1  # each step's dropout masks are drawn from its own seed, queued early or not
    cfg.output.dir = str(out)
    return cfg.validate()


def _run(model_dir, out, dist_env, monkeypatch, pipelined: bool):
    events: list[tuple[str, int]] = []
    issue, finish = Trainer.issue, Trainer.finish
    monkeypatch.setattr(Trainer, "issue", lambda self, step: events.append(("issue", step)) or issue(self, step))
    monkeypatch.setattr(Trainer, "finish",
                        lambda self, issued: events.append(("finish", issued.step)) or finish(self, issued))
    if not pipelined:  # as if something were due after every step: each is waited for before the next is queued
        monkeypatch.setattr(Trainer, "_due_after", lambda self, done: True)
    result = train(_config(model_dir, out), dist_env)
    monkeypatch.undo()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {n: p.detach().clone() for n, p in result.model.named_parameters() if p.requires_grad}
    return events, records, weights


def test_steps_are_queued_ahead_except_before_what_is_due(tiny_models, tmp_path, dist_env, monkeypatch):
    model_dir = tiny_models("llama")
    events, records, weights = _run(model_dir, tmp_path / "ahead", dist_env, monkeypatch, True)
    # Evaluation after steps 3 and 6 (the last): steps 3 and 6 are waited for before anything else is queued.
    assert events == [("issue", 0), ("issue", 1), ("finish", 0), ("issue", 2), ("finish", 1), ("finish", 2),
                      ("issue", 3), ("issue", 4), ("finish", 3), ("issue", 5), ("finish", 4), ("finish", 5)]
    plain_events, plain, plain_weights = _run(model_dir, tmp_path / "plain", dist_env, monkeypatch, False)
    assert plain_events == [(kind, s) for s in range(6) for kind in ("issue", "finish")]
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ("loss", "grad_norm", "eval_loss"):
        assert [r.get(key) for r in records] == [r.get(key) for r in plain], key
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[n], plain_weights[n]) for n in weights)
    # Step times: from one wait to the next where a step was queued before the wait for the one before it.
    assert all(r["step_time_s"] > 0 for r in records)
