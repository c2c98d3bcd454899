"""Preference inputs that earlier code mishandled: long prompts, pairs made identical by truncation, the position
limit of pairs, options that change the reference (PiSSA/OLoRA, an initial adapter's modules_to_save), IPO's
length rule, and SFT cache keys left as they were."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from qshard.config import Config, from_dict
from qshard.data.dataset import cache_key
from qshard.data.tokenize import encode_source, make_options
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError

CHOSEN, REJECTED = "The answer is yes, because it is.", "The answer is no, it is not."


def _rows(path: Path, opts) -> list:
    rows, gen = [], encode_source(str(path), build_demo_tokenizer(), opts)
    try:
        while True:
            rows.append(next(gen))
    except StopIteration:
        return rows


def test_a_long_prompt_leaves_the_completions_room(tmp_path):
    """A 200-word prompt at max_length 64 used to keep 63 prompt tokens and cut both answers to one token."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "word " * 200, "chosen": CHOSEN, "rejected": REJECTED}) + "\n")
    tokenizer = build_demo_tokenizer()
    rows = _rows(path, make_options(64, "preference"))
    trained = [tokenizer.decode([t for t in labels.tolist() if t != -100]) for _, labels in rows]
    assert [t.removesuffix("</s>") for t in trained] == [CHOSEN, REJECTED]
    assert all(len(ids) <= 64 for ids, _ in rows)


def test_a_pair_identical_after_truncation_is_a_bad_record(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "word " * 200, "chosen": CHOSEN, "rejected": REJECTED}) + "\n")
    with pytest.raises(QShardError, match=r"pairs.jsonl:1: 'chosen' and 'rejected' are identical in their first 4 "
                                          r"tokens, all that data.max_length 64 leaves"):
        _rows(path, make_options(64, "preference", max_prompt_length=60))


def test_options_that_would_change_the_reference_are_refused():
    with pytest.raises(QShardError, match="lora.init: train.objective dpo's reference is the base with the adapters"):
        from_dict({"train": {"objective": "dpo"}, "lora": {"init": "pissa"}}).validate()
    with pytest.raises(QShardError, match="train.init_adapter: continues an adapter of the original base"):
        from_dict({"train": {"init_adapter": "run"}, "lora": {"init": "olora"}}).validate()
    from_dict({"train": {"objective": "orpo"}, "lora": {"init": "pissa"}}).validate()  # reference-free: fine
    with pytest.raises(QShardError, match=r"data.sources\[0\].columns: renames SFT fields; preference records"):
        from_dict({"train": {"objective": "dpo"},
                   "data": {"sources": [{"path": "a.jsonl", "columns": {"output": "answer"}}]}}).validate()


def test_an_initial_adapter_trained_with_modules_in_full_needs_them_here(tmp_path):
    from qshard.train.reference import load_init_adapter

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "modules_to_save": ["lm_head"], "peft_type": "LORA"}))
    cfg = from_dict({"train": {"init_adapter": str(tmp_path)}, "lora": {"rank": 8, "alpha": 16}}).validate()
    with pytest.raises(QShardError, match=r"trained \['lm_head'\] in full \(modules_to_save\), this run "
                                          r"lora.modules_to_save \[\]"):
        load_init_adapter(cfg, model=None)


def test_ipo_compares_per_token_means_by_default():
    from qshard.train.preference import DPO, IPO

    def made(objective, **pref):
        return from_dict({"train": {"objective": objective}, "pref": pref}).validate()
    assert IPO(made("ipo")).length_normalized is True
    assert DPO(made("dpo")).length_normalized is False
    assert IPO(made("ipo", length_normalization=False)).length_normalized is False


def test_sft_sources_keep_their_cache_keys():
    """The preference prompt option, empty, is not part of an SFT source's key: stores built before it still hit."""
    class Source:
        options = make_options(512)
        path, split = [], None
    import qshard.data.dataset as dataset

    identity = dataset.source_identity
    dataset.source_identity = lambda s: {"files": [], "split": None}
    try:
        got = cache_key(Source, "tok")
    finally:
        dataset.source_identity = identity
    before = {k: v for k, v in vars(Source.options).items() if k != "max_prompt_length"}
    key = {"version": dataset.STORE_VERSION, "data": {"files": [], "split": None}, "tokenizer": "tok",
           "options": before}
    assert got == hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def test_the_position_limit_of_pairs_is_their_longest_row(tmp_path):
    """chosen and rejected are rows of their own: a pair of two 20-token rows needs 20 positions, not 40."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_preference import _pref_config

    from qshard.data import load_datasets, longest_positions

    cfg: Config = _pref_config(tmp_path / "model-unused", tmp_path)
    train, _ = load_datasets(cfg, build_demo_tokenizer())
    rows = train.rows.lengths()
    assert longest_positions(train) == int(rows.max()) < int(rows.reshape(-1, 2).sum(axis=1).max())
