"""Sharded training checkpoints with torch.distributed.checkpoint (DCP).

What is saved: the trainable parameters (LoRA adapters, or every weight in full fine-tuning) and their
optimizer state, as DCP shards written by every rank; plus `trainer_state.json` (step, schedule, the
base model's fingerprint, eval loss at the start) and the resolved `config.yaml`. The frozen base is
not saved: it is rebuilt from the base checkpoint, whose fingerprint is checked on resume. Random
state needs no saving: dropout is reseeded from (seed, step, rank) at every step.

Atomicity: a checkpoint is written into `step-NNNNNNNN.tmp/` and renamed to `step-NNNNNNNN/` by rank 0
only after every rank's shards and the metadata are on disk, so a process killed mid-save (even by
SIGKILL) leaves the previous checkpoints as they were, and `find_latest` never returns a partial one.

Integrity: every file DCP writes is checksummed by the rank that wrote it, on the thread that wrote it,
and `trainer_state.json` records the sizes and checksums; a checkpoint is verified before it is loaded,
and its `.metadata` is read as data (see `checkpoint_files`), never handed to DCP's pickle load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import logger as dcp_logger
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from qshard import checkpoint_files as files
from qshard import config as config_mod
from qshard.build import files_from_rank0
from qshard.config import Config
from qshard.errors import QShardError
from qshard.loading import Checkpoint
from qshard.loading.hub import hub_model
from qshard.parallel.distributed import DistEnv, from_rank0
from qshard.train.optim import implementation

log = logging.getLogger("qshard")

STATE_FILE = "trainer_state.json"
_SAMPLE = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Options a checkpoint's tensors depend on: resuming with other values cannot load it (LoRA+ sets the optimizer's
# groups; PiSSA/OLoRA the base the adapters were trained on).
SHAPE_KEYS = ("train.train_type", "lora.rank", "lora.target_modules", "quant.method", "quant.bits",
              "quant.blocksize", "quant.double_quant", "model.block_class", "lora.plus_lr_ratio", "lora.init",
              "lora.modules_to_save", "data.add_special_tokens")
# With PiSSA/OLoRA the base keeps W - scaling B0 A0, so the scaling is part of the base the adapters trained on.
FROM_BASE_KEYS = ("lora.alpha", "lora.use_rslora")
# Of those, the ones whose `auto` takes the checkpoint's value, each with the value it had in an older qshard's
# checkpoint that did not save it: a run resumes as it was trained, whatever auto chooses now (double_quant was
# off before its auto).
SAVED_AUTO_KEYS = {"quant.double_quant": False}

_SD_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def base_model_name(cfg: Config) -> str:
    """The base named in adapter_config.json and checkpoints: the Hub id (its commit is recorded beside it), the
    model directory, or the random shape."""
    if cfg.model.path is None:
        return f"qshard random {cfg.model.shape} (seed {cfg.train.seed})"
    hub = hub_model(cfg.model.path, cfg.model.revision)
    return hub.repo_id if hub is not None else str(Path(cfg.model.path).resolve())


def base_fingerprint(cfg: Config, model_dir: str | Path | None = None) -> str:
    """What identifies the frozen base, for checkpoints: its files (in `model_dir`, by default model.path), or
    for a named shape without a directory, the shape and the seed its random weights come from."""
    if cfg.model.path is None:
        return hashlib.sha256(f"shape {cfg.model.shape} seed {cfg.train.seed}".encode()).hexdigest()[:16]
    return _files_fingerprint(model_dir or cfg.model.path)


def base_fingerprint_all_ranks(cfg: Config, env: DistEnv, model_dir: str | Path | None = None) -> str:
    """`base_fingerprint` on every rank of a run: under broadcast loading only rank 0 can read the files."""
    if files_from_rank0(cfg, env):
        return from_rank0(lambda: base_fingerprint(cfg, model_dir), env.is_main)
    return base_fingerprint(cfg, model_dir)


def _files_fingerprint(model_dir: str | Path) -> str:
    """Identity of a base checkpoint: its config.json, every tensor's name, dtype and shape (from the file
    headers, which `Checkpoint` validates), and the first and last MiB of each weight file, so that a
    fine-tune of the same architecture differs too. Reads a few MiB, whatever the model's size."""
    model_dir = Path(model_dir)
    ckpt = Checkpoint(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    tensors = sorted((n, str(ckpt.dtype(n)), ckpt.shape(n), ckpt.files[n].name) for n in ckpt.names())
    digest.update(json.dumps(tensors).encode())
    for path in sorted(set(ckpt.files.values())):
        size = path.stat().st_size
        with path.open("rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    ckpt.close()
    return digest.hexdigest()[:16]


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Trainable parameters (and their optimizer state). Frozen parameters are left out by the options;
    buffers, such as NF4 storage kept as sharded DTensor buffers, are dropped here by name."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if optimizer is None:  # exporting: the weights alone
        model_sd = get_model_state_dict(model, options=_SD_OPTIONS)
        return {"model": {k: v for k, v in model_sd.items() if k in trainable}}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_SD_OPTIONS)
    return {"model": {k: v for k, v in model_sd.items() if k in trainable}, "optim": optim_sd}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under `root`, oldest first (a `.tmp` directory is never one)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, saying which step directories are passed over and why."""
    for path, why in _incomplete_checkpoints(root):
        log.warning("skipping %s: %s", path, why)
    done = complete_checkpoints(root)
    return done[-1] if done else None


def _incomplete_checkpoints(root: Path) -> list[tuple[Path, str]]:
    """Step directories under `root` that are not complete checkpoints, each with the reason."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.name.endswith(".tmp") and _STEP_DIR.match(path.name[: -len(".tmp")]):
            found.append((path, "a save that did not finish"))
        elif _STEP_DIR.match(path.name) and not (path / STATE_FILE).is_file():
            found.append((path, f"no {STATE_FILE} (a save that did not finish, or a damaged checkpoint)"))
    return found


class _ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that also checksums each file it writes, right after writing it: on the background
    thread for an async save, while the bytes are still in the page cache. The coordinator (rank 0) also
    writes `.metadata`, in `finish`."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.dir = path
        self.records: dict[str, dict] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        for name in sorted({result.storage_data.relative_path for result in future.wait()}):
            self.records[name] = files.file_record(self.dir / name)
        return future

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        self.records[files.METADATA_FILE] = files.file_record(self.dir / files.METADATA_FILE)


@dataclass
class _Pending:
    future: object
    writer: _ChecksummingWriter
    final: Path
    meta: dict
    started: float = 0.0  # when save() was called
    blocked: float = 0.0  # seconds the training loop waited in save()

    @property
    def tmp(self) -> Path:
        return self.writer.dir


class CheckpointManager:
    """Saves every rank's shards, in the background when `async_save`; finalizes (renames) when every
    rank's write is done, then keeps only the newest `keep_last` checkpoints, and the one of step `keep_step`
    (checkpoint.keep_best's)."""

    def __init__(self, root: Path, cfg: Config, is_main: bool, device: torch.device) -> None:
        self.root, self.cfg, self.is_main, self.device = root, cfg, is_main, device
        self.keep_last = cfg.checkpoint.keep_last
        self.pending: _Pending | None = None
        self.keep_step: int | None = None
        # Background writes run collectives from another thread: they get a group of their own, so they
        # never interleave with the training step's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             blocking: bool = False) -> None:
        self.wait()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        state = _app_state(model, optimizer)
        writer = _ChecksummingWriter(tmp)
        try:
            if self.group is not None and not blocking:
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                self.pending = _Pending(future, writer, final, meta, started, time.perf_counter() - started)
                return
            dcp.save(state, storage_writer=writer)
        except (OSError, CheckpointException) as exc:
            raise _save_failed(tmp, exc) from None
        self._finalize(_Pending(None, writer, final, meta, started, time.perf_counter() - started))

    def poll(self) -> None:
        """Finalize a background save once every rank's part of it is written (called every step)."""
        if self.pending is None:
            return
        # On the default group, from this (the main) thread: the save's own group belongs to its thread.
        done = torch.tensor([int(self.pending.future.done())], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except (OSError, CheckpointException) as exc:
            raise _save_failed(pending.tmp, exc) from None
        self._finalize(pending)

    def _finalize(self, pending: _Pending) -> None:
        # Every rank's files are written once every rank has sent its checksums: this is also the barrier.
        parts: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, pending.writer.records)
        if self.is_main:
            recorded = {name: record for part in parts for name, record in part.items()}
            try:
                state = {**pending.meta, "files": dict(sorted(recorded.items()))}
                (pending.tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
                config_mod.save(self.cfg, pending.tmp / "config.yaml")
                if pending.final.exists():  # the same step saved again (e.g. a resumed run's last step)
                    shutil.rmtree(pending.final)
                pending.tmp.rename(pending.final)
            except OSError as exc:
                raise _save_failed(pending.tmp, exc) from None
            self._prune()
            log.info("checkpoint saved: %s (%.2f s after the save began; training waited %.2f s)",
                     pending.final, time.perf_counter() - pending.started, pending.blocked)
        dist.barrier()

    def _prune(self) -> None:
        """Remove every checkpoint but the newest `keep_last` and the best one (`keep_step`)."""
        kept = step_dir(self.root, self.keep_step) if self.keep_step is not None else None
        for old in complete_checkpoints(self.root)[: -self.keep_last]:
            if old != kept:
                shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> dict:
    """A checkpoint's trainer state, once its metadata has been read safely and its files are all there with
    their saved sizes (their contents are checked by `load`)."""
    state = _state(path)
    _checked_metadata(path, state)
    return state


def _state(path: Path) -> dict:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise QShardError(f"{path}: not a complete qshard checkpoint (no {STATE_FILE})")
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as exc:
        raise QShardError(f"{state_file}:{exc.lineno}: corrupt checkpoint state ({exc.msg})") from None
    if not isinstance(state, dict):
        raise QShardError(f"{state_file}: corrupt checkpoint state (not a JSON object)")
    return state


def _checked_metadata(path: Path, state: dict) -> Metadata:
    """The checkpoint's DCP metadata, read as data; with recorded checksums, also that it and every file it
    names were recorded at save time and are there with their saved sizes."""
    recorded = files.recorded_files(state, path / STATE_FILE)
    metadata = files.read_metadata(path / files.METADATA_FILE, recorded and recorded[files.METADATA_FILE])
    if recorded is not None:
        unrecorded = sorted(files.data_files(metadata, path / files.METADATA_FILE) - recorded.keys())
        if unrecorded:
            raise QShardError(f"{path / unrecorded[0]}: not among the files {STATE_FILE} recorded at save time "
                              "(a foreign or altered checkpoint)")
        files.check_sizes(path, recorded)
    return metadata


def follow_saved_autos(cfg: Config, state: dict) -> None:
    """Options left to `auto` (SAVED_AUTO_KEYS) set to the values the checkpoint of `state` was trained with."""
    saved = state.get("config", {})
    for key, before in SAVED_AUTO_KEYS.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == "auto":
            setattr(getattr(cfg, section), name, saved.get(section, {}).get(name, before))


def check_compatible(path: Path, state: dict, cfg: Config, fingerprint: str) -> None:
    """Refuse a checkpoint of another base model, or one whose tensors the current options cannot hold."""
    if state.get("base_fingerprint") != fingerprint:
        commit = f" at commit {state['base_commit']}" if state.get("base_commit") else ""
        raise QShardError(
            f"{path}: this checkpoint was trained from another base model ({state.get('base_model')}{commit}), "
            f"not {cfg.model.path}"
        )
    saved = state.get("config", {})
    current, defaults = cfg.to_dict(), Config().to_dict()
    for key in SHAPE_KEYS + (FROM_BASE_KEYS if cfg.lora.init != "default" else ()):
        section, name = key.split(".")
        # A key that an older qshard did not save had its default value then.
        old = saved.get(section, {}).get(name, SAVED_AUTO_KEYS.get(key, defaults[section][name]))
        new = current[section][name]
        if key in SAVED_AUTO_KEYS and "auto" in (old, new):  # one follows the other (follow_saved_autos)
            continue
        if old != new:
            raise QShardError(f"{path}: saved with {key}={old!r}, but this run has {key}={new!r}")


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load trainable weights (and the optimizer state, if given) into the (sharded) model, resharding to
    this world size as needed, once every file of the checkpoint matches its checksum."""
    state = _state(path)
    metadata = _checked_metadata(path, state)
    _verify_contents(path, files.recorded_files(state, path / STATE_FILE))
    app_state = _app_state(model, optimizer)
    try:
        with _quiet_dcp():
            dcp.load(app_state, storage_reader=_CheckedReader(path, metadata),
                     planner=files.DataOnlyPlanner(path, metadata))
    except (Exception, CheckpointException) as exc:  # DCP's wrapper of per-rank failures is a BaseException
        if isinstance(_inner(exc), QShardError):
            raise _inner(exc) from None
        raise QShardError(f"{path}: cannot load checkpoint ({_reason(exc)})") from None
    # Not strict: the frozen base is deliberately absent from the checkpoint (rebuilt from the base model).
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        set_model_state_dict(model, app_state["model"], options=options)
    else:
        # The checkpoint's hyperparameters (lr, betas, ...) are kept, its implementation is not: this run's is set
        # in the groups before they are loaded, since torch places each state's step by its group's flags.
        chosen = implementation(optimizer)
        for group, flags in zip(app_state["optim"]["param_groups"], chosen):
            group.update(flags)
        set_state_dict(model, optimizer, model_state_dict=app_state["model"], optim_state_dict=app_state["optim"],
                       options=options)
        assert implementation(optimizer) == chosen


def _verify_contents(path: Path, recorded: dict[str, dict] | None) -> None:
    """Every data file against its checksum, the files shared out over the ranks; all ranks raise the first
    mismatch any of them found. (`.metadata` was checked when it was read.)"""
    rank, world = _rank_and_world()
    if recorded is None:
        if rank == 0:
            log.warning("%s: saved by an older qshard, without checksums: loading it unverified", path)
        return
    names = sorted(set(recorded) - {files.METADATA_FILE})[rank::world]
    problem = files.first_mismatch(path, {name: recorded[name] for name in names})
    if world > 1:
        problems: list[str | None] = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise QShardError(problem)


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class _CheckedReader(FileSystemReader):
    """DCP's file reader, given the metadata qshard read and checked, so that DCP never unpickles the file."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata


_DCP_DIR = os.path.dirname(dcp.__file__) + os.sep


@contextlib.contextmanager
def _quiet_dcp():
    """DCP logs the failures it then raises (on the root logger, with tracebacks, on its modules' loggers, and on
    its own event logger, which some torch releases let propagate); while it loads, those records are dropped:
    the failure becomes our one-line error."""
    root = logging.getLogger()
    muted = [logging.getLogger("torch.distributed.checkpoint"), getattr(dcp_logger, "_dcp_logger", None)]
    levels = [(logger, logger.level) for logger in muted if logger is not None]
    root.addFilter(_not_from_dcp)
    for logger, _ in levels:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        root.removeFilter(_not_from_dcp)
        for logger, level in levels:
            logger.setLevel(level)


def _not_from_dcp(record: logging.LogRecord) -> bool:
    return not record.pathname.startswith(_DCP_DIR)


def _save_failed(tmp: Path, exc: BaseException) -> QShardError:
    return QShardError(
        f"saving checkpoint {tmp} failed ({_reason(exc)}){_low_space(tmp)}; earlier checkpoints are untouched"
    )


def _low_space(path: Path) -> str:
    """A full disk does not always say so: torch's writer reports a short write as a position mismatch."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return ""
    free = shutil.disk_usage(existing).free
    return f" -- the disk holding it has only {free / 2**20:,.0f} MiB free" if free < 2**30 else ""


def _inner(exc: BaseException) -> BaseException:
    """The first failed rank's exception inside DCP's CheckpointException (else `exc` itself)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        # Per torch version: an object with .exception, or an (exception, traceback frames) pair.
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        return getattr(inner, "exception", inner)
    return exc


def _reason(exc: BaseException) -> str:
    """One line: DCP's CheckpointException carries each failed rank's exception and traceback as text."""
    exc = _inner(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def resolve_resume(cfg: Config, out: Path) -> Path | None:
    """`checkpoint.resume`: none, `auto` (the newest complete one under the output dir, if any), or a path."""
    choice = cfg.checkpoint.resume
    if choice in (None, "none"):
        return None
    root = out / "checkpoints"
    if choice == "auto":
        return _latest_for_auto(root, out / "metrics.jsonl")
    path = Path(choice)
    if not path.is_dir():
        raise QShardError(f"checkpoint.resume: {path} is not a directory")
    read_state(path)
    return path


def _latest_for_auto(root: Path, metrics: Path) -> Path | None:
    """The newest complete checkpoint; when there is none but an earlier run's metrics are there, says so."""
    latest = find_latest(root)
    if latest is None and metrics.is_file() and metrics.stat().st_size:
        log.warning("--resume auto: no complete checkpoint under %s, so training starts again from step 0 "
                    "(and %s starts over)", root, metrics)
    return latest
