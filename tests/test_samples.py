"""Samples while training (train.sample_every, train.sample_prompts): samples.jsonl rows at the right steps with
the right prompts, completions that show what was learned, losses bit for bit those of a run without samples
(one rank and two), a resumed run's earlier rows kept, and bad input refused before anything is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_on_ranks
from transformers import AutoModelForCausalLM

from qshard.cli import main as cli_main
from qshard.config import resolve
from qshard.errors import QShardError
from qshard.train.samples import greedy_generate, read_prompts

PATTERN = "a b c a b c"
PROMPT = "Say the pattern."
STEPS = 12


def _record(user: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": PATTERN}]})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Every record asks for the pattern; the held-out set's prompts are numbered so that rows can be told apart."""
    root = tmp_path_factory.mktemp("samples-data")
    (root / "train.jsonl").write_text("".join(_record(PROMPT) + "\n" for _ in range(16)))
    (root / "eval.jsonl").write_text("".join(_record(f"{PROMPT} {i}") + "\n" for i in range(6)))
    return root


def _args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model_dir), "--data", str(data / "train.jsonl"), "--eval-data",
            str(data / "eval.jsonl"), "--output-dir", str(out), "--max-length", "32", "--batch-size", "2",
            "--lr", "3e-2", "--max-steps", str(STEPS), "--train.precision", "fp32", "--lora.dropout", "0.1",
            "--train.eval_every", "6", *extra]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _lines(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(tiny_models, data, tmp_path_factory):
    """The same run with samples (the default: with every evaluation) and without, in this process."""
    root = tmp_path_factory.mktemp("samples-runs")
    model = tiny_models("llama", num_hidden_layers=1)
    for name, extra in (("with", ("--save-every", "6")), ("without", ("--train.sample_every", "0"))):
        assert cli_main(_args(model, data, root / name, *extra)) == 0
    return root


def test_samples_at_evaluations_with_held_out_prompts(runs):
    rows = _lines(runs / "with" / "samples.jsonl")
    assert [r["step"] for r in rows] == [6] * 4 + [12] * 4
    # The first four held-out conversations up to their answer, rendered by the run's template.
    for i, row in enumerate(rows[:4]):
        assert f"{PROMPT} {i}" in row["prompt"] and PATTERN not in row["prompt"], row
    assert rows[-1]["completion"] == PATTERN, rows  # trained to answer with the pattern, and to stop after it
    assert not (runs / "without" / "samples.jsonl").exists()


def test_samples_leave_training_unchanged(runs):
    assert _losses(runs / "with") == _losses(runs / "without")


def test_resumed_run_keeps_the_samples_before_its_step(runs, tiny_models, data, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs / "with", out)
    before = (out / "samples.jsonl").read_text().splitlines()
    resume = out / "checkpoints" / "step-00000006"
    assert cli_main(_args(tiny_models("llama", num_hidden_layers=1), data, out, "--resume", str(resume))) == 0
    after = (out / "samples.jsonl").read_text().splitlines()
    assert after[:4] == before[:4]  # step 6's rows, kept as they were
    assert [json.loads(line)["step"] for line in after] == [6] * 4 + [12] * 4  # step 12's written anew, once


def test_given_prompts_every_n_steps(tiny_models, data, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n\nSomething else\n")
    out = tmp_path / "run"
    args = _args(tiny_models("llama", num_hidden_layers=1), data, out, "--train.sample_every", "5",
                 "--train.sample_prompts", str(prompts), "--train.sample_max_new_tokens", "3")
    assert cli_main(args) == 0
    rows = _lines(out / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (5, 10, 12) for p in (PROMPT, "Something else")]
    assert all(len(r["completion"].split()) <= 3 for r in rows), rows


def test_two_ranks_sample_and_train_as_without(tiny_models, data, tmp_path):
    model = tiny_models("llama", num_hidden_layers=1)
    ranks = run_on_ranks({name: _args(model, data, tmp_path / name, *extra)
                          for name, extra in (("with", ()), ("without", ("--train.sample_every", "0")))})
    for name, results in ranks.items():
        assert [r.code for r in results] == [0, 0], (name, results[0].stderr, results[1].stderr)
    rows = _lines(tmp_path / "with" / "samples.jsonl")
    assert [r["step"] for r in rows] == [6] * 4 + [12] * 4
    assert _losses(tmp_path / "with") == _losses(tmp_path / "without")


def test_batched_generation_is_each_prompts_own(tiny_models):
    """Prompts of different lengths, padded on the left and decoded together, get what each gets alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama", num_hidden_layers=1)).eval()
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50], [1, 60, 61]]
    alone = [greedy_generate(model, [p], [], 6, 0, torch.device("cpu"))[0] for p in prompts]
    assert greedy_generate(model, prompts, [], 6, 0, torch.device("cpu")) == alone
    assert all(len(c) == 6 for c in alone)
    stop = alone[0][2]  # stopping at a token leaves it and what follows out, for that prompt alone
    stopped = greedy_generate(model, prompts, [stop], 6, 0, torch.device("cpu"))
    assert stopped == [c[: c.index(stop)] if stop in c else c for c in alone]
    # ids past the tokenizer's vocabulary (an embedding padded past it) are never chosen
    limit = max(max(c) for c in alone)
    limited = greedy_generate(model, prompts, [], 6, 0, torch.device("cpu"), vocab=limit)
    assert all(t < limit for c in limited for t in c) and limited != alone


def test_prompts_from_a_yaml_list_or_a_jsonl_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  sample_prompts: [\"Say it, twice.\", Go]\n")
    assert read_prompts(resolve(str(config), []).train) == ["Say it, twice.", "Go"]
    answered = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Go"}) + "\n\n" + json.dumps({"messages": answered}) + "\n")
    assert read_prompts(resolve(None, [("train.sample_prompts", str(tmp_path / "p.jsonl"))]).train) == [
        "Go", answered[:1]]  # a conversation up to its last answer
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "Go"}) + "\n")
    with pytest.raises(QShardError, match=r"bad.jsonl:1: expected"):
        read_prompts(resolve(None, [("train.sample_prompts", str(tmp_path / "bad.jsonl"))]).train)


@pytest.mark.parametrize(("extra", "needle"), [
    (("--train.sample_prompts", "/nonexistent/prompts.txt"), "train.sample_prompts: cannot read /nonexistent"),
    (("--train.sample_every", "-1"), "train.sample_every must be >= 0"),
    (("--train.sample_every", "2", "--data.eval_path", "", "--data.eval_fraction", "0"),
     "train.sample_every: nothing to sample"),
])
def test_bad_input(tiny_models, data, tmp_path, capsys, extra, needle):
    out = tmp_path / "run"
    assert cli_main(_args(tiny_models("llama", num_hidden_layers=1), data, out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("qshard: error:") and needle in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert not out.exists() or not any(out.iterdir())
