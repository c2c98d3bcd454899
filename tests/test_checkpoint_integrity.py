"""Checkpoints as untrusted files: `.metadata` is read as data (a crafted pickle runs nothing), every file
DCP wrote is checksummed at save time and verified before loading, `--resume auto` says which step
directories it passes over, and a damaged checkpoint is one `qshard: error:` line, without torch's logs.

One short run (an async save at step 2, the blocking final save at step 4) is shared: each test damages a
copy of it, and goes through `qshard.cli.main` in this process."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import pickle
import re
import shutil
import zlib
from importlib import resources
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from qshard import checkpoint_files as files
from qshard.checkpoint import STATE_FILE
from qshard.cli import main as cli_main

DEMO = resources.files("qshard") / "demo_data"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d qshard: ")


def _train(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(model_dir), "--data", str(DEMO / "train.jsonl"), "--data.eval_fraction", "0",
            "--output-dir", str(out), "--max-length", "48", "--batch-size", "2", "--lr", "1e-2",
            "--train.precision", "fp32", "--max-steps", "4", "--save-every", "2", *extra]


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model_dir) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "run"
    assert cli_main(_train(model_dir, out)) == 0
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli_main(argv)
    return code, capsys.readouterr().err.splitlines()


def _error_line(code: int, lines: list[str]) -> str:
    """The one `qshard: error:` line, all other stderr lines being our own progress log."""
    errors = [x for x in lines if x.startswith("qshard: error:")]
    others = [x for x in lines if not x.startswith("qshard: error:") and not LOG_LINE.match(x)]
    assert code == 2 and len(errors) == 1 and not others, "\n".join(lines)
    return errors[0]


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _crcs(data: bytes, piece: int = files.PIECE_BYTES) -> list[str]:
    """The CRC-32 of each `piece` bytes of `data`, computed here as a reader of the format would."""
    return [f"{zlib.crc32(data[i:i + piece]):08x}" for i in range(0, max(len(data), 1), piece)]


def test_checksums_are_per_piece_and_name_the_damaged_bytes(tmp_path, monkeypatch):
    """Large files are checksummed piece by piece on several threads: the record is the same as one
    computed piece by piece in order, and a damaged byte is reported with the piece that holds it."""
    monkeypatch.setattr(files, "PIECE_BYTES", 1000)
    data = bytes(range(256)) * 13  # 3,328 bytes: three whole pieces and a short last one
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    record = files.file_record(path)
    assert record == {"bytes": 3328, "crc32": _crcs(data, 1000)} and len(record["crc32"]) == 4
    assert files.recorded_files({"files": {".metadata": files.bytes_record(b""), path.name: record}}, path)
    assert files.bytes_record(data) == record and files.first_mismatch(tmp_path, {path.name: record}) is None
    damaged = bytearray(data)
    damaged[1500] ^= 1
    path.write_bytes(bytes(damaged))
    assert files.first_mismatch(tmp_path, {path.name: record}).startswith(
        f"{path}: checksum mismatch in bytes [1,000, 2,000) (crc32 ")


def _set_record(ckpt: Path, name: str) -> None:
    """Record `name`'s current size and checksum in the checkpoint's state, as whoever altered it could."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    data = (ckpt / name).read_bytes()
    state.setdefault("files", {})[name] = {"bytes": len(data), "crc32": _crcs(data)}
    (ckpt / STATE_FILE).write_text(json.dumps(state))


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_crafted_metadata_runs_nothing_on_resume_or_export(saved, model_dir, tmp_path, capsys):
    run = _copy(saved, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-00000004"
    marker = tmp_path / "marker"
    crafted = Metadata(state_dict_metadata={}, planner_data=_RunsCode(marker))
    (ckpt / ".metadata").write_bytes(pickle.dumps(crafted))
    _set_record(ckpt, ".metadata")  # so that only the way it is read stands in its way

    code, lines = _cli(_train(model_dir, tmp_path / "other", "--resume", str(ckpt)), capsys)
    assert not marker.exists()
    line = _error_line(code, lines)
    assert f"{ckpt / '.metadata'}: refused" in line and "builtins.exec" in line

    code, lines = _cli(["export", "adapter", "--run", str(run), "--out", str(tmp_path / "adapter")], capsys)
    assert not marker.exists()
    assert "builtins.exec" in _error_line(code, lines) and not (tmp_path / "adapter").exists()


def test_crafted_shard_entry_runs_nothing_on_resume(saved, model_dir, tmp_path, capsys):
    """The optimizer's settings are pickled objects inside a shard, which DCP unpickles unrestricted."""
    ckpt = _copy(saved / "checkpoints" / "step-00000004", tmp_path / "ckpt")
    marker = tmp_path / "marker"
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.startswith("optim.param_groups."))
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(_RunsCode(marker), blob)
    shard = ckpt / info.relative_path
    with shard.open("ab") as f:  # appended, and the entry pointed at it
        offset = f.tell()
        f.write(blob.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _set_record(ckpt, ".metadata")
    _set_record(ckpt, info.relative_path)

    code, lines = _cli(_train(model_dir, tmp_path / "other", "--resume", str(ckpt)), capsys)
    assert not marker.exists()
    line = _error_line(code, lines)
    assert f"{shard}: refused: its entry {index.fqn}" in line and "exec" in line


def test_flipped_byte_is_refused_naming_the_file(saved, model_dir, tmp_path, capsys):
    run = _copy(saved, tmp_path / "run")
    shard = run / "checkpoints" / "step-00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    metrics = (run / "metrics.jsonl").read_bytes()

    # The newest checkpoint is damaged: an error, not a silent fall-back to step 2.
    code, lines = _cli(_train(model_dir, run, "--resume", "auto", "--max-steps", "6"), capsys)
    assert f"{shard}: checksum mismatch" in _error_line(code, lines)
    assert (run / "metrics.jsonl").read_bytes() == metrics

    code, lines = _cli(["export", "adapter", "--run", str(run), "--out", str(tmp_path / "adapter")], capsys)
    assert f"{shard}: checksum mismatch" in _error_line(code, lines)


def test_auto_resume_says_what_it_skips(saved, model_dir, tmp_path, capsys):
    run = _copy(saved, tmp_path / "run")
    checkpoints = run / "checkpoints"
    (checkpoints / "step-00000004" / STATE_FILE).unlink()
    (checkpoints / "step-00000006.tmp").mkdir()  # a save killed before its end

    code, lines = _cli(_train(model_dir, run, "--resume", "auto"), capsys)
    assert code == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert f"skipping {checkpoints / 'step-00000004'}: no {STATE_FILE}" in text
    assert f"skipping {checkpoints / 'step-00000006.tmp'}: a save that did not finish" in text
    assert f"resumed from {checkpoints / 'step-00000002'} at step 2" in text  # verified, and loaded
    assert _losses(run) == _losses(saved)
    for ckpt in (checkpoints / "step-00000002", checkpoints / "step-00000004"):  # saved async, then blocking
        state = json.loads((ckpt / STATE_FILE).read_text())
        on_disk = {p.name for p in ckpt.iterdir()} - {STATE_FILE, "config.yaml"}
        assert set(state["files"]) == on_disk and ".metadata" in on_disk
        for name, record in state["files"].items():
            assert record == {"bytes": (ckpt / name).stat().st_size, "crc32": _crcs((ckpt / name).read_bytes())}

    (checkpoints / "step-00000008").mkdir()  # export passes over it too, and says so
    code, lines = _cli(["export", "adapter", "--run", str(run), "--out", str(tmp_path / "adapter")], capsys)
    assert code == 0 and f"skipping {checkpoints / 'step-00000008'}: no {STATE_FILE}" in "\n".join(lines)

    for ckpt in checkpoints.glob("step-*[0-9]"):
        (ckpt / STATE_FILE).unlink(missing_ok=True)
    (run / "summary.json").unlink()  # a finished run with no checkpoint left is refused (tests/test_run_dir.py)
    code, lines = _cli(_train(model_dir, run, "--resume", "auto", "--max-steps", "1"), capsys)
    assert code == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert f"no complete checkpoint under {checkpoints}, so training starts again from step 0" in text
    assert "resumed from" not in text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "truncated, saved by an older qshard"])
