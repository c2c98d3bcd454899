"""The tokenized-data cache: entries appear only complete, a job killed while building leaves nothing that
looks complete, least recently used entries are evicted beyond the size cap, and an entry in use is never
evicted."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env

from qshard.config import Config
from qshard.data import load_datasets
from qshard.data.cache import ABANDONED_AFTER_S, LOCK, TokenCache
from qshard.data.store import META, StoreWriter
from qshard.demo_tokenizer import build_demo_tokenizer

TOKENS = 1000  # per entry: 8 kB of ids and labels


def write_tokens(directory: Path, n: int = TOKENS) -> None:
    writer = StoreWriter(directory)
    writer.add(np.arange(n), np.arange(n))
    writer.close({"stats": {}})


def age(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


def test_least_recently_used_entries_go_first_and_entries_in_use_never(tmp_path):
    cache = TokenCache(tmp_path, max_bytes=None)
    for key in "abcd":
        cache.build(key, write_tokens)  # the returned store is dropped: not in use
    in_use = cache.open("d")  # this job (or any other) still reads d
    for key, seconds in zip("dbac", (400, 300, 200, 100)):  # last use: d oldest, then b, a, c
        age(tmp_path / key / LOCK, seconds)
    size = sum(e.size for e in cache.entries()) // 4
    cache.max_bytes = 2 * size + size // 2  # room for two entries
    assert cache.evict() == [tmp_path / "b", tmp_path / "a"]  # d is older, but in use
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]
    assert in_use.ids[5] == 5  # still readable
    assert cache.open("b") is None
    del in_use
    gc.collect()
    cache.max_bytes = size
    assert cache.evict() == [tmp_path / "d"]


def test_opening_an_entry_marks_it_used(tmp_path):
    cache = TokenCache(tmp_path, max_bytes=None)
    for key in "ab":
        cache.build(key, write_tokens)
        age(tmp_path / key / LOCK, 100)
    assert cache.open("a") is not None
    cache.max_bytes = sum(e.size for e in cache.entries()) // 2
    assert cache.evict() == [tmp_path / "b"]


def test_interrupted_build_leaves_nothing_and_a_killed_one_nothing_that_looks_complete(tmp_path):
    cache = TokenCache(tmp_path, max_bytes=10**9)

    def interrupted(directory: Path) -> None:
        write_tokens(directory)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.build("k", interrupted)
    assert list(tmp_path.iterdir()) == []
    # A process killed outright (SIGKILL) halfway through writing the tokens.
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from qshard.data.cache import TokenCache\n"
        "def write(directory):\n"
        "    (directory / 'input_ids.bin').write_bytes(b'\\0' * 4000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "TokenCache(Path(sys.argv[1]), None).build('k', write)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=cli_env(), capture_output=True)
    assert proc.returncode == -9, proc.stderr
    [left] = list(tmp_path.iterdir())
    assert left.name.startswith("k.tmp-") and not (left / META).exists()
    assert cache.open("k") is None  # a later job tokenizes again
    assert cache.entries() == [] and left.exists()  # too recent to call abandoned: maybe still being built
    age(left, ABANDONED_AFTER_S + 1)
    assert cache.entries() == [] and not left.exists()  # its builder's lock is gone: removed


def test_a_build_in_progress_is_not_removed(tmp_path):
    cache = TokenCache(tmp_path, max_bytes=0)

    def slow(directory: Path) -> None:
        age(directory, ABANDONED_AFTER_S + 1)  # as if it had been building for long
        assert cache.entries() == [] and directory.exists()  # locked by this builder
        write_tokens(directory)

    cache.build("k", slow)
    assert cache.open("k") is not None


def test_a_run_keeps_the_cache_under_its_cap_and_never_evicts_its_own_data(tmp_path, caplog):
    tok = build_demo_tokenizer()
    records = [{"instruction": f"Reverse {i}.", "input": "a b c", "output": "c b a"} for i in range(40)]

    def run(name: str, cap_gb: float):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = Config()
        cfg.data.path, cfg.data.cache_dir, cfg.data.cache_max_gb = str(path), str(tmp_path / "cache"), cap_gb
        return load_datasets(cfg.validate(), tok)

    first = run("first", 1.0)
    entry = sum(e.size for e in TokenCache(tmp_path / "cache", None).entries())
    del first
    gc.collect()
    caplog.clear()  # an earlier test may have left the qshard logger at INFO: only warnings count here
    with caplog.at_level(logging.WARNING, logger="qshard"):
        second = run("second", entry * 1.5 / 1e9)  # room for one entry: the first run's goes
        assert len(TokenCache(tmp_path / "cache", None).entries()) == 1
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        run("third", entry * 0.5 / 1e9)  # room for none: the second run's is in use, and so is the third's
    assert len(TokenCache(tmp_path / "cache", None).entries()) == 2
    assert "over its cap" in caplog.text and "held by running jobs" in caplog.text
    assert len(second[0]) == 38
