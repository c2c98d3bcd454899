"""benchmarks/unsloth_anchor.py: a failing Unsloth run becomes its row with the error's line, the children run
offline, the longest-context probe stops where it should, and speed.py shows a failed row in its table."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import speed
import unsloth_anchor as anchor

# Stands in for an Unsloth that refuses the machine: the child's import fails as Unsloth's own does without a GPU,
# naming the environment the child ran in.
REFUSING_UNSLOTH = '''import os
raise NotImplementedError("Unsloth cannot find any torch accelerator? You need a GPU.\\n"
                          + " ".join(f"{k}={os.environ.get(k)}" for k in sorted(os.environ) if "OFFLINE" in k
                                     or k.startswith("UNSLOTH_")))
'''


def test_a_refusing_unsloth_is_its_row_with_the_error_line(tmp_path, monkeypatch):
    stub = tmp_path / "stub" / "unsloth"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(REFUSING_UNSLOTH)
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    monkeypatch.chdir(tmp_path)  # relative paths, while the child runs in the output directory
    out = tmp_path / "out"
    out.mkdir()
    row = anchor.run_child(Path("out"), Path("ckpt"), 2048, steps=3, warmup=1, data="d.jsonl", timeout_s=60, tag="t")
    assert f"--model {tmp_path / 'ckpt'} " in row["command"] and row["command"].endswith(f"--data {tmp_path}/d.jsonl")
    assert row["status"] == "failed" and row["stage"] == "import" and row["seq"] == 2048
    assert row["error"] == "NotImplementedError: Unsloth cannot find any torch accelerator? You need a GPU."
    detail = row["error_detail"]  # the child ran offline, with its compile cache under the output directory
    for key in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "UNSLOTH_DISABLE_STATISTICS=1",
                "UNSLOTH_DISABLE_CPU_FALLBACK=1", f"UNSLOTH_COMPILE_LOCATION={out / 'unsloth_compiled_cache'}"):
        assert key in detail, (key, detail)
    log = (out / "unsloth-t.log").read_text()
    assert "Traceback" in log and anchor.ROW_MARK in log and row["log"] == "unsloth-t.log"
    assert "--child" in row["command"] and "--steps 3 --warmup 1" in row["command"]


def test_rows_from_children_that_crash_hang_or_print_around_their_row():
    banner = "Unsloth: Will patch your computer.\n{not the row}\n"
    row = {"system": "unsloth", "seq": 4096, "status": "ok", "tokens_per_s": 1.5}
    assert anchor.row_from_process(4096, 0, banner + anchor.ROW_MARK + json.dumps(row) + "\nbye\n", [], 3.0) == \
        {**row, "wall_s": 3.0}
    log = ["Loading...", "torch.OutOfMemoryError: CUDA out of memory.", ""]
    timeout = anchor.row_from_process(8192, None, banner, log, 60.0)
    assert timeout["status"] == "timeout" and timeout["error"] == \
        "no result after 60 s: torch.OutOfMemoryError: CUDA out of memory."
    killed = anchor.row_from_process(8192, -9, "", ["x"], 5.0)
    assert killed["status"] == "killed" and killed["error"].startswith("killed by signal 9")
    assert anchor.row_from_process(8192, 1, "", [], 1.0)["error"] == "exit 1"


def test_the_longest_probe_doubles_until_a_length_fails_or_the_budget_ends():
    assert anchor.longest_schedule(16384, 131072) == [16384, 32768, 65536, 131072]
    tried = []

    def run(seq, left):
        tried.append(seq)
        return {"seq": seq, "phase": "longest", "status": "ok" if seq < 65536 else "oom"}

    args = Namespace(longest_start=16384, longest_max=524288, longest_budget_s=100.0, longest_min_s=1.0)
    rows = anchor.probe_longest(args, run)
    assert tried == [16384, 32768, 65536] and anchor.longest_ok(rows) == 32768
    tried.clear()
    assert anchor.probe_longest(Namespace(**{**vars(args), "longest_min_s": 101.0}), run) == [] and not tried


def test_dry_run_report_and_argument_errors(tmp_path, capsys):
    result = anchor.main(["--out", str(tmp_path), "--dry-run", "--longest"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["longest_ok_seq"] == result["longest_ok_seq"] == 32768
    assert [r["status"] for r in saved["rows"]] == ["ok", "ok", "ok", "oom"]
    assert saved["extrapolated_longest_seq"] == 32768 + (80 - 22) * 16384 // 8  # 8 GiB more per 16k tokens
    shown = capsys.readouterr().out
    assert "| seq-2k | 2,048 | ok | 0.500 | 4,096 | 9.00 |" in shown
    assert "| longest | 65,536 | oom | - | - | - |" in shown and "CUDA out of memory" in shown
    assert "longest sequence Unsloth trained: 32768 (under 80 GiB; " in shown
    for argv, message in ((["--steps", "3", "--warmup", "3"], "--warmup 3 leaves no timed step of --steps 3"),
                          (["--longest-warmup", "1"], "--longest-warmup 1 leaves no timed step of --longest-steps 1"),
                          (["--ckpt", str(tmp_path / "absent")], "no config.json")):
        with pytest.raises(SystemExit) as exc:
            anchor.main(["--out", str(tmp_path), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_speed_table_shows_a_failed_unsloth_row(tmp_path, capsys):
    rows = [{"system": "transformers+peft+bnb", "median_step_s": 0.5, "tokens_per_s": 4096.0,
             "peak_alloc_gib": 11.5, "step_times_s": [1.0, 0.5]},
            {"system": "unsloth", "status": "failed", "error": "ImportError: no unsloth"}]
    args = Namespace(out=tmp_path, shape="llama-tiny", ckpt=None, seq=2048, batch=1, steps=2, warmup=1)
    speed.report_results(rows, args)
    table = capsys.readouterr().out
    assert "| unsloth | failed: ImportError: no unsloth | - |" in table
    assert "| transformers+peft+bnb | 0.500 | 4,096 |" in table
    saved = json.loads((tmp_path / "results.json").read_text())["results"]
    assert saved[1]["mfu"] is None and saved[1]["vs_reference"] is None and saved[0]["vs_reference"] == 1.0


def test_batches_from_data_and_random_ids(tiny_models, tmp_path):
    """The child's batches on the CPU: speed.py's examples tokenized as hf_reference.py does, the mask dropped only
    where a batch has no padding, the real tokens counted; random ids of the full length without --data."""
    model = tiny_models("llama")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": "Go.", "input": "", "output": text}) + "\n"
                            for text in (" ".join("ab" * 40), "a b", " ".join("cd" * 40))))
    args = Namespace(data=str(data), seq=32, batch=1)
    full = anchor.batches(args, str(model), 512, 1, device="cpu")
    assert list(full[0]) == ["input_ids", "labels", "tokens"] and full[0]["tokens"] == 32
    assert full[0]["input_ids"].shape == (1, 32)
    padded = anchor.batches(Namespace(**{**vars(args), "batch": 2}), str(model), 512, 1, device="cpu")[0]
    assert padded["input_ids"].shape == (2, 32) and padded["tokens"] == int(padded["attention_mask"].sum()) < 64
    with pytest.raises(SystemExit, match="3 examples, 4 needed"):
        anchor.batches(Namespace(**{**vars(args), "batch": 2}), str(model), 512, 2, device="cpu")
    noise = anchor.batches(Namespace(data=None, seq=48, batch=1), str(model), 512, 2, device="cpu")
    assert [b["tokens"] for b in noise] == [48, 48] and "attention_mask" not in noise[0]
    assert bool((noise[0]["labels"] == noise[0]["input_ids"]).all()) and int(noise[0]["input_ids"].max()) < 512
