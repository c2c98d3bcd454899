"""Data sources and formats: file types, directories, column mapping, ShareGPT, plain text, named chat
templates, loss masking, and the bad-record and over-long policies."""

from __future__ import annotations

import csv
import json
import logging
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qshard.data import IGNORE_INDEX, load_examples
from qshard.data.records import read_json, read_raw
from qshard.data.tokenize import Progress
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError

RECORDS = [
    {"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"},
    {"instruction": "Sort the letters.", "input": "", "output": "x y"},
    {"instruction": "Add.", "input": "1 + 2", "output": "3"},
]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def write(path: Path, records: list, kind: str | None = None) -> Path:
    kind = kind or path.suffix[1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records, indent=2))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif kind == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    return path


def trained_text(tok, example) -> str:
    return tok.decode([label for label in example.labels if label != IGNORE_INDEX])


# ------------------------------------------------------------------------------------------------ file types


@pytest.mark.parametrize("kind", ["json", "parquet", "csv"])
def test_every_file_type_gives_the_jsonl_examples(tok, tmp_path, kind):
    reference = load_examples(write(tmp_path / "a.jsonl", RECORDS), tok, 128)
    assert len(reference) == 3
    assert load_examples(write(tmp_path / f"a.{kind}", RECORDS), tok, 128) == reference


def test_directory_reads_its_data_files_in_name_order(tok, tmp_path):
    write(tmp_path / "d" / "b.csv", RECORDS[1:])
    write(tmp_path / "d" / "sub" / "c.parquet", RECORDS[:1])
    write(tmp_path / "d" / "a.jsonl", RECORDS[:1])
    (tmp_path / "d" / "notes.txt").write_text("not data")
    got = load_examples(tmp_path / "d", tok, 128)
    singles = [load_examples(write(tmp_path / f"{i}.jsonl", [r]), tok, 128)[0] for i, r in enumerate(RECORDS)]
    assert got == [singles[0], singles[1], singles[2], singles[0]]  # a.jsonl, b.csv, sub/c.parquet


def test_column_mapping(tok, tmp_path):
    renamed = [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in RECORDS]
    path = write(tmp_path / "r.csv", renamed)
    mapped = load_examples(path, tok, 128, columns={"instruction": "q", "input": "ctx", "output": "a"})
    assert mapped == load_examples(write(tmp_path / "a.jsonl", RECORDS), tok, 128)
    with pytest.raises(QShardError, match=rf"{re.escape(str(path))}:2: .*missing field 'output'"):
        load_examples(path, tok, 128, fmt="instruction", columns={"instruction": "q"})


# --------------------------------------------------------------------------------------------------- formats

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "a b"},
    {"role": "assistant", "content": "b a"},
    {"role": "user", "content": "x y z"},
    {"role": "assistant", "content": "z y x"},
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def test_sharegpt_equals_the_same_chat(tok, tmp_path):
    chat = load_examples(write(tmp_path / "c.jsonl", [{"messages": CHAT}]), tok, 128)
    conversations = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in CHAT]
    share = load_examples(write(tmp_path / "s.jsonl", [{"conversations": conversations}]), tok, 128)
    assert share == chat
    [ex] = chat
    assert trained_text(tok, ex) == "b a</s>z y x</s>"  # both assistant turns, nothing else
    bad = write(tmp_path / "bad.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}])
    with pytest.raises(QShardError, match=rf"{re.escape(str(bad))}:1: .*unknown role 'bot'"):
        load_examples(bad, tok, 128)


def test_plain_text_trains_every_token(tok, tmp_path):
    [ex] = load_examples(write(tmp_path / "t.jsonl", [{"text": "q w e r t y"}]), tok, 128)
    assert tok.decode(ex.input_ids) == "<s>q w e r t y</s>"
    assert ex.labels == ex.input_ids


def test_train_on_all_trains_the_prompt_too(tok, tmp_path):
    path = write(tmp_path / "c.jsonl", [{"messages": CHAT}])
    [masked] = load_examples(path, tok, 128)
    [everything] = load_examples(path, tok, 128, train_on="all")
    assert everything.input_ids == masked.input_ids and everything.labels == everything.input_ids
    with pytest.raises(QShardError, match="data.train_on"):
        load_examples(path, tok, 128, train_on="prompt")


def test_named_builtin_chat_templates(tok, tmp_path):
    path = write(tmp_path / "c.jsonl", [{"messages": CHAT[:3]}])
    [ex] = load_examples(path, tok, 128, chat_template="chatml")
    assert tok.decode(ex.input_ids) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na b<|im_end|>\n"
        "<|im_start|>assistant\nb a<|im_end|>\n</s>"
    )
    assert trained_text(tok, ex) == "b a<|im_end|>\n</s>"
    [alpaca] = load_examples(path, tok, 128, chat_template="alpaca")  # chosen over the tokenizer's own
    assert tok.decode(alpaca.input_ids).startswith("<s>Be brief.\n\n### Instruction:\na b")
    plain = build_demo_tokenizer()
    plain.chat_template = None
    assert load_examples(path, plain, 128) == [alpaca]  # auto: alpaca when the tokenizer has none
    with pytest.raises(QShardError, match="tokenizer has no chat template"):
        load_examples(path, plain, 128, chat_template="tokenizer")


