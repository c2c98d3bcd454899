"""`qshard train --model.shape NAME` with no model directory: random weights of the named shape and the
embedded demo tokenizer, from the command line to the adapter."""

from __future__ import annotations

import json
import re
from importlib import resources

from qshard import cli
from qshard.random_model import NAMED_SHAPES


def _args(out, *extra: str) -> list[str]:
    demo = resources.files("qshard") / "demo_data"
    return [
        "train",
        "--model.shape",
        "llama-tiny",
        "--data",
        str(demo / "train.jsonl"),
        "--eval-data",
        str(demo / "eval.jsonl"),
        "--output-dir",
        str(out),
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--max-length",
        "48",
        "--lr",
        "1e-2",
        *extra,
    ]


def test_train_a_named_shape_without_a_model_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_args(out)) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_loss_end"] < summary["eval_loss_start"]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "qshard random llama-tiny (seed 42)"
    assert not (out / "demo-model").exists()  # the shape is the model: no demo model written


def test_a_shape_whose_vocabulary_the_demo_tokenizer_overflows_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(NAMED_SHAPES, "llama-small-vocab", {**NAMED_SHAPES["llama-tiny"], "vocab_size": 100})
    args = _args(tmp_path / "run")
    args[args.index("llama-tiny")] = "llama-small-vocab"
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(
        r"qshard: error: model.shape llama-small-vocab: its vocabulary of 100 tokens is smaller than the demo "
        r"tokenizer's \d+; give model.path a directory with a tokenizer that fits",
        err[-1],
    ), err
    assert not (tmp_path / "run").exists()
