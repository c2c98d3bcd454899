"""Input that would exhaust memory or crash the data pipeline: records over data.max_record_mb, JSON nested
deeper than the parser can recurse, and damaged entries of the tokenized-data cache."""

from __future__ import annotations

import csv
import gc
import json
import logging
import re
import tracemalloc
from pathlib import Path

import pytest

from qshard.config import Config
from qshard.data import load_datasets, load_examples
from qshard.data.records import BadRecord, read_json, read_raw
from qshard.data.store import IDS, META, OFFSETS
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError

LIMIT = 1_000_000  # bytes, for the tests' records
OK = {"instruction": "Reverse a b c.", "output": "c b a"}
CHAT = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
DEEP = "[" * 100_000 + "]" * 100_000  # far deeper than Python's recursion limit


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def big(size: int) -> str:
    """A JSONL line of an instruction record of exactly `size` bytes."""
    head = json.dumps({"instruction": "x", "output": ""})[:-2]  # {"instruction": "x", "output": "
    return head + "y" * (size - len(head) - 2) + '"}'


def bad_records(records) -> list[tuple[str, str]]:
    return [(where, str(raw)) for where, raw in records if isinstance(raw, BadRecord)]


# ---------------------------------------------------------------------------------------------- record size


def test_a_record_over_the_limit_stops_the_run_or_is_skipped(tok, tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [OK, big(3 * LIMIT), OK])
    with pytest.raises(
        QShardError,
        match=rf"^{re.escape(str(path))}:2: a record of 3,000,000 bytes, more than data.max_record_mb allows "
        r"\(1,000,000 bytes\)$",
    ):
        load_examples(path, tok, 64, max_record_bytes=LIMIT)
    with caplog.at_level(logging.WARNING, logger="qshard"):
        assert len(load_examples(path, tok, 64, max_record_bytes=LIMIT, on_bad_record="skip")) == 2
    assert f"skipped 1 bad records of 3 (first: {path}:2: a record of 3,000,000 bytes" in caplog.text
    assert not bad_records(read_raw(path, max_record_bytes=None))  # no limit


def test_a_jsonl_line_over_the_limit_is_never_held_whole(tmp_path):
    lines = [big(LIMIT), big(LIMIT + 1), OK, big(10 * LIMIT), OK]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with path.open("a") as f:
        f.write(big(LIMIT + 1))  # the last line, without a line ending
    tracemalloc.start()
    try:
        records = list(read_raw(path, max_record_bytes=LIMIT))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [w for w, _ in records] == [f"{path}:{i}" for i in range(1, 7)]
    assert records[0][1] == (big(LIMIT) + "\n").encode()  # exactly at the limit: kept
    sizes = {w: int(re.search(r"of ([\d,]+) bytes", m)[1].replace(",", "")) for w, m in bad_records(records)}
    assert sizes == {f"{path}:2": LIMIT + 1, f"{path}:4": 10 * LIMIT, f"{path}:6": LIMIT + 1}
    # Held whole, the 10 MB line alone would take more than this (reading a line of the limit takes twice it).
    assert peak < 4 * LIMIT, f"peak {peak / 1e6:.1f} MB"


