"""Broadcast loading end to end: a 2-process gloo run of `qshard train` where rank 1 cannot see the model
directory at all (config.json and tokenizer come from rank 0), and each rank quantizes only its own rows."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import free_port, spawn
from test_train import _config

from qshard.loading import Checkpoint
from qshard.quant import quantize_nf4


def _train_worker(rank: int, world: int, port: int, model_dir: str, tmp: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    from qshard.parallel.distributed import init_distributed, shutdown
    from qshard.train.run import train

    # One machine stands in for two nodes: rank 1 is told a path that exists nowhere, as the model path
    # is on a node without the files.
    if rank > 0:
        model_dir = f"{tmp}/only-on-rank-0"
        assert not os.path.exists(model_dir)
    cfg = _config(model_dir, f"{tmp}/run", steps=2)
    cfg.model.load_mode = "broadcast"
    cfg.quant.double_quant = False  # the shards compared below: codes and fp32 scales
    cfg.data.cache_dir = f"{tmp}/cache"
    cfg.train.eval_every = 0
    env = init_distributed()
    try:
        result = train(cfg, env)
        shards = {
            n: p.to_local().clone() for n, p in result.model.named_parameters() if n.endswith(("packed", "absmax"))
        }
        torch.save({"summary": result.summary, "shards": shards}, f"{tmp}/rank{rank}.pt")
    finally:
        shutdown()


def test_broadcast_training_without_the_model_directory(tiny_models, tmp_path):
    model_dir = tiny_models("llama")
    spawn(_train_worker, (2, free_port(), str(model_dir), str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert [r["summary"]["steps"] for r in results] == [2, 2]
    # Each rank's codes and scales are its rows of the whole weight quantized at once.
    ckpt = Checkpoint(model_dir)
    names = {n.rsplit(".", 1)[0] for n in results[0]["shards"]}
    assert len(names) == 2 * 7
    for module in names:
        weight = ckpt.read(module.replace(".base", "") + ".weight")
        for part, full in zip(("packed", "absmax"), quantize_nf4(weight, 64), strict=True):
            for rank, piece in enumerate(torch.chunk(full, 2, dim=0)):
                # As integers: FSDP2 holds them as float carriers of the same bytes (parallel/fsdp.py).
                got = results[rank]["shards"][f"{module}.{part}"].view(piece.dtype)
                assert torch.equal(got, piece), (module, part, rank)


def test_any_failure_on_rank0_becomes_one_clear_error_on_every_rank(dist_env):
    """Not only QShardError: an OSError reading the files on rank 0 must reach the ranks waiting in the
    broadcast as the same clear error, or they would wait for the collective timeout."""
    from qshard.errors import QShardError
    from qshard.parallel.distributed import from_rank0

    def unreadable():
        raise PermissionError(13, "Permission denied", "/models/x/config.json")

    with pytest.raises(QShardError, match=r"on rank 0: PermissionError: .*Permission denied.*config.json"):
        from_rank0(unreadable, dist_env.is_main)
    assert from_rank0(lambda: {"a": 1}, dist_env.is_main) == {"a": 1}
