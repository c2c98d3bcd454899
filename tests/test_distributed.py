"""Real multi-process gloo runs on CPU: world size 2 against world size 1."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import cli, cli_env, free_port, run_on_ranks, spawn
from safetensors.torch import load_file


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, tiny_models, name, nproc, grad_accum, quant_sharding="fsdp", launcher=False):
    out = tmp_path / name
    args = cli(
        "train", "--model", str(tiny_models("llama")), "--output-dir", str(out),
        "--nproc", str(nproc), "--grad-accum", str(grad_accum), "--batch-size", "2",
        "--max-steps", "4", "--lr", "1e-2", "--train.precision", "fp32", "--data.max_length", "48",
        "--train.eval_every", "0", "--optim.warmup_steps", "0", "--parallel.quant_sharding", quant_sharding,
        "--train.sample_every", "0",
    )
    if nproc == 1:
        # The same command in this process (qshard.cli.main, as `python -m qshard` calls it): a world of one
        # needs no process of its own, and a Python start with torch's imports is most of this run's time.
        from qshard.cli import main

        assert main(args[3:]) == 0
        return out
    if launcher:  # the command as a user types it: the launcher and the processes it starts
        proc = subprocess.run(args, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return out
    for rank, run in enumerate(run_on_ranks({name: args[3:]}, nprocs=nproc)[name]):
        assert run.code == 0, (rank, run.stderr)
    return out


@pytest.fixture(scope="module")
def ws1_run(tmp_path_factory, tiny_models):
    return _train(tmp_path_factory.mktemp("ws1"), tiny_models, "ws1", nproc=1, grad_accum=2)


# The suite's one ordinary end-to-end `qshard train --nproc 2` through the launcher (test_launcher signals and
# kills its runs); the other world-size-2 runs start their ranks as it does, without its process starts.
@pytest.mark.parametrize(("quant_sharding", "launcher"), [("fsdp", True), ("dtensor", False)],
                         ids=["fsdp-launcher", "dtensor-ranks"])
def test_world_size_2_matches_world_size_1(ws1_run, tmp_path, tiny_models, quant_sharding, launcher):
    """Same global batch (2 ranks x 1 micro-batch vs 1 rank x 2 micro-batches): same losses and adapters,
    with the NF4 storage sharded by FSDP2 or by DTensor buffers."""
    one = ws1_run
    two = _train(tmp_path, tiny_models, "ws2", nproc=2, grad_accum=1, quant_sharding=quant_sharding,
                 launcher=launcher)
    l1, l2 = _losses(one), _losses(two)
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=1e-5)
    a1 = load_file(one / "adapter" / "adapter_model.safetensors")
    a2 = load_file(two / "adapter" / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and len(a1) == 2 * 7 * 2
    moved = 0
    for key in a1:
        torch.testing.assert_close(a2[key], a1[key], rtol=1e-4, atol=1e-5)
        moved += int("lora_B" in key and a1[key].abs().sum() > 0)
    assert moved == 14  # every B left zero: the updates really happened
    s1 = json.loads((one / "summary.json").read_text())
    s2 = json.loads((two / "summary.json").read_text())
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    assert s1["eval_loss_end"] < s1["eval_loss_start"]  # it trained
    assert abs(s1["eval_loss_end"] - s2["eval_loss_end"]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Sharded storage: a 2-rank process group spawned here.



QUANT_SHARDINGS = ("fsdp", "dtensor")


def _sharding_worker(rank: int, world: int, port: int, model_dir: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from qshard.build import build_model
    from qshard.config import Config
    from qshard.parallel.distributed import init_distributed, shutdown
    from qshard.quant import NF4Linear

    env = init_distributed()
    results = {}
    for how in QUANT_SHARDINGS:  # one model after the other in the same two processes
        cfg = Config()
        cfg.quant.double_quant = False  # fp32 NF4 scales: the storage this test inspects (packed, absmax)
        cfg.train.train_type = "qlora"
        cfg.parallel.quant_sharding = how
        model, _ = build_model(cfg, env, model_dir)
        layer = model.model.layers[0]
        q = layer.self_attn.q_proj.base
        assert isinstance(q, NF4Linear)
        quant_buffers = [(n, b) for n, b in layer.named_buffers() if n.endswith(("packed", "absmax"))]
        stored = list(layer.named_parameters()) + quant_buffers
        local = {n: p.to_local().clone() for n, p in stored}
        if how == "fsdp":
            layer.unshard()  # FSDP2's all-gather, as the forward does it
            gathered = {"packed": q.packed.detach().clone(), "absmax": q.absmax.detach().clone()}
            layer.reshard()
        else:
            gathered = {"packed": q.packed.full_tensor(), "absmax": q.absmax.full_tensor()}
        local_bytes = sum(t.numel() * t.element_size() for t in local.values())
        results[how] = {"local_bytes": local_bytes, "gathered": gathered,
                        "local_packed_rows": local["self_attn.q_proj.base.packed"].shape[0]}
        if how == "fsdp":  # the frozen head's unit: gathered for the loss, freed before backward (train/loss.py)
            from torch.distributed.tensor import DTensor

            from qshard.train.loss import build_loss, loss_positions

            ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
            batch = {"input_ids": ids, "labels": ids, "loss_positions": loss_positions(ids)}
            chunked = build_loss(model, chunk_tokens=4)
            sharded = []
            for _ in range(2):  # two micro-batches: the second gathers the head again
                with torch.no_grad():  # a preference reference's forward first: the head stays gathered
                    chunked.token_logps(model, batch)
                sharded.append(isinstance(model.lm_head.weight, DTensor))
                loss = chunked(model, batch)
                sharded.append(isinstance(model.lm_head.weight, DTensor))
                loss.backward()
            results[how]["head sharded after the reference, the loss (twice)"] = sharded
            results[how]["adapter gradients"] = sum(p.grad is not None for p in model.parameters())
        del model, layer, q
    torch.save(results, f"{result_dir}/rank{rank}.pt")
    shutdown()


@pytest.fixture(scope="module")
def sharded_storage(tmp_path_factory, tiny_models):
    """Both quantized-storage shardings measured by one pair of spawned ranks: starting two processes (Python
    and torch's imports, each) costs more than both measurements."""
    out = tmp_path_factory.mktemp("storage")
    spawn(_sharding_worker, (2, free_port(), str(tiny_models("llama")), str(out)))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("how", QUANT_SHARDINGS)
def test_quantized_storage_is_sharded_and_gathered_exactly(sharded_storage, tiny_models, how):
    from qshard.loading import Checkpoint
    from qshard.quant import quantize_nf4

    model_dir = tiny_models("llama")
    results = [by_how[how] for by_how in sharded_storage]
    if how == "fsdp":
        for r in results:
            assert r["head sharded after the reference, the loss (twice)"] == [False, True, False, True], r
            assert r["adapter gradients"] > 0
    weight = Checkpoint(model_dir).read("model.layers.0.self_attn.q_proj.weight")
    packed, absmax = quantize_nf4(weight, 64)
    for res in results:
        got = res["gathered"]
        if how == "fsdp" and got["packed"].dtype != torch.uint8:
            # An FSDP2 that refuses integers gathers the bytes in float carriers (codes in bf16, scales as fp32;
            # tests/test_storage_probe.py uses them where FSDP2 holds integers too) ...
            assert (got["packed"].dtype, got["absmax"].dtype) == (torch.bfloat16, torch.float32)
            # ... including code pairs that read as NaN in bf16, which a cast would canonicalize.
            assert torch.isnan(got["packed"]).any()
            got = {"packed": got["packed"].view(torch.uint8), "absmax": got["absmax"].view(torch.int32)}
        # All-gathered under a bf16 MixedPrecisionPolicy, yet still the exact integer codes and fp32 scale bits.
        assert got["packed"].dtype == torch.uint8
        assert got["absmax"].dtype == torch.int32
        assert torch.equal(got["packed"], packed)
        assert torch.equal(got["absmax"], absmax)
        assert res["local_packed_rows"] == packed.shape[0] // 2  # each rank holds half the rows
    assert results[0]["local_bytes"] == results[1]["local_bytes"]