# ----------------------------------------------------------------------------------------------- bad records

MIXED = [RECORDS[0], "{broken", RECORDS[1], {"instruction": "no output"}, RECORDS[2]]


def test_bad_records_are_fatal_by_default_and_skipped_with_a_count(tok, tmp_path, caplog):
    path = write(tmp_path / "m.jsonl", MIXED)
    with pytest.raises(QShardError, match=rf"^{re.escape(str(path))}:2: invalid JSON"):
        load_examples(path, tok, 128)
    with caplog.at_level(logging.WARNING, logger="qshard"):
        got = load_examples(path, tok, 128, on_bad_record="skip")
    assert got == load_examples(write(tmp_path / "ok.jsonl", RECORDS), tok, 128)
    assert f"{path}: skipped 2 bad records of 5" in caplog.text
    assert f"{path}:4: missing field 'output'" in caplog.text


def test_bad_first_record_is_skipped_before_format_detection(tok, tmp_path):
    path = write(tmp_path / "m.jsonl", ["[1]", {"what": 1}, *RECORDS])
    assert len(load_examples(path, tok, 128, on_bad_record="skip")) == 3


@pytest.mark.parametrize(
    "name, content, where",
    [
        ("a.csv", "instruction,output\ni,o\ni,o,extra\n", ":3: more fields than the header"),
        ("a.json", json.dumps([RECORDS[0], {"instruction": 5, "output": "o"}]), ":1: record 2: field 'instruction'"),
        ("a.json", '[{"instruction": "i",\n "output": }]', ":2: invalid JSON"),
        ("a.json", json.dumps({"instruction": "i"}), ": a .json data file must hold an array"),
    ],
)
def test_bad_input_in_other_file_types_names_the_place(tok, tmp_path, name, content, where):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(QShardError, match=re.escape(f"{path}{where}")):
        load_examples(path, tok, 128)


def test_bad_parquet_row_is_named(tok, tmp_path):
    path = write(tmp_path / "p.parquet", [RECORDS[0], {"instruction": "i", "input": None, "output": None}])
    with pytest.raises(QShardError, match=re.escape(f"{path}:row 2: field 'output' must be a string, got null")):
        load_examples(path, tok, 128)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(QShardError, match="not a readable Parquet file"):
        load_examples(tmp_path / "junk.parquet", tok, 128)


# ------------------------------------------------------------------------------------------------ over-long


def test_overlong_truncated_or_dropped_and_counted(tok, tmp_path, caplog):
    long = {"instruction": "Repeat.", "input": "a b", "output": " ".join(["a b"] * 30)}
    path = write(tmp_path / "l.jsonl", [RECORDS[0], long, RECORDS[2]])
    full = load_examples(path, tok, 1000)
    limit = max(len(full[0].input_ids), len(full[2].input_ids))
    assert len(full[1].input_ids) > limit
    with caplog.at_level(logging.INFO, logger="qshard"):
        cut = load_examples(path, tok, limit)
    assert [len(e.input_ids) for e in cut] == [len(full[0].input_ids), limit, len(full[2].input_ids)]
    assert cut[1].input_ids == full[1].input_ids[:limit]
    assert f"{path}: truncated 1 of 3 examples to max_length={limit}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qshard"):
        dropped = load_examples(path, tok, limit, overlong="drop")
    assert dropped == [full[0], full[2]]
    assert f"{path}: dropped 1 of 3 examples longer than max_length={limit}" in caplog.text


