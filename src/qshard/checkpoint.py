"""Sharded training checkpoints with torch.distributed.checkpoint (DCP).

What is saved: the trainable parameters (LoRA adapters, or every weight in full fine-tuning) and their
optimizer state, as DCP shards written by every rank; plus `trainer_state.json` (step, schedule, the
base model's fingerprint, eval loss at the start) and the resolved `config.yaml`. The frozen base is
not saved: it is rebuilt from the base checkpoint, whose fingerprint is checked on resume. Random
state needs no saving: dropout is reseeded from (seed, step, rank) at every step.

Atomicity: a checkpoint is written into `step-NNNNNNNN.tmp/` and renamed to `step-NNNNNNNN/` by rank 0
only after every rank's shards and the metadata are on disk, so a process killed mid-save (even by
SIGKILL) leaves the previous checkpoints as they were, and `find_latest` never returns a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from qshard import config as config_mod
from qshard.config import Config
from qshard.errors import QShardError
from qshard.loading import Checkpoint

log = logging.getLogger("qshard")

STATE_FILE = "trainer_state.json"
_SAMPLE = 1 << 20
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Options a checkpoint's tensors depend on: resuming with other values cannot load it.
SHAPE_KEYS = ("train.train_type", "lora.rank", "lora.target_modules", "quant.method", "quant.bits",
              "quant.blocksize", "model.block_class")

_SD_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def base_fingerprint(model_dir: str | Path) -> str:
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
    done = complete_checkpoints(root)
    return done[-1] if done else None


@dataclass
class _Pending:
    future: object
    tmp: Path
    final: Path
    meta: dict
    started: float = 0.0  # when save() was called
    blocked: float = 0.0  # seconds the training loop waited in save()


class CheckpointManager:
    """Saves every rank's shards, in the background when `async_save`; finalizes (renames) when every
    rank's write is done, then keeps only the newest `keep_last` checkpoints."""

    def __init__(self, root: Path, cfg: Config, is_main: bool, device: torch.device) -> None:
        self.root, self.cfg, self.is_main, self.device = root, cfg, is_main, device
        self.keep_last = cfg.checkpoint.keep_last
        self.pending: _Pending | None = None
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
        try:
            if self.group is not None and not blocking:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self.pending = _Pending(future, tmp, final, meta, started, time.perf_counter() - started)
                return
            dcp.save(state, checkpoint_id=str(tmp))
        except (OSError, CheckpointException) as exc:
            raise _save_failed(tmp, exc) from None
        self._finalize(_Pending(None, tmp, final, meta, started, time.perf_counter() - started))

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
        dist.barrier()
        if self.is_main:
            try:
                (pending.tmp / STATE_FILE).write_text(json.dumps(pending.meta, indent=2))
                config_mod.save(self.cfg, pending.tmp / "config.yaml")
                if pending.final.exists():  # the same step saved again (e.g. a resumed run's last step)
                    shutil.rmtree(pending.final)
                pending.tmp.rename(pending.final)
            except OSError as exc:
                raise _save_failed(pending.tmp, exc) from None
            for old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint saved: %s (%.2f s after the save began; training waited %.2f s)",
                     pending.final, time.perf_counter() - pending.started, pending.blocked)
        dist.barrier()


def read_state(path: Path) -> dict:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise QShardError(f"{path}: not a complete qshard checkpoint (no {STATE_FILE})")
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as exc:
        raise QShardError(f"{state_file}:{exc.lineno}: corrupt checkpoint state ({exc.msg})") from None


def check_compatible(path: Path, state: dict, cfg: Config, fingerprint: str) -> None:
    """Refuse a checkpoint of another base model, or one whose tensors the current options cannot hold."""
    if state.get("base_fingerprint") != fingerprint:
        raise QShardError(
            f"{path}: this checkpoint was trained from another base model ({state.get('base_model')}), "
            f"not {cfg.model.path}"
        )
    saved = state.get("config", {})
    current, defaults = cfg.to_dict(), Config().to_dict()
    for key in SHAPE_KEYS:
        section, name = key.split(".")
        # A key that an older qshard did not save had its default value then.
        old, new = saved.get(section, {}).get(name, defaults[section][name]), current[section][name]
        if old != new:
            raise QShardError(f"{path}: saved with {key}={old!r}, but this run has {key}={new!r}")


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load trainable weights (and the optimizer state, if given) into the (sharded) model, resharding to
    this world size as needed."""
    state = _app_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # DCP's wrapper of per-rank failures is a BaseException
        raise QShardError(f"{path}: cannot load checkpoint ({_reason(exc)})") from None
    # Not strict: the frozen base is deliberately absent from the checkpoint (rebuilt from the base model).
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)


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


def _reason(exc: BaseException) -> str:
    """One line: DCP's CheckpointException carries each failed rank's exception and traceback as text."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        # Per torch version: an object with .exception, or an (exception, traceback frames) pair.
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        exc = getattr(inner, "exception", inner)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def resolve_resume(cfg: Config, out: Path) -> Path | None:
    """`checkpoint.resume`: none, `auto` (the newest complete one under the output dir, if any), or a path."""
    choice = cfg.checkpoint.resume
    if choice in (None, "none"):
        return None
    root = out / "checkpoints"
    if choice == "auto":
        return find_latest(root)
    path = Path(choice)
    if not path.is_dir():
        raise QShardError(f"checkpoint.resume: {path} is not a directory")
    read_state(path)
    return path
