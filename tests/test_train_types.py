"""The DoRA and HQQ train types on a tiny Llama: each trains (its held-out loss falls) at world size 1, in
this process, and at world size 2 through the CLI's entry point in two gloo processes, where its losses equal
world size 1's step by step (same global batch: 2 ranks x 1 micro-batch against 1 rank x 2)."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from conftest import run_on_ranks

from qshard import config as config_mod
from qshard.expand import expand_checkpoint
from qshard.quant import HQQLinear
from qshard.train.run import train

DEMO = resources.files("qshard") / "demo_data"


@pytest.fixture(scope="module")
def options(tmp_path_factory, tiny_models):
    """Settings every run here shares; a held-out set of 24 examples keeps the two evaluations short."""
    eval_file = tmp_path_factory.mktemp("data") / "eval.jsonl"
    eval_file.write_text("\n".join((DEMO / "eval.jsonl").read_text().splitlines()[:24]) + "\n")
    return [
        ("model.path", str(tiny_models("llama"))),
        ("data.path", str(DEMO / "train.jsonl")),
        ("data.eval_path", str(eval_file)),
        ("data.max_length", "32"),
        ("train.precision", "fp32"),
        ("train.micro_batch_size", "2"),
        ("train.max_steps", "3"),
        ("optim.lr", "1e-2"),
        ("optim.warmup_steps", "0"),
        ("train.sample_every", "0"),  # samples: test_samples.py
    ]


EXPANDED = "<the tiny model expanded by one Llama-Pro block>"


@pytest.fixture(scope="module")
def expanded(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("pro") / "expanded"
    expand_checkpoint(tiny_models("llama"), out, 1)
    return out


def _in_process(options, extra, out, env):
    cfg = config_mod.resolve(None, options + extra + [("train.grad_accum", "2"), ("output.dir", str(out))])
    return train(cfg, env)


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


TRAIN_TYPES = {
    "lora": [("train.train_type", "lora")],
    "full": [("train.train_type", "full")],
    "llama_pro": [("train.train_type", "llama_pro"), ("model.path", EXPANDED)],
    "dora": [("train.train_type", "dora")],
    "qdora-nf4": [("train.train_type", "qdora")],
    "qlora-nf4-double_quant": [("train.train_type", "qlora"), ("quant.double_quant", "true")],
    "qdora-hqq2-dtensor": [
        ("train.train_type", "qdora"),
        ("quant.method", "hqq"),
        ("quant.bits", "2"),
        ("parallel.quant_sharding", "dtensor"),
    ],
}


@pytest.fixture(scope="module")
def world_size_2(options, expanded, tmp_path_factory):
    """Every train type's world-size-2 run, in one pair of spawned ranks (run_on_ranks): the launcher is the same
    for every train type (test_distributed runs it). Returns {train type: (output dir, {rank: (exit code,
    stderr)})}."""
    root = tmp_path_factory.mktemp("ws2")
    runs = {}
    for name, extra in TRAIN_TYPES.items():
        extra = [(key, str(expanded) if value == EXPANDED else value) for key, value in extra]
        args = [arg for key, value in options + extra for arg in (f"--{key}", value)]
        runs[name] = ["train", *args, "--nproc", "2", "--train.grad_accum", "1", "--output-dir", str(root / name)]
    ranks = run_on_ranks(runs)
    return {name: (root / name, dict(enumerate(ranks[name]))) for name in runs}


@pytest.mark.parametrize("name", list(TRAIN_TYPES))
def test_world_size_2_trains_and_matches_world_size_1(name, options, expanded, world_size_2, tmp_path, dist_env):
    extra = [(key, str(expanded) if value == EXPANDED else value) for key, value in TRAIN_TYPES[name]]
    one = _in_process(options, extra, tmp_path / "ws1", dist_env)
    two, ranks = world_size_2[name]
    for rank, (code, stderr) in ranks.items():
        assert code == 0, (rank, stderr)
    summary = json.loads((two / "summary.json").read_text())
    assert (one.summary["world_size"], summary["world_size"]) == (1, 2)
    for s in (one.summary, summary):
        assert s["eval_loss_end"] < s["eval_loss_start"], s
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(one.out)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("train_type", ["qlora", "qdora"])
def test_trains_over_hqq_at_each_bit_width(train_type, bits, options, tmp_path, dist_env):
    extra = [("train.train_type", train_type), ("quant.method", "hqq"), ("quant.bits", str(bits))]
    result = _in_process(options, extra, tmp_path / "run", dist_env)
    bases = [m.base for m in result.model.modules() if hasattr(m, "lora_A")]
    assert len(bases) == 14 and all(isinstance(b, HQQLinear) and b.bits == bits for b in bases)
    assert result.summary["eval_loss_end"] < result.summary["eval_loss_start"], result.summary
