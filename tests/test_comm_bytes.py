"""Bytes all-gathered by a real training step (2 gloo processes), NF4 base against bf16 base, counted by
benchmarks/comm_stats.py's CommCounter from the collectives actually issued."""

from __future__ import annotations

import json
import os

import pytest
from conftest import free_port, spawn

RUNS = [("lora", "fsdp"), ("qlora", "fsdp"), ("qlora", "dtensor")]
LAYERS, LINEARS = 2, 7  # tiny_models' llama: 2 blocks of q, k, v, o, gate, up, down
# NF4 per weight: 4 bits of code plus one fp32 absmax per 64-weight block, against bf16's 16 bits.
NF4_OVER_BF16 = (4 + 32 / 64) / 16  # 0.28125



def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from comm_stats import measure_train_step

    from qshard import config as config_mod
    from qshard.parallel.distributed import init_distributed, shutdown

    env = init_distributed()
    results = {}
    for train_type, how in RUNS:
        cfg = config_mod.resolve(None, [("model.path", model_dir), ("train.train_type", train_type),
                                        ("parallel.quant_sharding", how), ("train.micro_batch_size", "1"),
                                        ("quant.double_quant", "false")])  # the ratio below is for fp32 scales
        results[f"{train_type}:{how}"] = measure_train_step(cfg, env, model_dir, seq=32)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    shutdown()


@pytest.fixture(scope="module")
def measured(tmp_path_factory, tiny_models):
    model_dir = tiny_models("llama")  # hidden 128, intermediate 256: every block linear's in_features % 64 == 0
    out = tmp_path_factory.mktemp("comm")
    spawn(_worker, (2, free_port(), str(model_dir), str(out)))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_nf4_block_weights_are_gathered_as_4bit_codes_at_a_quarter_of_bf16(measured):
    from comm_stats import part_bytes

    assert measured[0] == measured[1]  # both ranks issue the same collectives (and log the same loss)
    res = measured[0]
    lora, qlora = res["lora:fsdp"], res["qlora:fsdp"]
    for r in res.values():
        # Every all-gathered byte traced to a tensor, and the traced parts add up to the measured buffers.
        assert part_bytes(r, cat="<unattributed>") == 0
        assert part_bytes(r) == sum(r["bytes"]["all_gather"].values())

    # The bf16 run gathers each block linear's weight in bf16; the NF4 runs the codes and scales only, and
    # no dequantized copy of any of them: as uint8 and int32 DTensor buffers, or under FSDP2 as themselves or,
    # where FSDP2 refuses integers, as the same bytes in float carriers (parallel/fsdp.py); the byte ratio below
    # shows nothing wider travels.
    assert len(lora["base_tensors"]) == LAYERS * LINEARS
    assert all(t.endswith(".weight:bfloat16") for t in lora["base_tensors"])
    integers = (".packed:uint8", ".absmax:int32")
    carried = any(t.endswith(".packed:bfloat16") for t in qlora["base_tensors"])
    for r, kinds in ((qlora, (".packed:bfloat16", ".absmax:float32") if carried else integers),
                     (res["qlora:dtensor"], integers)):
        assert len(r["base_tensors"]) == 2 * LAYERS * LINEARS
        assert all(t.endswith(kinds) for t in r["base_tensors"]), r["base_tensors"]
    # The DTensor buffers gather integers only: no float byte of a block linear's base travels there.
    dtensor = res["qlora:dtensor"]
    assert part_bytes(dtensor, "blocks", "base", "bfloat16") == part_bytes(dtensor, "blocks", "base", "float32") == 0

    # Norms, embedding and head are the same in both runs: gathered alike, in bf16. The adapters too, except
    # that a block holding FSDP2-sharded NF4 casts nothing, so they travel as their fp32 masters: twice the bytes.
    assert part_bytes(qlora, "blocks", "other") == part_bytes(lora, "blocks", "other") > 0
    assert part_bytes(qlora, "blocks", "lora") == 2 * part_bytes(lora, "blocks", "lora") > 0
    assert part_bytes(res["qlora:dtensor"], "blocks", "lora") == part_bytes(lora, "blocks", "lora")
    assert part_bytes(qlora, "rest") == part_bytes(lora, "rest") > 0
    # So the quantized storage against bf16 is the ratio over the block linears' base weights alone.
    ratio = part_bytes(qlora, "blocks", "base") / part_bytes(lora, "blocks", "base")
    assert 0.25 <= ratio <= 0.35
    assert ratio == pytest.approx(NF4_OVER_BF16, abs=1e-3)
    # The whole blocks' traffic, LoRA included, is above that but still far below bf16's.
    assert ratio < part_bytes(qlora, "blocks") / part_bytes(lora, "blocks") < 0.5


def test_dtensor_sharding_gathers_the_same_integers_on_every_use(measured):
    from comm_stats import part_bytes

    res = measured[0]
    fsdp, dtensor, lora = res["qlora:fsdp"], res["qlora:dtensor"], res["lora:fsdp"]
    assert dtensor["loss"] == pytest.approx(fsdp["loss"], rel=1e-6)  # the same step, sharded another way
    # Gathered per layer on use (forward, recomputation, backward) rather than per block and kept: more
    # often than FSDP2 does, so more bytes, but each gather is 4.5-bit storage, still under bf16's.
    base = part_bytes(dtensor, "blocks", "base")
    assert part_bytes(fsdp, "blocks", "base") < base < part_bytes(lora, "blocks", "base")
    assert dtensor["calls"]["all_gather"] > fsdp["calls"]["all_gather"]
