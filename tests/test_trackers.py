"""output.trackers: what TensorBoard, W&B (offline) and MLflow (local store) received, read back with each
tool's own reader, across a resume; a missing extra or an unknown tracker is one error line; a tracker that
fails mid-run warns once and the run, and metrics.jsonl, go on. Tiny runs through `qshard.cli.main` in this
process."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from qshard import cli
from qshard.train import trackers
from qshard.train.metrics import MetricsLog

STEPS = 4
RECORD = {"instruction": "add 2 and 3", "output": "5"}


@pytest.fixture(autouse=True)
def tracker_env(monkeypatch):
    """W&B offline and quiet, MLflow in its local store under the run: nothing reaches a network."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_PROJECT", "qshard-test")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for name, count in (("train.jsonl", 16), ("eval.jsonl", 2)):
        (root / name).write_text((json.dumps(RECORD) + "\n") * count)
    return root


def train(capsys, model: Path, data: Path, out: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["train", "--model", str(model), "--data", str(data / "train.jsonl"),
                     "--data.eval_path", str(data / "eval.jsonl"), "--output-dir", str(out),
                     "--max-steps", str(STEPS), "--batch-size", "2", "--train.eval_every", "2", *extra])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ readers


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: W&B's header, then LevelDB-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", path
    pos, payload = 7, b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", raw[pos + 4:pos + 7])
        payload += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run directory's id, name, project, config and logged rows, oldest first."""
    runs = []
    for path in sorted((run_dir / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"rows": [], "config": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project)
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                run["rows"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in record.history.item})
        runs.append(run)
    return runs


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run_dir / "trackers" / "mlruns").resolve().as_uri())


# ------------------------------------------------------------------------------------------------- tests


def test_three_trackers_receive_the_run_and_its_resume(tiny_models, data, tmp_path, capsys):
    """One run with all three trackers; its last checkpoint removed, `--resume auto` redoes the last steps:
    the same W&B and MLflow runs continue, TensorBoard keeps one point per step."""
    model, out = tiny_models("llama", num_hidden_layers=1), tmp_path / "run"
    args = ("--report-to", "tensorboard,wandb,mlflow", "--save-every", "2")
    code, stderr = train(capsys, model, data, out, *args)
    assert code == 0, stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    ids = json.loads((out / "trackers" / "runs.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}

    scalars = tensorboard_scalars(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
        assert scalars[key] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key
    assert [s for s, _ in scalars["eval_loss"]] == [2, 4] and [s for s, _ in scalars["eval_ppl"]] == [2, 4]

    (first,) = wandb_runs(out)
    assert first["id"] == ids["wandb"] and first["name"] == "run" and first["project"] == "qshard-test"
    assert first["config"]["lora"]["rank"] > 0 and first["config"]["output_dir"] == str(out)
    logged = [row for row in first["rows"] if "loss" in row]
    assert [(row["step"], row["loss"]) for row in logged] == [(r["step"], r["loss"]) for r in records]
    assert [row["eval_loss"] for row in logged if "eval_loss" in row] == [records[1]["eval_loss"],
                                                                          records[3]["eval_loss"]]

    client = mlflow_client(out)
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == str(STEPS) and run.data.params["output_dir"] == str(out)
    assert run.data.tags["qshard.output_dir"] == str(out.resolve())
    history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "loss"))
    assert history == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "eval_ppl")] == [2, 4]

    shutil.rmtree(out / "checkpoints" / "step-00000004")
    code, stderr = train(capsys, model, data, out, *args, "--resume", "auto")
    assert code == 0, stderr
    assert json.loads((out / "trackers" / "runs.json").read_text()) == ids
    redone = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in redone] == [1, 2, 3, 4] and redone[:2] == records[:2]

    scalars = tensorboard_scalars(out)  # the first run's steps 3 and 4 purged: each step once, the new values
    assert scalars["loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in redone]

    first_again, second = wandb_runs(out)
    assert first_again == first and second["id"] == ids["wandb"]
    assert [row["step"] for row in second["rows"] if "loss" in row] == [3, 4]

    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
    steps = [m.step for m in client.get_metric_history(ids["mlflow"], "loss")]
    assert sorted(steps) == [1, 2, 3, 3, 4, 4]  # MLflow keeps every point: the redone steps' too

    # (Not MLflow's local store again in this process: MLflow caches a store by its URI, here moved aside.)
    code, stderr = train(capsys, model, data, out, "--report-to", "wandb", "--overwrite")
    assert code == 0, stderr
    (previous,) = out.glob(".previous-*")  # the old trackers' files moved aside whole; a new W&B run
    assert json.loads((previous / "trackers" / "runs.json").read_text()) == ids
    new_ids = json.loads((out / "trackers" / "runs.json").read_text())
    assert set(new_ids) == {"wandb"} and new_ids["wandb"] != ids["wandb"]
    assert [run["id"] for run in wandb_runs(out)] == [new_ids["wandb"]]


def test_samples_reach_each_tracker_as_a_table(tmp_path):
    """MetricsLog.samples: a W&B table, an MLflow JSON artifact, TensorBoard text, at the step given."""
    rows = [{"prompt": "add 2 and 3", "completion": "5 | five", "step": 2}, {"prompt": "hi", "completion": "",
                                                                            "step": 2}]
    started = trackers.open_trackers(["tensorboard", "wandb", "mlflow"], {"train": {"max_steps": 2}}, tmp_path, 0)
    assert [t.name for t in started] == ["tensorboard", "wandb", "mlflow"]
    metrics = MetricsLog(tmp_path / "metrics.jsonl", tmp_path / "samples.jsonl", started)
    metrics.write({"step": 2, "loss": 1.0})
    metrics.samples(2, rows)
    metrics.close()
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == \
        [{"step": 2, **row} for row in rows]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "trackers" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2 and "| add 2 and 3 | 5 \\| five |" in text.tensor_proto.string_val[0].decode()

    (run,) = wandb_runs(tmp_path)
    (logged,) = [row for row in run["rows"] if "samples/_type" in row]
    assert logged["step"] == 2 and logged["samples/_type"] == "table-file" and logged["samples/nrows"] == 2
    (table_file,) = (tmp_path / "trackers" / "wandb").glob("offline-run-*/files/" + logged["samples/path"])
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "completion"] and table["data"][0] == [2, "add 2 and 3", "5 | five"]

    ids = json.loads((tmp_path / "trackers" / "runs.json").read_text())
    client = mlflow_client(tmp_path)
    saved = client.download_artifacts(ids["mlflow"], "samples/step_00000002.json", str(tmp_path / "down"))
    assert json.loads(Path(saved).read_text()) == rows


