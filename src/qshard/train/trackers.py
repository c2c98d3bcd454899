"""Experiment trackers (output.trackers): TensorBoard, Weights & Biases and MLflow receive what metrics.jsonl
gets, step by step, plus the resolved config, the run's name and directory, and the samples.

Each tracker is one small class behind the same four calls (start, log_step, log_samples, close); `open_trackers`
starts the chosen ones on rank 0 and wraps each in a `Guarded`, which turns a failure mid-run into one warning:
training goes on, and metrics.jsonl, written first, stays complete. A resumed run continues the same tracker run
(the W&B and MLflow run ids are kept in RUN/trackers/runs.json).

Imports nothing heavy: the command line checks the extras (`check_installed`) before torch is loaded."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from qshard import rundir
from qshard.errors import QShardError

log = logging.getLogger("qshard")

DIR = "trackers"  # RUN/trackers/: every tracker's local files and runs.json
RUN_IDS = "runs.json"
# The module each tracker needs, and the qshard extra that installs it.
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_installed(names: list[str]) -> None:
    """A QShardError naming the extra to install for the first chosen tracker whose package is missing."""
    for name in names:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise QShardError(f"output.trackers: {name} is not installed: pip install 'qshard[{name}]'")


def open_trackers(names: list[str], config: dict[str, Any], run_dir: Path, start_step: int) -> list[Guarded]:
    """Start the chosen trackers for the run in `run_dir` (resumed after `start_step` when it is not 0); one
    that cannot start is left out with a warning, so a tracker never costs the run."""
    if not names:
        return []
    home = run_dir / DIR
    home.mkdir(parents=True, exist_ok=True)
    ids = _read_ids(home) if start_step else {}
    started = []
    for name in dict.fromkeys(names):  # each once, whatever the list repeats
        tracker = _CLASSES[name]()
        try:
            ids[name] = tracker.start(config, run_dir, ids.get(name), start_step)
        except Exception as exc:
            log.warning("output.trackers: %s could not start (%s: %s); training goes on without it",
                        name, type(exc).__name__, exc)
            continue
        started.append(Guarded(name, tracker))
    _write_ids(home, {name: run_id for name, run_id in ids.items() if run_id is not None})
    return started


def _read_ids(home: Path) -> dict[str, str | None]:
    path = home / RUN_IDS
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        log.warning("%s: not JSON; the trackers start new runs", path)
        return {}


def _write_ids(home: Path, ids: dict[str, str]) -> None:
    path = home / RUN_IDS
    with rundir.writing(path):
        rundir.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(ids, indent=2)))


class Guarded:
    """One tracker whose first failure is a single warning, after which it is left alone for the run."""

    def __init__(self, name: str, tracker: Any) -> None:
        self.name, self.tracker, self.live = name, tracker, True

    def log_step(self, record: dict[str, Any]) -> None:
        self._call("log_step", record)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._call("log_samples", step, rows)

    def close(self) -> None:
        self._call("close")

    def _call(self, what: str, *args: Any) -> None:
        if not self.live:
            return
        try:
            getattr(self.tracker, what)(*args)
        except Exception as exc:  # a tracker (often a remote server) must never stop training
            self.live = False
            log.warning("output.trackers: %s failed at %s (%s: %s); training goes on without it, metrics.jsonl "
                        "stays complete", self.name, what, type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------------- the trackers


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"lora": {"rank": 8}}` as `{"lora.rank": 8}`; lists and None as text (what flat hyperparameters take)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoard:
    """Event files in RUN/trackers/tensorboard: scalars per step, the config as hyperparameters and text,
    the samples as text. A resumed run purges the events past its checkpoint, which it redoes."""

    def start(self, config: dict[str, Any], run_dir: Path, run_id: str | None, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # Hides the events of steps this run (re)does that an earlier attempt in the directory left behind.
        self.writer = SummaryWriter(run_dir / DIR / "tensorboard", purge_step=start_step + 1)
        if not start_step:
            for summary in hparams(flat(config), {"eval_loss": float("nan")}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
        return None

    def log_step(self, record: dict[str, Any]) -> None:
        for key, value in _numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = "| prompt | completion |\n|---|---|\n" + "".join(
            f"| {_cell(row['prompt'])} | {_cell(row['completion'])} |\n" for row in rows)
        self.writer.add_text("samples", table, step)

    def close(self) -> None:
        self.writer.close()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


class WandB:
    """A W&B run configured by W&B's own environment (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline, ...),
    its local files in RUN/trackers/wandb unless WANDB_DIR says otherwise; every metric is plotted against
    qshard's `step`, so the steps a resumed run redoes do not meet W&B's rule that steps only grow."""

    def start(self, config: dict[str, Any], run_dir: Path, run_id: str | None, start_step: int) -> str:
        import wandb

        self.wandb = wandb
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir / DIR)}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "qshard"),
                              name=os.environ.get("WANDB_NAME") or run_dir.name, id=run_id,
                              resume="allow" if run_id else None, config=config, **where)
        if run_id:  # a resumed run may have changed options (e.g. train.max_steps)
            self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log_step(self, record: dict[str, Any]) -> None:
        self.run.log(record)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "completion"],
                                 data=[[step, row["prompt"], row["completion"]] for row in rows])
        self.run.log({"samples": table, "step": step})

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run at MLFLOW_TRACKING_URI, or else in a local file store, RUN/trackers/mlruns; the experiment
    is MLFLOW_EXPERIMENT_NAME or "qshard". The config becomes the run's parameters (a resumed run adds only
    those it did not log before: MLflow keeps a parameter's first value), the samples JSON artifacts."""

    def start(self, config: dict[str, Any], run_dir: Path, run_id: str | None, start_step: int) -> str:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 asks for this opt-in before it writes a local file store; mlflow-skinny has no other.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / DIR / "mlruns").resolve().as_uri()
        self.client = client = MlflowClient(tracking_uri=uri)
        if run_id:
            logged = client.get_run(run_id).data.params
            client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "qshard")
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
            run_id = client.create_run(experiment_id, run_name=run_dir.name,
                                       tags={"qshard.output_dir": str(run_dir.resolve())}).info.run_id
            logged = {}
        self.run_id, self.metric = run_id, Metric
        # MLflow refuses a parameter value over 6,000 characters (a long list of data sources): cut, not refused.
        params = [Param(k, str(v)[:6000]) for k, v in flat(config).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def log_step(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(k, v, now, record["step"]) for k, v in _numbers(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_text(self.run_id, json.dumps(rows, indent=2), f"samples/step_{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
assert _CLASSES.keys() == MODULES.keys()