def test_a_json_array_element_over_the_limit_is_skipped_unparsed(tmp_path):
    # Brackets and escaped quotes inside strings must not end the skipped element early.
    tricky = {"instruction": 'a "quoted" ] } [ { \\ ' * (LIMIT // 2), "output": ["]", {"}": "\\"}]}
    items = [
        json.dumps(OK),
        json.dumps(tricky),  # 13 MB
        json.dumps({"instruction": "é" * (LIMIT // 2 + 1), "output": "2 bytes each"}, ensure_ascii=False),
        json.dumps(OK),
        '{"n": ' + "7" * 5000 + "}",  # more digits than Python turns into an int
        "0." + "5" * (2 * LIMIT),  # a float has no such limit
        json.dumps(OK),
    ]
    path = tmp_path / "d.json"
    path.write_text("[\n" + ",\n".join(items) + "\n]\n", "utf-8")
    for chunk in (1000, 1 << 18):
        tracemalloc.start()
        try:
            read = list(read_json(path, chunk, max_record_bytes=LIMIT))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [r for _, r in read if not isinstance(r, BadRecord)] == [OK, OK, OK]
        bad = bad_records(read)
        assert [w for w, _ in bad] == [f"{path}:{i + 1}: record {i}" for i in (2, 3, 5, 6)]
        sizes = [int(re.search(r"of ([\d,]+) bytes", m)[1].replace(",", "")) for _, m in bad[:2] + bad[3:]]
        assert sizes == [len(items[i].encode()) for i in (1, 2, 5)]
        assert "invalid JSON: Exceeds the limit (4300 digits) for integer string conversion" in bad[2][1]
        assert peak < 5 * LIMIT, f"peak {peak / 1e6:.1f} MB at chunk {chunk}"


def test_a_number_cut_by_the_end_of_a_chunk_is_read_whole(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[12345, 1.5e10 ,-7, {"a": 1}]')
    for chunk in (1, 2, 3, 5):
        assert [r for _, r in read_json(path, chunk)] == [12345, 1.5e10, -7, {"a": 1}], chunk


def test_rows_of_csv_and_parquet_over_the_limit(tmp_path):
    rows = [OK, {"instruction": "x" * 600, "output": "y" * 600}, OK]
    path = tmp_path / "d.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["instruction", "output"])
        writer.writeheader()
        writer.writerows(rows)
    assert bad_records(read_raw(path, max_record_bytes=1000)) == [
        (f"{path}:3", f"{path}:3: a record of 1,200 bytes, more than data.max_record_mb allows (1,000 bytes)")
    ]
    # A field larger than the limit: csv cannot say where its record ends without reading it whole.
    with pytest.raises(QShardError, match=rf"^{re.escape(str(path))}:3: a CSV field of more than 500 characters"):
        list(read_raw(path, max_record_bytes=500))
    # Fields beyond csv's own default limit (131,072 characters) are fine below data.max_record_mb.
    long_row = {"instruction": "x" * 200_000, "output": "y"}
    with path.open("a", newline="") as f:
        csv.DictWriter(f, ["instruction", "output"]).writerow(long_row)
    assert [r for _, r in read_raw(path, max_record_bytes=LIMIT)][-1] == long_row

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert [w for w, _ in bad_records(read_raw(parquet, max_record_bytes=1000))] == [f"{parquet}:row 2"]


# -------------------------------------------------------------------------------------------------- nesting


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_json_nested_too_deeply_is_a_bad_record(tok, tmp_path, kind, caplog):
    deep_chat = '{"messages": [{"role": "user", "content": ' + DEEP + '}, {"role": "assistant", "content": "a"}]}'
    big_int = '{"text": "t", "n": ' + "7" * 5000 + "}"  # more digits than Python turns into an int
    lines = [json.dumps(CHAT), DEEP, deep_chat, big_int, json.dumps(CHAT)]
    path = tmp_path / f"d.{kind}"
    path.write_text("\n".join(lines) + "\n" if kind == "jsonl" else "[" + ",\n".join(lines) + "]\n")
    where = f"{path}:2" if kind == "jsonl" else f"{path}:2: record 2"
    with pytest.raises(QShardError, match=rf"^{re.escape(where)}: JSON nested too deeply to decode$"):
        load_examples(path, tok, 64)
    with caplog.at_level(logging.WARNING, logger="qshard"):
        assert len(load_examples(path, tok, 64, on_bad_record="skip")) == 2
    assert "skipped 3 bad records of 5" in caplog.text and "nested too deeply" in caplog.text
    assert ": invalid JSON: Exceeds the limit (4300 digits)" in caplog.text


# ---------------------------------------------------------------------------------------------------- cache


def truncate_ids(entry: Path) -> None:
    with (entry / IDS).open("r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


DAMAGES = {
    "truncated token array": (truncate_ids, "input_ids.bin has"),
    "garbage meta": (lambda e: (e / META).write_bytes(b"\x00garbage{"), "meta.json unreadable"),
    "garbage offsets": (lambda e: (e / OFFSETS).write_bytes(b"\x93NUMPY nonsense"), "offsets.npy unreadable"),
    "meta missing": (lambda e: (e / META).unlink(), "meta.json unreadable"),
    "lock missing": (lambda e: (e / "lock").unlink(), "no lock file"),
}


def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(tok, tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{**OK, "input": f"n {i}"} for i in range(30)])
    cfg = Config()
    cfg.data.path, cfg.data.cache_dir = str(path), str(tmp_path / "cache")
    cfg.validate()

    def examples() -> list:
        train, held = load_datasets(cfg, tok)
        out = [(e.input_ids, e.labels) for part in (train, held) for e in part]
        del train, held
        gc.collect()  # the stores go, and with them this job's locks on the entry
        return out

    fresh = examples()
    [entry] = (tmp_path / "cache").iterdir()
    for name, (damage, problem) in DAMAGES.items():
        damage(entry)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qshard"):
            assert examples() == fresh, name
        assert f"data cache entry {entry} is damaged ({problem}" in caplog.text, name
        assert "removed; tokenizing anew" in caplog.text, name
        assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name], name
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qshard"):
            assert examples() == fresh, name  # the rebuilt entry is sound
        assert not caplog.text, name


def test_max_record_mb_option(tmp_path):
    cfg = Config()
    cfg.data.max_record_mb = -1
    with pytest.raises(QShardError, match=r"^data.max_record_mb must be >= 0, got -1$"):
        cfg.validate()
    from qshard.data.dataset import sources_of

    for mb, limit in ((0, None), (None, None), (0.5, 500_000), (16.0, 16_000_000)):
        cfg.data.max_record_mb, cfg.data.path = mb, "x.jsonl"
        assert sources_of(cfg.validate().data)[0].options.max_record_bytes == limit
