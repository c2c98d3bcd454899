"""Tests for qshard.data and the embedded demo tokenizer/dataset, all on the real demo tokenizer."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import time
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from qshard.data import (
    IGNORE_INDEX,
    Example,
    GlobalBatchSampler,
    collate,
    load_examples,
    split_held_out,
)
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError

REPO = Path(__file__).resolve().parents[1]
OK = {"instruction": "i", "output": "o"}
CHAT_OK = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
SYSTEM = {"role": "system", "content": "s"}


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def plain_tokenizer():
    """A demo tokenizer without a chat template, as base models usually ship."""
    t = build_demo_tokenizer()
    t.chat_template = None
    return t


def write_lines(tmp_path: Path, lines: list, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def trained(example: Example) -> list[int]:
    return [label for label in example.labels if label != IGNORE_INDEX]


def trained_spans(example: Example) -> list[list[int]]:
    """Contiguous runs of trained labels, in order."""
    spans, current = [], []
    for label in example.labels:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return spans + ([current] if current else [])


def assert_labels_match_ids(example: Example) -> None:
    assert len(example.input_ids) == len(example.labels)
    for token, label in zip(example.input_ids, example.labels):
        assert label in (IGNORE_INDEX, token)


# ------------------------------------------------------------------------------------------ instruction


def test_instruction_trains_only_the_response_and_eos(tok, tmp_path):
    record = {"instruction": "Reverse the letters.", "input": "k d s", "output": "s d k"}
    path = write_lines(tmp_path, [record])
    [ex] = load_examples(path, tok, max_length=128)
    assert_labels_match_ids(ex)
    assert tok.decode(ex.input_ids) == "<s><|user|>\nReverse the letters.\n\nk d s\n<|assistant|>\ns d k</s>"
    assert ex.input_ids.count(tok.bos_token_id) == 1 and ex.input_ids[0] == tok.bos_token_id
    [span] = trained_spans(ex)
    # The single trained span runs to the very end and finishes with eos.
    assert ex.labels[-len(span) :] == span and span[-1] == tok.eos_token_id
    assert tok.decode(span, skip_special_tokens=True) == "s d k"
    assert tok.decode(span) == "s d k</s>"


def test_instruction_without_input_and_with_null_input(tok, tmp_path):
    path = write_lines(
        tmp_path,
        [
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "Say hi.", "input": None, "output": "hi"},
        ],
    )
    a, b = load_examples(path, tok, max_length=128)
    assert a == b
    assert tok.decode(a.input_ids) == "<s><|user|>\nSay hi.\n<|assistant|>\nhi</s>"
    assert tok.decode(trained(a), skip_special_tokens=True) == "hi"


def test_builtin_template_when_tokenizer_has_none(tmp_path):
    t = plain_tokenizer()
    path = write_lines(tmp_path, [{"instruction": "Add the numbers.", "input": "3 + 4", "output": "7"}])
    [ex] = load_examples(path, t, max_length=128)
    assert_labels_match_ids(ex)
    expected = "<s>### Instruction:\nAdd the numbers.\n\n### Input:\n3 + 4\n\n### Response:\n7</s>"
    assert t.decode(ex.input_ids) == expected
    assert t.decode(trained(ex)) == "7</s>"


def test_builtin_template_multi_turn_chat(tmp_path):
    t = plain_tokenizer()
    messages = [
        {"role": "system", "content": "Be short."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "uno"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "dos"},
    ]
    [ex] = load_examples(write_lines(tmp_path, [{"messages": messages}]), t, max_length=128)
    assert t.decode(ex.input_ids) == (
        "<s>Be short.\n\n### Instruction:\none\n\n### Response:\nuno</s>"
        "\n\n### Instruction:\ntwo\n\n### Response:\ndos</s>"
    )
    assert [t.decode(s) for s in trained_spans(ex)] == ["uno</s>", "dos</s>"]


def test_bos_is_not_doubled_when_template_emits_it(tmp_path):
    t = build_demo_tokenizer()
    t.chat_template = "{{ bos_token }}" + t.chat_template
    path = write_lines(tmp_path, [{"instruction": "Sort the letters.", "input": "c a b", "output": "a b c"}])
    [ex] = load_examples(path, t, max_length=128)
    assert ex.input_ids[0] == t.bos_token_id and ex.input_ids.count(t.bos_token_id) == 1
    assert t.decode(trained(ex), skip_special_tokens=True) == "a b c"


def test_eos_is_appended_when_the_template_does_not_end_the_answer(tmp_path):
    t = build_demo_tokenizer()
    t.chat_template = t.chat_template.replace("{{ eos_token }}", "")
    [ex] = load_examples(write_lines(tmp_path, [OK]), t, max_length=128)
    assert t.decode(ex.input_ids) == "<s><|user|>\ni\n<|assistant|>\no</s>"
    assert t.decode(trained(ex)) == "o</s>"


# ----------------------------------------------------------------------------------------------- chat


def test_multi_turn_chat_trains_every_assistant_turn_only(tok, tmp_path):
    messages = [
        {"role": "system", "content": "You reverse letters."},
        {"role": "user", "content": "a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "x y"},
        {"role": "assistant", "content": "y x"},
    ]
    [ex] = load_examples(write_lines(tmp_path, [{"messages": messages}]), tok, max_length=128)
    assert_labels_match_ids(ex)
    spans = trained_spans(ex)
    assert [tok.decode(s) for s in spans] == ["c b a</s>", "y x</s>"]
    untrained = [t for t, label in zip(ex.input_ids, ex.labels) if label == IGNORE_INDEX]
    assert tok.decode(untrained) == (
        "<s><|system|>\nYou reverse letters.\n<|user|>\na b c\n<|assistant|>\n<|user|>\nx y\n<|assistant|>\n"
    )


def test_chat_ending_with_user_turn_leaves_it_untrained(tok, tmp_path):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
    ]
    [ex] = load_examples(write_lines(tmp_path, [{"messages": messages}]), tok, max_length=128)
    assert [tok.decode(s) for s in trained_spans(ex)] == ["yo</s>"]
    assert ex.labels[-1] == IGNORE_INDEX and tok.decode(ex.input_ids).endswith("<|user|>\nbye\n")


def test_template_that_is_not_prefix_consistent_is_rejected(tmp_path):
    t = build_demo_tokenizer()
    # Starting with the message count changes the first token as messages are added.
    t.chat_template = "{{ messages | length }}" + t.chat_template
    path = write_lines(tmp_path, ["", CHAT_OK])
    with pytest.raises(QShardError, match=rf"{re.escape(str(path))}:2: .*not prefix-consistent"):
        load_examples(path, t, max_length=128)


def test_auto_detects_chat_and_explicit_format_is_enforced(tok, tmp_path):
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_lines(tmp_path, [chat, chat])
    assert len(load_examples(path, tok, 128)) == len(load_examples(path, tok, 128, fmt="chat")) == 2
    with pytest.raises(QShardError, match=rf"{re.escape(str(path))}:1: missing field 'instruction'"):
        load_examples(path, tok, 128, fmt="instruction")


# ------------------------------------------------------------------------------------------ truncation


def test_truncation_keeps_the_start_and_drops_untrainable(tok, tmp_path, caplog):
    long_prompt = {"instruction": " ".join(["Reverse the letters."] * 20), "output": "a"}
    short = {"instruction": "Repeat the letters 4 times.", "input": "a b", "output": "a b a b a b a b"}
    path = write_lines(tmp_path, [long_prompt, short])
    [full] = load_examples(write_lines(tmp_path, [short], "short.jsonl"), tok, max_length=1000)
    cut = len(full.input_ids) - 3
    with caplog.at_level(logging.WARNING, logger="qshard"):
        [ex] = load_examples(path, tok, max_length=cut)
    assert ex.input_ids == full.input_ids[:cut] and ex.labels == full.labels[:cut]
    assert len(trained(ex)) == len(trained(full)) - 3
    assert f"{path}: dropped 1 of 2 examples" in caplog.text


def test_all_examples_dropped_is_an_error(tok, tmp_path):
    record = {"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"}
    path = write_lines(tmp_path, [record])
    with pytest.raises(QShardError, match=rf"{re.escape(str(path))}: no usable examples"):
        load_examples(path, tok, max_length=5)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "lines, line, problem",
    [
        ([OK, "{not json"], 2, "invalid JSON"),
        ([OK, "", "[1, 2]"], 3, "must be a JSON object, got an array"),
        (['"text"'], 1, "must be a JSON object, got a string"),
        ([OK, {"output": "o"}], 2, "missing field 'instruction'"),
        ([OK, {"instruction": "i"}], 2, "missing field 'output'"),
        ([{"instruction": "i", "output": 3}], 1, "field 'output' must be a string, got a number"),
        ([{"instruction": ["i"], "output": "o"}], 1, "field 'instruction' must be a string, got an array"),
        ([{"instruction": "i", "input": 5, "output": "o"}], 1, "field 'input' must be a string"),
        ([CHAT_OK, OK], 2, "missing field 'messages'"),
        ([{"messages": "hi"}], 1, "field 'messages' must be a non-empty array"),
        ([{"messages": []}], 1, "field 'messages' must be a non-empty array"),
        ([{"messages": ["hi"]}], 1, "field 'messages\\[0\\]' must be an object"),
        ([{"messages": [{"content": "x"}]}], 1, "messages\\[0\\]: missing field 'role'"),
        ([CHAT_OK, {"messages": [{"role": "bot", "content": "x"}]}], 2, "unknown role 'bot'"),
        ([{"messages": [{"role": "user", "content": None}]}], 1, "'content' must be a string, got null"),
        ([{"messages": [SYSTEM, {"role": "user", "content": "u"}]}], 1, "no assistant turn"),
        ([{"prompt": "hello"}], 1, "cannot tell the data format"),
    ],
)
def test_bad_records_name_file_and_line(tok, tmp_path, lines, line, problem):
    path = write_lines(tmp_path, lines)
    with pytest.raises(QShardError, match=rf"^{re.escape(str(path))}:{line}: .*{problem}"):
        load_examples(path, tok, max_length=128)


def test_bad_files_and_options(tok, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(QShardError, match=rf"^{re.escape(str(missing))}: data file not found"):
        load_examples(missing, tok, 128)
    with pytest.raises(QShardError, match=rf"^{re.escape(str(tmp_path))}: the directory holds no data files"):
        load_examples(tmp_path, tok, 128)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    with pytest.raises(QShardError, match=rf"^{re.escape(str(blank))}: the data file has no records"):
        load_examples(blank, tok, 128)
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(json.dumps(OK).encode() + b'\n{"instruction": "\xe9"}\n')
    with pytest.raises(QShardError, match=rf"^{re.escape(str(bad_utf8))}:2: not valid UTF-8"):
        load_examples(bad_utf8, tok, 128)
    good = write_lines(tmp_path, [OK], "good.jsonl")
    with pytest.raises(QShardError, match="format option: unknown format 'csv'"):
        load_examples(good, tok, 128, fmt="csv")
    with pytest.raises(QShardError, match="max_length option"):
        load_examples(good, tok, 0)


def test_blank_lines_are_skipped(tok, tmp_path):
    path = write_lines(tmp_path, ["", OK, "   ", OK, ""])
    assert len(load_examples(path, tok, 128)) == 2


# ----------------------------------------------------------------------------------------- splitting


def fake_examples(n: int) -> list[Example]:
    return [Example([i, i + 1], [IGNORE_INDEX, i + 1]) for i in range(n)]


def test_split_held_out_is_deterministic_and_partitions():
    examples = fake_examples(100)
    train, held = split_held_out(examples, 0.1, seed=3)
    assert (train, held) == split_held_out(examples, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert sorted(e.input_ids[0] for e in train + held) == list(range(100))
    assert split_held_out(examples, 0.1, seed=4)[1] != held
    assert split_held_out(fake_examples(3), 0.01, seed=0)[1] != []  # at least one when fraction > 0
    assert split_held_out(fake_examples(2), 0.9, seed=0)[0] != []  # at least one left to train
    assert split_held_out(examples, 0.0, seed=0) == (examples, [])
    with pytest.raises(QShardError, match="eval_fraction"):
        split_held_out(examples, 1.0, seed=0)


# ------------------------------------------------------------------------------------------- sampler


def step_union(n, mbs, accum, ws, seed, step) -> list[list[int]]:
    """Each rank's indices (flattened) for one step."""
    ranks = []
    for rank in range(ws):
        mbs_list = GlobalBatchSampler(n, mbs, accum, ws, rank, seed).microbatches(step)
        assert len(mbs_list) == accum and all(len(m) == mbs for m in mbs_list)
        ranks.append([i for m in mbs_list for i in m])
    return ranks