def test_nothing_left_after_filtering_is_a_clear_error(tok, tmp_path):
    path = write(tmp_path / "l.jsonl", ["{bad", RECORDS[0]])
    with pytest.raises(
        QShardError,
        match=rf"{re.escape(str(path))}: no usable examples: of 2 records, 1 are bad, "
        r"1 are longer than max_length=4",
    ):
        load_examples(path, tok, 4, overlong="drop", on_bad_record="skip")


# --------------------------------------------------------------------------------------- streaming JSON arrays


def big_json_array(path: Path, n: int, bad_at: int | None = None) -> Path:
    """An array of `n` instruction records, one per line after the opening bracket (record i on line i + 2)."""
    line = json.dumps(
        {"instruction": "Reverse the letters " + "a b c d e " * 8, "input": "x y z " * 5, "output": "z y x " * 10}
    )
    with path.open("w") as f:
        f.write("[\n")
        for i in range(n):
            f.write('{"instruction": "i", "output": }' if i == bad_at else line)
            f.write(",\n" if i < n - 1 else "\n]\n")
    return path


def test_json_array_is_streamed_in_bounded_memory(tmp_path):
    path = big_json_array(tmp_path / "big.json", 40_000)  # 9.5 MB
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_raw(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 40_000
    # Parsed whole, the text alone would take the file's size, and its records several times that.
    assert peak < path.stat().st_size / 4, f"peak {peak / 1e6:.1f} MB for a {path.stat().st_size / 1e6:.1f} MB file"


def test_malformed_record_in_the_middle_of_a_big_array_is_named_by_line(tmp_path):
    path = big_json_array(tmp_path / "bad.json", 20_000, bad_at=12_345)
    with pytest.raises(
        QShardError, match=rf"^{re.escape(str(path))}:12347: invalid JSON: Expecting value \(column 32\)$"
    ):
        for _ in read_raw(path):
            pass


@pytest.mark.parametrize("layout", ["pretty", "one line", "wrapped", "byte order mark"])
def test_json_stream_matches_a_whole_parse_wherever_the_chunks_end(tmp_path, layout):
    records = [
        {"instruction": f"é{i}" * (i % 13), "input": "", "output": ["x", {"y": i}], "n": -1.5e3} for i in range(40)
    ]
    text = {
        "pretty": json.dumps(records, indent=2),
        "one line": json.dumps(records),
        "wrapped": json.dumps({"meta": {"data": 1}, "data": records, "more": [1, 2]}, indent=1),
        "byte order mark": "\ufeff" + json.dumps(records),
    }[layout]
    path = tmp_path / "a.json"
    path.write_text(text, encoding="utf-8")
    for chunk in (1, 2, 7, 100, 1 << 18):
        assert [r for _, r in read_json(path, chunk)] == records, chunk
    wheres = [w for w, _ in read_json(path, 5)]
    assert wheres[0].startswith(f"{path}:") and wheres[-1].endswith(": record 40")
    if layout == "pretty":  # each record's line is where its opening brace is
        assert wheres[1] == f"{path}:{text.splitlines().index('  {', 2) + 1}: record 2"


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2,]", ":1: invalid JSON: Expecting value (column 7)"),
        ('[{"a": 1}\n {"b": 2}]', ":2: invalid JSON: Expecting ',' delimiter (column 2)"),
        ('[{"a": 1}] [2]', ":1: invalid JSON: Extra data after the top-level value (column 12)"),
        ('[{"a": "no end}]', ":1: invalid JSON: Unterminated string starting at (column 8)"),
        ('{"data": 5}', ': the "data" field must be an array of records, got a number'),
        ("[]", ": the data file has no records"),
    ],
)
def test_json_structure_errors_are_named(tmp_path, content, problem):
    path = tmp_path / "a.json"
    path.write_text(content)
    with pytest.raises(QShardError, match=re.escape(f"{path}{problem}")):
        list(read_raw(path))


def test_tokenizing_progress_is_logged_where_there_is_no_terminal(caplog):
    progress = Progress(Path("data/train.jsonl"), every_s=0.0)  # pytest's stderr is no terminal
    with caplog.at_level(logging.INFO, logger="qshard"):
        progress.update(512)
        progress.update(512)
    progress.close()
    assert "tokenizing train.jsonl: 1024 records so far" in caplog.text
