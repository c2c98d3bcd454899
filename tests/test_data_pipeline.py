"""A run's data: sources mixed with weights, held-out split, the on-disk tokenization cache, parallel
tokenization, memory-mapped storage, packing end to end."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import spawn

from qshard.config import ColumnsConfig, Config, SourceConfig
from qshard.data import PackedExamples, load_datasets, load_examples
from qshard.data import dataset as dataset_mod
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def records(n: int, tag: str = "") -> list[dict]:
    letters = "abcdefghij"
    return [
        {
            "instruction": f"Reverse{tag}.",
            "input": " ".join(letters[: 1 + i % 9]),
            "output": " ".join(reversed(letters[: 1 + i % 9])) + f" {i}",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def config(tmp_path: Path, validate: bool = True, **data) -> Config:
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.max_length = 64
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg.validate() if validate else cfg


def as_lists(examples) -> list[tuple[list[int], list[int]]]:
    return [(e.input_ids, e.labels) for e in examples]


def test_single_path_matches_in_memory_loading_and_split(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(40))
    train, held = load_datasets(config(tmp_path, path=str(path)), tok)
    assert len(train) == 38 and len(held) == 2
    from qshard.data import split_held_out

    ref_train, ref_held = split_held_out(load_examples(path, tok, 64), 0.05, Config().train.seed)
    assert as_lists(train) == as_lists(ref_train) and as_lists(held) == as_lists(ref_held)
    # stored on disk, read through memory maps
    assert isinstance(train.stores[0].ids, np.memmap)


def test_cache_is_reused_and_keyed_by_data_tokenizer_and_settings(tok, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", records(20))
    cfg = config(tmp_path, path=str(path), eval_fraction=0.0)
    first, _ = load_datasets(cfg, tok)
    cache = tmp_path / "cache"
    assert len(list(cache.iterdir())) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(dataset_mod, "build_store", no_tokenizing)
    again, _ = load_datasets(cfg, tok)
    assert as_lists(again) == as_lists(first)
    monkeypatch.undo()

    def entries() -> int:
        return len([p for p in cache.iterdir() if ".tmp-" not in p.name])

    load_datasets(config(tmp_path, path=str(path), eval_fraction=0.0, max_length=32), tok)  # settings
    assert entries() == 2
    other = build_demo_tokenizer()
    other.chat_template = None
    load_datasets(cfg, other)  # tokenizer
    assert entries() == 3
    write_jsonl(path, records(21))  # data: size and mtime change
    changed, _ = load_datasets(cfg, tok)
    assert entries() == 4 and len(changed) == 21


def test_sources_with_weights_and_column_mapping(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", records(10, "A"))
    renamed = [{"q": r["instruction"], "ctx": r["input"], "ans": r["output"]} for r in records(8, "B")]
    b = write_jsonl(tmp_path / "b.jsonl", renamed)
    cols = ColumnsConfig(instruction="q", input="ctx", output="ans")
    cfg = config(
        tmp_path,
        path=str(a),
        eval_fraction=0.0,
        sources=[SourceConfig(path=str(b), weight=2.0, columns=cols), SourceConfig(path=str(a), weight=0.5)],
    )
    train, held = load_datasets(cfg, tok)
    assert held == [] or len(held) == 0
    texts = [tok.decode(e.input_ids) for e in train]
    assert len(train) == 10 + 16 + 5
    assert sum("ReverseB" in t for t in texts) == 16 and sum("ReverseA" in t for t in texts) == 15
    b_texts = [t for t in texts if "ReverseB" in t]
    assert all(b_texts.count(t) == 2 for t in b_texts)  # weight 2: each example twice
    half = texts[26:]
    assert len(set(half)) == 5 and set(half) <= set(texts[:10])  # weight 0.5: five distinct of a's ten
    with pytest.raises(QShardError, match="weight of 0.01 leaves none"):
        load_datasets(config(tmp_path, sources=[SourceConfig(path=str(a), weight=0.01)]), tok)


def test_eval_fraction_holds_out_part_of_every_source(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", records(20, "A"))
    b = write_jsonl(tmp_path / "b.jsonl", records(20, "B"))
    sources = [SourceConfig(path=str(a)), SourceConfig(path=str(b), weight=3.0)]
    cfg = config(tmp_path, eval_fraction=0.1, sources=sources)
    train, held = load_datasets(cfg, tok)
    held_texts = [tok.decode(e.input_ids) for e in held]
    assert len(held) == 4 and sum("ReverseA" in t for t in held_texts) == 2
    assert len(train) == 18 + 3 * 18
    assert not set(held_texts) & {tok.decode(e.input_ids) for e in train}


def test_empty_after_filtering_fails_before_training(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(5))
    with pytest.raises(QShardError, match=r"a.jsonl: no usable examples: of 5 records, 0 are bad, 5 are longer"):
        load_datasets(config(tmp_path, path=str(path), max_length=5, overlong="drop"), tok)
    assert not any(".tmp-" in p.name for p in (tmp_path / "cache").iterdir())  # no half-written store left


def test_parallel_tokenization_matches_serial(tok, tmp_path, monkeypatch):
    monkeypatch.setattr("qshard.data.tokenize.CHUNK", 7)  # several chunks per worker
    lines = [json.dumps(r) for r in records(60)]
    lines[13] = "{bad"
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    serial, _ = load_datasets(config(tmp_path / "s", path=str(path), eval_fraction=0.0, on_bad_record="skip"), tok)
    parallel, _ = load_datasets(
        config(tmp_path / "p", path=str(path), eval_fraction=0.0, on_bad_record="skip", num_workers=2), tok
    )
    assert len(serial) == 59 and as_lists(parallel) == as_lists(serial)


def test_non_leader_ranks_do_not_tokenize(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(10))
    with pytest.raises(QShardError, match="every rank of a node sees"):  # nothing cached; a non-leader never writes
        load_datasets(config(tmp_path, path=str(path)), tok, local_rank=1)
    load_datasets(config(tmp_path, path=str(path)), tok, local_rank=0)
    assert len(load_datasets(config(tmp_path, path=str(path)), tok, local_rank=1)[0]) == 9


def test_packing_config_packs_train_and_held_out(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(40))
    train, held = load_datasets(config(tmp_path, path=str(path), packing=True, eval_fraction=0.1), tok)
    assert isinstance(train, PackedExamples) and isinstance(held, PackedExamples)
    docs = sum(int((np.array(s.position_ids) == 0).sum()) for s in train)
    assert docs == 36 and len(train) < 36 / 2
    assert all(len(s.input_ids) <= 64 for s in train)


def test_training_with_packing_runs(tiny_models, tmp_path, dist_env, caplog):
    """Into a second epoch (packed anew), with the held-out loss in the progress output."""
    from qshard.train.run import train

    path = write_jsonl(tmp_path / "a.jsonl", records(64))
    cfg = config(tmp_path, validate=False, path=str(path), packing=True, eval_fraction=0.1, max_length=96)
    cfg.model.path = str(tiny_models("llama"))
    cfg.train.precision = "fp32"
    cfg.train.max_steps = 4  # 15 packed sequences, 3 steps an epoch: the last step is in epoch 1
    cfg.train.micro_batch_size = 4
    cfg.output.dir = str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="qshard"):
        result = train(cfg.validate(), dist_env)
    metrics = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics][-1] == 1 and all(np.isfinite(m["loss"]) for m in metrics)
    # every input token is real: with packing, a step's tokens are its sequences' lengths
    assert all(m["tokens"] > m["trained_tokens"] > 0 for m in metrics)
    assert np.isfinite(result.summary["eval_loss_end"])
    assert os.path.isdir(result.out / "adapter")
    last = f"step {len(metrics)}/{len(metrics)} | loss {metrics[-1]['loss']:.4f}"
    held_out = f"held-out loss {metrics[-1]['eval_loss']:.4f} (perplexity {metrics[-1]['eval_ppl']:.2f})"
    assert any(last in line and held_out in line for line in caplog.text.splitlines()), caplog.text


def _two_ranks(rank: int, world: int, init_file: str, paths: list[str], cache: str, results: str) -> None:
    """One of two gloo ranks on one node: local rank 0 tokenizes, rank 1 must only read."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if rank == 1:
            dataset_mod.build_store = lambda *a, **k: (_ for _ in ()).throw(AssertionError("rank 1 tokenized"))
        tok = build_demo_tokenizer()
        out = []
        for path in paths:
            cfg = Config()
            cfg.data.path, cfg.data.cache_dir, cfg.data.eval_fraction = path, cache, 0.0
            try:
                out.append({"examples": as_lists(load_datasets(cfg, tok, local_rank=rank, is_main=rank == 0)[0])})
            except QShardError as e:
                out.append({"error": str(e)})
        Path(results, f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_one_tokenization_and_its_errors(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", records(12))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(records(1)[0]) + "\n{broken\n")
    args = (2, str(tmp_path / "init"), [str(good), str(bad)], str(tmp_path / "cache"), str(tmp_path))
    spawn(_two_ranks, args)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert len(ranks[1][0]["examples"]) == 12
    assert ranks[1][1]["error"].startswith(f"{bad}:2: invalid JSON")
