"""Sharding strategies, offload and activation-checkpointing variants through the real CLI (gloo on CPU):
each gives world size 1's losses in fp32, and its DCP checkpoint loads back (at world size 1, by export)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_on_ranks
from safetensors.torch import load_file

from qshard.config import Config, from_dict, resolve
from qshard.errors import QShardError
from qshard.parallel.mesh import replicate_degree

STEPS = 3


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A few short instruction records, no held-out part: nothing but the training steps to wait for."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    records = [{"instruction": f"Reverse {w}", "output": w[::-1]} for w in ("abc", "lemon", "qshard", "fsdp") * 4]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _options(out, model_dir, data, nproc) -> list[str]:
    """Global batch 4 (micro-batches of 1 x grad_accum x nproc) whatever the world size."""
    return [
        "--model.path",
        str(model_dir),
        "--data.path",
        str(data),
        "--data.eval_fraction",
        "0",
        "--output.dir",
        str(out),
        "--parallel.nproc",
        str(nproc),
        "--train.grad_accum",
        str(4 // nproc),
        "--train.micro_batch_size",
        "1",
        "--train.max_steps",
        str(STEPS),
        "--optim.lr",
        "1e-2",
        "--train.precision",
        "fp32",
        "--data.max_length",
        "32",
        "--optim.warmup_steps",
        "0",
    ]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_models, data_file):
    """World size 1 with the same options, in this process (what `--nproc 1` runs, minus a process start);
    activation checkpointing of every block, non-reentrant (the default)."""
    from qshard.train.run import run_training

    out = tmp_path_factory.mktemp("ws1") / "run"
    flags = _options(out, tiny_models("llama"), data_file, 1)
    run_training(resolve(None, [(name.removeprefix("--"), value) for name, value in zip(flags[::2], flags[1::2])]))
    return out


VARIANTS = {
    # DDP-like: a (2, 1) mesh; NF4 codes as DTensor buffers with the (Replicate, Shard) pair; no checkpointing.
    "none": (
        2,
        "--parallel.sharding",
        "none",
        "--parallel.quant_sharding",
        "dtensor",
        "--parallel.activation_checkpointing",
        "false",
    ),
    # ZeRO-2 with params, grads and optimizer on the CPU, activation offload, reentrant checkpointing of
    # every 2nd block (block 0 only: the one whose input comes from the frozen embeddings).
    "grad_op": (
        2,
        "--parallel.sharding",
        "grad_op",
        "--parallel.cpu_offload",
        "true",
        "--parallel.activation_offload",
        "true",
        "--parallel.ac_reentrant",
        "true",
        "--parallel.ac_every",
        "2",
        "--parallel.quant_sharding",
        "fsdp",
    ),
    # A 2 x 2 mesh: 2 replicas, each sharded over 2 ranks.
    "hybrid": (
        4,
        "--parallel.sharding",
        "hybrid",
        "--parallel.replicate_degree",
        "2",
        "--parallel.quant_sharding",
        "fsdp",
    ),
}


@pytest.fixture(scope="module")
def strategies(tmp_path_factory, tiny_models, data_file):
    """Each variant's run through the CLI's entry point, those of a world size in one group of spawned ranks
    (run_on_ranks). Returns {variant: (output dir, each rank's RankRun)}."""
    root = tmp_path_factory.mktemp("strategies")
    done = {}
    for world in sorted({nproc for nproc, *_ in VARIANTS.values()}):
        runs = {variant: ["train", *_options(root / variant, tiny_models("llama"), data_file, nproc), *extra]
                for variant, (nproc, *extra) in VARIANTS.items() if nproc == world}
        done.update({variant: (root / variant, ranks) for variant, ranks in run_on_ranks(runs, world).items()})
    return done


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_strategy_matches_world_size_1_and_its_checkpoint_loads(baseline, strategies, tmp_path, variant):
    from qshard.export_cmd import run_export

    run, ranks = strategies[variant]
    for rank, (code, stderr) in enumerate(ranks):
        assert code == 0, (rank, stderr)
    expected, found = _losses(baseline), _losses(run)
    assert len(found) == STEPS
    torch.testing.assert_close(torch.tensor(found), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    # The last DCP checkpoint, saved under this strategy's mesh, read back at world size 1 (this process).
    exported = run_export("adapter", run, None, tmp_path / "exported", 2.0)
    written, reloaded = (
        load_file(run / "adapter" / "adapter_model.safetensors"),
        load_file(exported / "adapter_model.safetensors"),
    )
    assert written.keys() == reloaded.keys()
    for key in written:
        torch.testing.assert_close(reloaded[key], written[key], rtol=0, atol=0)
    assert any(t.abs().sum() > 0 for k, t in written.items() if "lora_B" in k)  # it trained


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"parallel": {"sharding": "grad_op", "reshard_after_forward": True}}, "reshard_after_forward: removed"),
        ({"parallel": {"replicate_degree": 2}}, "only hybrid sharding has replicas"),
        ({"parallel": {"sharding": "hybrid", "replicate_degree": 3, "nproc": 4}}, "does not divide the 4 processes"),
        ({"parallel": {"ac_every": 0}}, "parallel.ac_every must be > 0"),
        ({"parallel": {"sharding": "zero3"}}, "parallel.sharding must be one of full, grad_op, none, hybrid"),
    ],
)
def test_impossible_parallel_options_are_refused(tree, message):
    with pytest.raises(QShardError, match=message):
        from_dict(tree).validate()


def test_replicate_degree_per_strategy(monkeypatch):
    def degree(world, **parallel):
        return replicate_degree(from_dict({"parallel": parallel}).validate(), world)

    assert degree(4) == 1 and degree(4, sharding="grad_op") == 1
    assert degree(4, sharding="none") == 4
    assert degree(8, sharding="hybrid", replicate_degree=2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: 4 ranks per node -> one replica per node
    assert degree(8, sharding="hybrid") == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x4)")  # srun, one task per GPU: 2 per node on 4 nodes
    assert degree(8, sharding="hybrid") == 4
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    with pytest.raises(QShardError, match="ranks per node is unknown"):
        degree(8, sharding="hybrid")
    with pytest.raises(QShardError, match="parallel.replicate_degree: 3 replicas do not divide world size 4"):
        degree(4, sharding="hybrid", replicate_degree=3)


def test_only_grad_op_keeps_gathered_weights_after_forward():
    from qshard.parallel.fsdp import reshard_after_forward

    assert reshard_after_forward(Config().parallel) is True
    with pytest.raises(QShardError, match="use parallel.sharding"):  # its older spelling
        from_dict({"parallel": {"reshard_after_forward": False}})
    assert reshard_after_forward(from_dict({"parallel": {"sharding": "grad_op"}}).validate().parallel) is False


def test_activation_checkpointing_choice_of_blocks_and_reentrant_refusal():
    from torch import nn

    from qshard.config import ParallelConfig
    from qshard.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks

    blocks = [nn.Linear(2, 2) for _ in range(5)]
    assert checkpointed_blocks(blocks, ParallelConfig(ac_every=2)) == blocks[0::2]
    assert checkpointed_blocks(blocks, ParallelConfig(activation_checkpointing=False)) == []
    # Reentrant checkpointing needs transformers' per-layer mechanism: refused, before any weight is read.
    with pytest.raises(QShardError, match="parallel.ac_reentrant: blocks of class Linear are not transformers"):
        apply_activation_checkpointing(nn.Sequential(*blocks), blocks, ParallelConfig(ac_reentrant=True))