def test_a_tracker_failing_mid_run_warns_once(tiny_models, data, tmp_path, capsys, monkeypatch):
    def lost(self, record):
        if record["step"] >= 2:
            raise ConnectionError("server gone")

    monkeypatch.setattr(trackers.MLflow, "log_step", lost)
    out = tmp_path / "run"
    code, stderr = train(capsys, tiny_models("llama", num_hidden_layers=1), data, out, "--report-to", "[mlflow]")
    assert code == 0, stderr
    assert stderr.count("mlflow failed") == 1 and "server gone" in stderr and "training goes on" in stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and json.loads((out / "summary.json").read_text())["steps"] == STEPS


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_extra_is_one_error_naming_it(name, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, trackers.MODULES[name], None)  # what `import` meets when it is not installed
    code = cli.main(["train", "--output-dir", str(tmp_path / "run"), "--report-to", f"tensorboard,{name}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"qshard: error: output.trackers: {name} is not installed: pip install "
                                 f"'qshard[{name}]'"]
    assert not (tmp_path / "run").exists()


def test_an_unknown_tracker_is_a_config_error(tmp_path, capsys):
    code = cli.main(["train", "--output-dir", str(tmp_path / "run"), "--output.trackers", "[wandb, comet]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "output.trackers must be one of tensorboard, wandb, mlflow" in err[0]
    assert "'comet'" in err[0] and not (tmp_path / "run").exists()


def test_two_ranks_write_one_tensorboard_run(tiny_models, data, tmp_path):
    """Under two processes only rank 0 writes the tracker, with every step's loss as metrics.jsonl has it."""
    from conftest import run_on_ranks

    out = tmp_path / "two"
    argv = ["train", "--model", str(tiny_models("llama", num_hidden_layers=1)), "--data", str(data / "train.jsonl"),
            "--output-dir", str(out), "--max-steps", str(STEPS), "--batch-size", "2", "--data.eval_fraction", "0",
            "--report-to", "tensorboard"]
    ranks = run_on_ranks({"two": argv})["two"]
    assert [r.code for r in ranks] == [0, 0], (ranks[0].stderr[-2000:], ranks[1].stderr[-2000:])
    events = list((out / "trackers" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one writer: rank 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [value for _, value in sorted(tensorboard_scalars(out)["loss"])]
    assert logged == pytest.approx(losses, rel=1e-6) and len(logged) == STEPS