def test_sampler_ranks_are_disjoint_and_cover_each_epoch_once():
    n, mbs, accum, ws = 50, 2, 3, 2
    sampler = GlobalBatchSampler(n, mbs, accum, ws, 0, seed=7)
    assert sampler.steps_per_epoch == 50 // 12 == 4
    seen = []
    for step in range(sampler.steps_per_epoch):
        ranks = step_union(n, mbs, accum, ws, 7, step)
        assert not set(ranks[0]) & set(ranks[1])
        seen += ranks[0] + ranks[1]
    assert len(seen) == len(set(seen)) == 48 and set(seen) <= set(range(n))


def test_sampler_union_is_invariant_to_how_the_global_batch_is_factored():
    n, seed = 37, 11
    for step in range(12):  # spans several epochs
        reference = sorted(sum(step_union(n, 2, 2, 1, seed, step), []))
        for mbs, accum, ws in [(1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]:
            assert sorted(sum(step_union(n, mbs, accum, ws, seed, step), [])) == reference


def test_sampler_is_deterministic_and_reshuffles_per_epoch():
    n, seed = 20, 5
    a = GlobalBatchSampler(n, 2, 2, 1, 0, seed)
    b = GlobalBatchSampler(n, 2, 2, 1, 0, seed)
    steps = range(3 * a.steps_per_epoch)
    assert [a.microbatches(s) for s in steps] == [b.microbatches(s) for s in reversed(steps)][::-1]
    # Step k of epoch 1 follows the permutation seeded with seed + 1.
    perm1 = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    assert a.microbatches(a.steps_per_epoch) == [perm1[0:2], perm1[2:4]]
    assert a.microbatches(0) != a.microbatches(a.steps_per_epoch)
    assert GlobalBatchSampler(n, 2, 2, 1, 0, seed + 1).microbatches(0) != a.microbatches(0)


def test_sampler_rejects_too_little_data_and_bad_options():
    with pytest.raises(QShardError, match="only 7 training examples.*needs at least 8"):
        GlobalBatchSampler(7, 2, 2, 2, 0, 0)
    with pytest.raises(QShardError, match="grad_accum"):
        GlobalBatchSampler(10, 1, 0, 1, 0, 0)
    with pytest.raises(QShardError, match="rank 2"):
        GlobalBatchSampler(10, 1, 1, 2, 2, 0)


# ------------------------------------------------------------------------------------------- collate


def test_collate_right_pads():
    batch = collate([Example([5, 6, 7], [IGNORE_INDEX, 6, 7]), Example([8], [8])], pad_id=0)
    assert all(t.dtype == torch.int64 for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


# ----------------------------------------------------------------------------------- demo tokenizer


def test_demo_tokenizer_is_fast_deterministic_and_has_special_tokens(tok):
    start = time.perf_counter()
    again = build_demo_tokenizer()
    assert time.perf_counter() - start < 2.0
    assert again.get_vocab() == tok.get_vocab() and 400 <= len(tok) <= 1000
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_demo_chat_template_renders_roles_and_generation_prompt(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<|system|>\nS\n<|user|>\nU\n"
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": "A"}], tokenize=False)
    assert full == prompt + "A</s>"


def test_demo_tokenizer_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": "Reverse the letters.\n\nq w e"},
        {"role": "assistant", "content": "e w q"},
        {"role": "user", "content": "Héllo, 123 + 45 ?"},
    ]
    assert loaded.chat_template == tok.chat_template
    for t in (tok, loaded):
        rendered = t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|assistant|>\n")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert loaded.decode(ids) == text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )


# -------------------------------------------------------------------------------------- demo dataset


def demo_records(name: str) -> list[dict]:
    text = (resources.files("qshard") / "demo_data" / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def test_demo_eval_questions_are_not_in_train():
    train, held = demo_records("train.jsonl"), demo_records("eval.jsonl")
    assert len(train) == 2000 and len(held) == 200
    train_keys = {(r["instruction"], r["input"]) for r in train}
    assert len(train_keys) == len(train)
    assert not train_keys & {(r["instruction"], r["input"]) for r in held}


def test_demo_examples_are_short_and_load(tok):
    folder = resources.files("qshard") / "demo_data"
    sizes = 0
    for name in ("train.jsonl", "eval.jsonl"):
        with resources.as_file(folder / name) as path:
            sizes += path.stat().st_size
            examples = load_examples(path, tok, max_length=10_000, fmt="instruction")
        assert max(len(e.input_ids) for e in examples) < 48
    assert sizes < 300_000


def test_demo_data_script_reproduces_committed_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_demo_data", REPO / "scripts" / "make_demo_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train, held = script.build_splits()
    script.write_jsonl(tmp_path / "train.jsonl", train)
    script.write_jsonl(tmp_path / "eval.jsonl", held)
    folder = resources.files("qshard") / "demo_data"
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes()