def test_corrupt_metadata_is_one_line_without_torch_logs(saved, model_dir, tmp_path, capsys, caplog, damage):
    """In this process, torch's log records reach pytest's handler instead of stderr: they are looked for
    there (run as a command, DCP's warnings and tracebacks of a failed metadata read went to stderr)."""
    ckpt = _copy(saved / "checkpoints" / "step-00000004", tmp_path / "ckpt")
    if "older qshard" in damage:  # no recorded checksums: the metadata read itself must fail cleanly
        state = json.loads((ckpt / STATE_FILE).read_text())
        state.pop("files", None)
        (ckpt / STATE_FILE).write_text(json.dumps(state))
    metadata = ckpt / ".metadata"
    data = metadata.read_bytes()
    garbage = (bytes(range(256)) * (len(data) // 256 + 1))[: len(data)]  # the saved size, other bytes
    metadata.write_bytes(garbage if damage == "garbage" else data[: len(data) // 3])

    caplog.set_level(logging.DEBUG)
    code, lines = _cli(_train(model_dir, tmp_path / "other", "--resume", str(ckpt)), capsys)
    torch_records = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name != "qshard"]
    assert not torch_records, [r.getMessage() for r in torch_records]
    assert str(metadata) in _error_line(code, lines)


def test_dcp_logs_nothing_while_qshard_loads(saved, tmp_path, caplog, dist_env):
    """What qshard wraps around DCP's load: DCP's own report of a failure (here, a metadata file given to
    its plain reader) is dropped, and the failure is still raised."""
    import torch.distributed.checkpoint as dcp

    from qshard.checkpoint import _quiet_dcp

    ckpt = _copy(saved / "checkpoints" / "step-00000004", tmp_path / "ckpt")
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:100])
    caplog.set_level(logging.DEBUG)
    with _quiet_dcp(), pytest.raises(BaseException, match="metadata"):
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(ckpt)))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert logging.getLogger("torch.distributed.checkpoint").isEnabledFor(logging.WARNING)  # only while it loads
    assert logging.getLogger().filters == []
