"""What a model directory can make qshard do: never run Python shipped with it (`auto_map`), never read
weights from outside it through its index, never accept a safetensors file that safetensors itself refuses,
and never let an impossible lora.rank reach the allocator."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import free_port, spawn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from test_cli_errors import assert_one_error, run_in_process, train_args, write_jsonl

from qshard import build, models
from qshard.config import Config
from qshard.errors import QShardError
from qshard.hf_config import load_hf_config
from qshard.loading import Checkpoint
from qshard.loading.weight_files import SafetensorsFile

RECORD = {"instruction": "add 2 and 3", "output": "5"}
NO_CODE = "qshard does not run model-supplied code"
# Imported, this module would leave a marker file (at a fixed path: transformers imports a copy made
# in its modules cache): the sign that the directory's code ran.
EVIL = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def with_code(model_dir: Path, file: str) -> Path:
    """`model_dir` with a Python module `evil.py` that `file` names in an auto_map, as custom-code models do;
    imported, it writes `MARKER` beside the directory."""
    (model_dir / "evil.py").write_text(EVIL.format(marker=str(model_dir.parent / "MARKER")))
    path = model_dir / file
    raw = json.loads(path.read_text())
    if file == "config.json":
        raw["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}
    else:
        raw["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    path.write_text(json.dumps(raw))
    return model_dir


# ---------------------------------------------------------------------------------------- model-supplied code


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_auto_map_is_refused_before_anything_is_loaded(tiny_models, tmp_path, capsys, file):
    model_dir = with_code(copy_model(tiny_models("llama"), tmp_path / "model"), file)
    data = write_jsonl(tmp_path / "data.jsonl", [json.dumps(RECORD)] * 8)
    code, err = run_in_process(train_args(model_dir, data, tmp_path / "out"), capsys)
    assert code == 2
    assert_one_error(code, err, str(model_dir / file), "'auto_map'", NO_CODE)
    # Each loader refuses on its own too, whoever calls it.
    for load in (load_hf_config, build.load_tokenizer):
        with pytest.raises(QShardError, match=NO_CODE):
            load(model_dir)
    assert not (tmp_path / "MARKER").exists()


def _broadcast_worker(rank: int, world: int, port: int, model_dir: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from test_train import _config

    from qshard.parallel.distributed import init_distributed, shutdown
    from qshard.train.run import train

    cfg = _config(model_dir if rank == 0 else f"{tmp}/only-on-rank-0", f"{tmp}/run", steps=1)
    cfg.model.load_mode = "broadcast"
    cfg.data.cache_dir = f"{tmp}/cache"
    env = init_distributed()
    try:
        train(cfg, env)
        outcome = "trained"
    except QShardError as exc:
        outcome = str(exc)
    finally:
        shutdown()
    Path(tmp, f"rank{rank}.txt").write_text(outcome)


def test_auto_map_is_refused_on_every_rank_under_broadcast_loading(tiny_models, tmp_path):
    """Rank 0 refuses the directory before it ships its files to the others, who report the same line."""
    model_dir = with_code(copy_model(tiny_models("llama"), tmp_path / "model"), "tokenizer_config.json")
    spawn(_broadcast_worker, (2, free_port(), str(model_dir), str(tmp_path)))
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert outcomes[0] == outcomes[1], outcomes
    assert str(model_dir / "tokenizer_config.json") in outcomes[0] and NO_CODE in outcomes[0], outcomes
    assert "\n" not in outcomes[0]
    assert not (tmp_path / "MARKER").exists()


# ------------------------------------------------------------------------------------------ safetensors layout


def _write(path: Path, header: dict, data_bytes: int) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data_bytes))
    return path


def _f32(begin: int, count: int = 2) -> dict:
    return {"dtype": "F32", "shape": [count], "data_offsets": [begin, begin + 4 * count]}


def _safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                f.get_tensor(name)
        return True
    except SafetensorError:
        return False


REFUSED = {
    # name: (header, data bytes, what the message says)
    "overlap": ({"a": _f32(0), "b": _f32(4)}, 12, "overlap those of tensor 'a'"),
    "same-bytes": ({"a": _f32(0), "b": _f32(0)}, 8, "overlap those of tensor 'a'"),
    "gap": ({"a": _f32(0), "b": _f32(12)}, 20, "leaving bytes [8, 12) that no tensor holds"),
    "leading-gap": ({"a": _f32(4)}, 12, "leaving bytes [0, 4) that no tensor holds"),
    "empty-inside-another": ({"a": _f32(0), "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}, 8,
                             "overlap those of tensor 'a'"),
    "trailing-bytes": ({"a": _f32(0)}, 12, "goes on to byte"),
    # Numbers that JSON spells otherwise than as integers.
    "float-offsets": ({"a": {**_f32(0), "data_offsets": [0.0, 8.0]}}, 8, "malformed header entry"),
    "string-shape": ({"a": {**_f32(0), "shape": ["2"]}}, 8, "malformed header entry"),
    "bool-shape": ({"a": {**_f32(0), "shape": [True, 2]}}, 8, "malformed header entry"),
    "number-metadata": ({"__metadata__": {"step": 1}, "a": _f32(0)}, 8, "__metadata__ is not a map of strings"),
}
ACCEPTED = {
    "out-of-order": ({"b": _f32(8), "a": _f32(0)}, 16),
    "empty-at-a-boundary": ({"a": _f32(0), "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
                             "b": _f32(8)}, 16),
    "no-tensors": ({"__metadata__": {"format": "pt"}}, 0),
    "null-metadata": ({"__metadata__": None, "a": _f32(0)}, 8),
}


def test_safetensors_files_are_read_exactly_when_safetensors_reads_them(tmp_path):
    """Tensors' byte ranges, in file order, must tile the data exactly; the rule is safetensors' own."""
    for case, (header, size, reason) in REFUSED.items():
        path = _write(tmp_path / f"{case}.safetensors", header, size)
        assert not _safetensors_accepts(path), case
        with pytest.raises(QShardError) as err:
            SafetensorsFile(path)
        message = str(err.value)
        assert message.startswith(f"{path}: cannot read safetensors file") and reason in message, (case, message)
    for case, (header, size) in ACCEPTED.items():
        path = _write(tmp_path / f"{case}.safetensors", header, size)
        assert _safetensors_accepts(path), case
        assert set(SafetensorsFile(path).tensors) == set(header) - {"__metadata__"}, case
    # safetensors' own writer: header padded to 8 bytes, tensors ordered by alignment, odd byte counts.
    tensors = {"odd": torch.arange(3, dtype=torch.int8), "half": torch.randn(3, 5).half(),
               "wide": torch.randn(7, dtype=torch.float64), "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "real.safetensors", metadata={"format": "pt"})
    file = SafetensorsFile(tmp_path / "real.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(file.read(name), tensor), name


# ------------------------------------------------------------------------------------- index entries outside


def _sharded(model_dir: Path) -> tuple[Path, dict]:
    """`model_dir` with its weights split over two files and an index; returns the index and its map."""
    from safetensors.torch import load_file

    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, half in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        save_file({n: tensors[n] for n in half}, model_dir / f"part{i}.safetensors", metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, f"part{i}.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index, weight_map


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE"])
def test_index_entries_outside_the_model_directory_are_refused(tiny_models, tmp_path, entry):
    """Laid out as in the Hugging Face cache, whose snapshot files are symlinks into its blob store outside the
    snapshot directory: that is read; an index entry that itself leads out of the directory is not."""
    model_dir = copy_model(tiny_models("llama"), tmp_path / "snapshot")
    index, weight_map = _sharded(model_dir)
    (tmp_path / "blobs").mkdir()
    for part in ("part1.safetensors", "part2.safetensors"):
        (model_dir / part).rename(tmp_path / "blobs" / part)
        (model_dir / part).symlink_to(Path("..") / "blobs" / part)
    assert Checkpoint(model_dir).names() == set(weight_map)

    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(tmp_path / "blobs" / "part2.safetensors", outside)  # a real file, but not the directory's
    entry = str(outside) if entry == "ABSOLUTE" else entry
    moved = {n: (entry if f == "part2.safetensors" else f) for n, f in weight_map.items()}
    index.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(QShardError) as err:
        Checkpoint(model_dir)
    message = str(err.value)
    assert message.startswith(f"{index}: entry '") and repr(entry) in message and "\n" not in message, message


# ---------------------------------------------------------------------------------------------- lora.rank


def test_a_huge_lora_rank_is_refused_before_any_allocation(tiny_models, tmp_path, capsys):
    model_dir = tiny_models("llama")
    data = write_jsonl(tmp_path / "data.jsonl", [json.dumps(RECORD)] * 8)
    code, err = run_in_process(train_args(model_dir, data, tmp_path / "out", "--lora-rank", "1000000000"), capsys)
    assert code == 2
    line = assert_one_error(code, err, "lora.rank 1000000000", "min(in_features, out_features)")
    assert "model.layers.0." in line and "in_features 128" in line, line
    # The refusal comes from the skeleton on the meta device: nothing was allocated for it.
    cfg = Config()
    cfg.lora.rank = 1_000_000_000
    model = models.build_skeleton(load_hf_config(model_dir), cfg)
    with pytest.raises(QShardError, match="lora.rank 1000000000 exceeds"):
        models.prepare_modules(model, models.find_blocks(model, None), cfg)


def test_adapters_larger_than_memory_are_refused_in_one_line(tiny_models):
    model_dir = tiny_models("llama")
    cfg = Config()
    cfg.lora.rank = 64
    model = models.build_skeleton(load_hf_config(model_dir), cfg)
    models.prepare_modules(model, models.find_blocks(model, None), cfg)
    trained = models.adapter_bytes(model) * models.TRAINED_COPIES
    models.check_adapter_memory(model, cfg, 2, trained // 2)  # fits when sharded over two ranks
    with pytest.raises(QShardError, match=rf"lora.rank 64: .* take {trained:,} bytes"):
        models.check_adapter_memory(model, cfg, 2, trained // 2 - 1)
    # What the allocator refuses anyway becomes one line naming lora.rank and the bytes it was asked for.
    with pytest.raises(QShardError) as err, models.allocation_errors(model, cfg, torch.device("cpu")):
        torch.empty(1 << 60, dtype=torch.uint8)
    message = str(err.value)
    assert message.startswith("lora.rank 64: cannot allocate") and str(1 << 60) in message, message
    assert "\n" not in message
