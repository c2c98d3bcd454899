"""What qshard writes where the user points (`export --out`, a run's adapter/, `make-checkpoint --out`,
`expand --output`) never overwrites or deletes what qshard did not write there, and never leaves a
half-written directory under the final name. Three tiny one-layer runs, made once in this process through
`qshard.cli.main`, serve every test."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qshard import cli, export
from qshard.config import LoRAConfig
from qshard.demo import write_tiny_model
from qshard.outputs import MARKER

DEMO = resources.files("qshard") / "demo_data"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d qshard: ")


def qshard(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_one_error(code: int, stderr: str, *needles: str) -> None:
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("qshard: error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def hidden_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run `a` (two steps, a checkpoint after each), run `other_base` (another base model) and run
    `other_lr` (the same base, another learning rate); the models are this module's own, so that a test
    of a refusal can never damage another module's."""
    root = tmp_path_factory.mktemp("export-safety")
    data = root / "data.jsonl"
    data.write_text("".join((DEMO / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    model = write_tiny_model(root / "models" / "model", num_hidden_layers=1)
    other_model = write_tiny_model(root / "models" / "other", seed=1, num_hidden_layers=1)
    common = ["--data", data, "--eval-data", data, "--max-length", "32", "--batch-size", "2",
              "--checkpoint.async_save", "false"]
    made = {}
    for name, model_dir, extra in (
        ("a", model, ["--max-steps", "2", "--save-every", "1"]),
        ("other_base", other_model, ["--max-steps", "1"]),
        ("other_lr", model, ["--max-steps", "1", "--lr", "1e-3"]),
    ):
        out = root / name
        assert cli.main(["train", "--model", str(model_dir), "--output-dir", str(out), *map(str, common + extra)]) == 0
        made[name] = out
    made["model"] = model
    return made


def test_user_files_in_out_survive_and_the_export_is_refused(runs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    code, err = qshard(capsys, "export", "adapter", "--run", runs["a"], "--out", out)
    assert_one_error(code, err, f"--out {out}", "notes.txt", "qshard did not write")
    assert snapshot(out) == {"notes.txt": b"keep"}

    # A file the user added later to a previous export is not the export's to delete either.
    done = tmp_path / "done"
    assert qshard(capsys, "export", "adapter", "--run", runs["a"], "--out", done)[0] == 0
    (done / "README.md").write_text("my notes on this adapter")
    before = snapshot(done)
    code, err = qshard(capsys, "export", "adapter", "--run", runs["a"], "--out", done)
    assert_one_error(code, err, "README.md", "did not write")
    assert snapshot(done) == before


def test_out_must_not_be_the_run_or_inside_it(runs, capsys):
    run = runs["a"]
    before = snapshot(run)
    for out, relation in ((run, "is the run directory"), (run / "checkpoints", "is inside the run directory"),
                          (run.parent, "contains the run directory")):
        code, err = qshard(capsys, "export", "merged", "--run", run, "--out", out)
        assert_one_error(code, err, f"--out {out}: {relation}")
    assert snapshot(run) == before


def test_out_must_not_be_the_base_model_or_around_it(runs, tmp_path, capsys):
    model = runs["model"]
    before = snapshot(model)
    for out, relation in ((model, "is"), (model / "sub", "is inside"), (model.parent, "contains")):
        code, err = qshard(capsys, "export", "merged", "--run", runs["a"], "--out", out)
        assert_one_error(code, err, f"--out {out}: {relation} the base model directory")
    assert snapshot(model) == before


def test_a_sibling_tmp_directory_of_the_user_survives(runs, tmp_path, capsys):
    theirs = tmp_path / "adapter.tmp"
    theirs.mkdir()
    (theirs / "draft.txt").write_text("keep")
    out = tmp_path / "adapter"
    assert qshard(capsys, "export", "adapter", "--run", runs["a"], "--out", out)[0] == 0
    assert snapshot(theirs) == {"draft.txt": b"keep"}
    marker = json.loads((out / MARKER).read_text())
    assert marker == {"kind": "adapter", "files": ["adapter_config.json", "adapter_model.safetensors",
                                                   "chat_template.jinja", "generation_config.json", "tokenizer.json",
                                                   "tokenizer_config.json"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "adapter.tmp"]


def test_reexport_replaces_its_own_kind_only(runs, tmp_path, capsys):
    run = runs["a"]
    # The adapter `qshard train` wrote is an export like any other: exporting again replaces it.
    assert json.loads((run / "adapter" / MARKER).read_text())["kind"] == "adapter"
    trained = load_file(run / "adapter" / "adapter_model.safetensors")
    assert qshard(capsys, "export", "adapter", "--run", run)[0] == 0
    again = load_file(run / "adapter" / "adapter_model.safetensors")
    assert again.keys() == trained.keys() and all(torch.equal(again[k], trained[k]) for k in again)
    # So does one from the run's own older checkpoint (a checkpoint of another run may not: below).
    older = run / "checkpoints" / "step-00000001"
    assert qshard(capsys, "export", "adapter", "--run", run, "--checkpoint", older)[0] == 0
    assert qshard(capsys, "export", "adapter", "--run", run)[0] == 0  # back to the newest
    assert not hidden_leftovers(run)

    out = tmp_path / "export"
    assert qshard(capsys, "export", "merged", "--run", run, "--out", out)[0] == 0
    first = snapshot(out)
    assert json.loads(first[MARKER])["kind"] == "merged" and "config.json" in first
    assert qshard(capsys, "export", "merged", "--run", run, "--out", out)[0] == 0
    assert snapshot(out) == first and not hidden_leftovers(tmp_path)
    code, err = qshard(capsys, "export", "adapter", "--run", run, "--out", out)
    assert_one_error(code, err, "holds a qshard merged export", "adapter")
    assert snapshot(out) == first


@pytest.mark.parametrize("other,why", [("other_base", "another base model"), ("other_lr", "optim.lr=0.001")])
def test_another_runs_checkpoint_does_not_replace_the_runs_adapter(runs, other, why, tmp_path, capsys):
    run = runs["a"]
    foreign = runs[other] / "checkpoints" / "step-00000001"
    before = snapshot(run)
    for kind in ("adapter", "merged"):
        code, err = qshard(capsys, "export", kind, "--run", run, "--checkpoint", foreign)
        assert_one_error(code, err, f"--checkpoint {foreign}", why, "give --out a new directory")
    assert snapshot(run) == before
    # Written to a place of its own, it is that run's adapter.
    out = tmp_path / "theirs"
    assert qshard(capsys, "export", "adapter", "--run", run, "--checkpoint", foreign, "--out", out)[0] == 0
    ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(runs[other] / "adapter"
                                                                           / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_failed_write_leaves_the_previous_export_and_nothing_else(runs, tmp_path):
    out = tmp_path / "adapter"
    tensors = load_file(runs["a"] / "adapter" / "adapter_model.safetensors")
    export.write_peft_adapter(out, tensors, LoRAConfig(), ["q_proj"], "base")
    before = snapshot(out)
    shared = torch.zeros(4)
    with pytest.raises(RuntimeError):  # safetensors refuses tensors that share memory
        export.write_peft_adapter(out, {"x": shared, "y": shared}, LoRAConfig(), ["q_proj"], "base")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_make_checkpoint_refuses_a_non_empty_out(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    args = ["make-checkpoint", "--shape", "llama-tiny", "--layers", "1"]
    code, err = qshard(capsys, *args, "--out", out)
    assert_one_error(code, err, f"--out {out}: already exists and is not an empty directory")
    assert snapshot(out) == {"config.json": b"{}"}
    fresh = tmp_path / "fresh"
    assert qshard(capsys, *args, "--out", fresh)[0] == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(snapshot(fresh))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "fresh"]


def test_an_expansion_of_an_export_is_no_export(runs, tmp_path, capsys):
    """`expand` copies a model directory's descriptive files, but never an export's marker: the expanded
    model would otherwise pass for a merged export that the next `export merged --out` may replace."""
    merged, expanded = tmp_path / "merged", tmp_path / "expanded"
    assert qshard(capsys, "export", "merged", "--run", runs["a"], "--out", merged)[0] == 0
    assert qshard(capsys, "expand", "--model", merged, "--output", expanded, "--new-blocks", "1")[0] == 0
    assert not (expanded / MARKER).exists()
    before = snapshot(expanded)
    code, err = qshard(capsys, "export", "merged", "--run", runs["a"], "--out", expanded)
    assert_one_error(code, err, "qshard did not write")
    code, err = qshard(capsys, "expand", "--model", merged, "--output", expanded, "--new-blocks", "1")
    assert_one_error(code, err, "already exists and is not an empty directory")
    assert snapshot(expanded) == before
