"""Hugging Face `datasets` sources: save_to_disk directories (Dataset and DatasetDict), .arrow and .parquet
files that `datasets` wrote, hub names (only their offline error: no test downloads anything), and
qshard working without the package."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from conftest import cli_env

from qshard.config import Config, SourceConfig
from qshard.data import load_datasets, load_examples
from qshard.demo_tokenizer import build_demo_tokenizer
from qshard.errors import QShardError

RECORDS = [
    {"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"},
    {"instruction": "Sort the letters.", "input": "", "output": "x y"},
    {"instruction": "Add.", "input": "1 + 2", "output": "3"},
]
CHATS = [
    {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "b a"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
]


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def saved(path: Path, records: list[dict]) -> Path:
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def test_saved_dataset_arrow_and_parquet_give_the_jsonl_examples(tok, tmp_path):
    reference = load_examples(jsonl(tmp_path / "a.jsonl", RECORDS), tok, 128)
    directory = saved(tmp_path / "saved", RECORDS)
    assert load_examples(directory, tok, 128) == reference
    [arrow] = directory.glob("*.arrow")  # a save_to_disk shard, read as a file of its own
    assert load_examples(arrow, tok, 128) == reference
    datasets.Dataset.from_list(RECORDS).to_parquet(str(tmp_path / "a.parquet"))
    assert load_examples(tmp_path / "a.parquet", tok, 128) == reference
    # Nested fields (chat turns) come through as plain Python lists and dicts.
    chats = saved(tmp_path / "chats", CHATS)
    assert load_examples(chats, tok, 128) == load_examples(jsonl(tmp_path / "c.jsonl", CHATS), tok, 128)


def test_saved_dataset_inside_a_directory_counts_once(tok, tmp_path):
    saved(tmp_path / "d" / "b_saved", RECORDS[1:])
    jsonl(tmp_path / "d" / "a.jsonl", RECORDS[:1])
    got = load_examples(tmp_path / "d", tok, 128)  # a.jsonl, then the saved dataset (not its .arrow shard too)
    assert got == load_examples(jsonl(tmp_path / "all.jsonl", RECORDS), tok, 128)


def test_saved_dataset_dict_split(tok, tmp_path):
    train = datasets.Dataset.from_list(RECORDS)
    directory = tmp_path / "dd"
    datasets.DatasetDict({"train": train, "test": train.select([2])}).save_to_disk(str(directory))
    cfg = Config()
    cfg.data.cache_dir, cfg.data.eval_fraction = str(tmp_path / "cache"), 0.0
    cfg.data.sources = [SourceConfig(path=str(directory), split="test")]
    examples, _ = load_datasets(cfg.validate(), tok)
    assert [e.input_ids for e in examples] == [
        load_examples(jsonl(tmp_path / "t.jsonl", RECORDS[2:]), tok, 512)[0].input_ids
    ]
    with pytest.raises(
        QShardError,
        match=re.escape(f"{directory}: the saved DatasetDict holds several splits (it has train, test); choose one"),
    ):
        load_examples(directory, tok, 128)
    cfg.data.sources[0].split = "validation"
    with pytest.raises(QShardError, match="has no split 'validation'"):
        load_datasets(cfg.validate(), tok)


def test_bad_row_of_a_saved_dataset_is_named(tok, tmp_path):
    directory = saved(tmp_path / "s", [RECORDS[0], {"instruction": "no output", "input": "", "output": None}])
    with pytest.raises(QShardError, match=re.escape(f"{directory}:row 2: field 'output' must be a string, got null")):
        load_examples(directory, tok, 128)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(QShardError, match="junk.arrow: not a readable Arrow file"):
        load_examples(tmp_path / "junk.arrow", tok, 128)


def test_without_the_datasets_package_the_error_says_what_to_install(tok, tmp_path, monkeypatch):
    directory = saved(tmp_path / "s", RECORDS)
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets when it is not installed
    with pytest.raises(
        QShardError,
        match=re.escape(
            f"{directory}: reading Hugging Face datasets needs the datasets package: pip install 'qshard[data]'"
        ),
    ):
        load_examples(directory, tok, 128)


@pytest.mark.parametrize(
    "source, problem",
    [
        (
            {"path": "a.jsonl", "hub": "org/name"},
            "data.sources[0]: give a source either a path or a hub dataset name, not both",
        ),
        ({"weight": 2.0}, "data.sources[0]: give a source either a path or a hub dataset name, not neither"),
        ({"path": "a.jsonl", "revision": "main"}, "data.sources[0].revision: only hub datasets have a revision"),
    ],
)
def test_source_options_are_checked_up_front(source, problem):
    cfg = Config()
    cfg.data.sources = [SourceConfig(**source)]
    with pytest.raises(QShardError, match=re.escape(problem)):
        cfg.validate()


def test_hub_dataset_offline_is_one_clear_error_before_any_weight_is_read(tiny_models, tmp_path):
    """The real command, offline: one error line naming the dataset and the option, exit code 2. The model's
    weight file is garbage, so had any weight been read first, the error would be about it. The same
    process shows that importing qshard does not import datasets."""
    model = tmp_path / "model"
    shutil.copytree(tiny_models("llama"), model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"garbage")
    script = (
        "import sys\n"
        "import qshard.cli, qshard.data, qshard.train.run\n"
        "assert 'datasets' not in sys.modules, 'importing qshard imported datasets'\n"
        "sys.exit(qshard.cli.main(sys.argv[1:]))\n"
    )
    env = {**cli_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    source = "[{hub: qshard-tests/no-such-dataset, subset: tiny, split: test, revision: v1}]"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "train",
            "--model",
            str(model),
            "--data.sources",
            source,
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, proc.stderr
    assert errors == [
        "qshard: error: data.sources[0].hub: cannot load hub dataset qshard-tests/no-such-dataset (split test, "
        "subset tiny, revision v1): the Hugging Face Hub is switched off here (HF_HUB_OFFLINE=1) and the dataset "
        "is not in the local Hugging Face cache; download it on a machine with network access, or use a local "
        "copy (save_to_disk) as the source's path"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_split_of_a_plain_file_is_refused(tmp_path):
    from qshard.data.records import read_raw

    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(QShardError, match=r"train.jsonl: split 'test' asked for .* only hub datasets"):
        list(read_raw(path, "test"))
    assert len(list(read_raw(path))) == 1
