"""The reference of dpo and ipo (kto computes its own each step) where it is not computed each step.

- pref.precompute_reference: each row's reference log-prob is computed once, before the first step, and kept
  beside the tokenized rows in their cache entry (`reference-<key>.npy`, the key naming the model and the
  adapter it was computed with); a later run on the same data and model reads it back. Each step then runs the
  policy's forward only.
- train.init_adapter: training continues an existing PEFT adapter (an SFT run's), and the reference is the base
  with that adapter, as it was before the first step: computed then, with the same precomputation, so no copy of
  the base or of the adapter is kept for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from qshard.adapters import adapters_disabled
from qshard.config import Config
from qshard.data.preference import PairView
from qshard.data.store import ExampleView, TokenStore
from qshard.errors import QShardError
from qshard.parallel.fsdp import reshard_all

log = logging.getLogger("qshard")


# ------------------------------------------------------------------------------------------------ init adapter


def init_adapter_dir(path: str) -> Path:
    """train.init_adapter's adapter directory: a run's adapter/ (given the run), or a PEFT adapter directory."""
    given = Path(path)
    for candidate in (given / "adapter", given):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise QShardError(f"train.init_adapter: {given} is neither a PEFT adapter directory (adapter_config.json) nor "
                      "a run directory with adapter/")


def load_init_adapter(cfg: Config, model: nn.Module) -> Path:
    """Set the model's adapters from train.init_adapter, after checking the adapter was trained with this run's
    lora options (its rank, scaling and kind); returns its directory."""
    from qshard.generate_cmd import adapter_params, read_adapter_config, read_adapter_tensors, set_adapter

    adapter = init_adapter_dir(cfg.train.init_adapter)
    config = read_adapter_config(adapter)
    dora = cfg.train.train_type in ("dora", "qdora")
    wanted = (("lora.rank", cfg.lora.rank, config.get("r")), ("lora.alpha", cfg.lora.alpha, config.get("lora_alpha")),
              ("lora.use_rslora", cfg.lora.use_rslora, bool(config.get("use_rslora"))),
              ("train.train_type (DoRA)", dora, bool(config.get("use_dora"))))
    for option, ours, theirs in wanted:
        if float(ours) != float(theirs):
            raise QShardError(f"train.init_adapter: {adapter} was trained with {option} {theirs}, this run has {ours}")
    # Modules the adapter trained in full must train here too: loaded into a frozen base, they would be left out
    # of this run's adapter, and whoever loads it would lose them.
    theirs_full = sorted(config.get("modules_to_save") or [])
    if theirs_full != sorted(cfg.lora.modules_to_save or []):
        raise QShardError(f"train.init_adapter: {adapter} trained {theirs_full or 'no modules'} in full "
                          f"(modules_to_save), this run lora.modules_to_save {cfg.lora.modules_to_save or []}; "
                          "give the same")
    set_adapter(model, adapter_params(read_adapter_tensors(adapter)), adapter)
    return adapter


# ---------------------------------------------------------------------------------------------- precomputation


def reference_key(cfg: Config, fingerprint: str) -> str:
    """What the reference log-probs depend on: the base (its fingerprint and how it is built and computed), the
    initial adapter (its files), and how rows are rendered is already the store's own key."""
    identity = {"base": fingerprint, "model": cfg.model.attn_implementation, "quant": vars(cfg.quant),
                "train_type": cfg.train.train_type, "precision": cfg.train.precision}
    if cfg.train.init_adapter:
        files = sorted(p for p in init_adapter_dir(cfg.train.init_adapter).iterdir() if p.is_file())
        identity["adapter"] = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def precompute_reference(trainer, views: Sequence[PairView], key: str, adapters_off: bool) -> None:
    """Every row's reference log-prob of the stores behind `views`, read from their cache entries or computed now
    (by all ranks, pairs interleaved, then summed over ranks) and written there by local rank 0; attached to the
    stores, so that the pairs the trainer collates carry them."""
    stores = list({id(s): s for view in views if len(view) for s in view.rows.stores}.values())
    for store in stores:
        path = store.directory / f"reference-{key}.npy"
        reference = _read(path, len(store))
        if _any_rank(reference is None, trainer):
            with adapters_disabled(trainer.model) if adapters_off else contextlib.nullcontext():
                reference = _compute(trainer, store)
            if trainer.env.local_rank == 0:
                _write(path, reference)
        store.reference = reference
    if trainer.env.is_main:
        log.info("reference log-probs of %d stores ready (%s)", len(stores),
                 "the base with the adapters off" if adapters_off else "the base with train.init_adapter")


@torch.no_grad()
def _compute(trainer, store: TokenStore) -> np.ndarray:
    pairs = PairView(ExampleView.of(store))
    n, world, rank = len(pairs), trainer.env.world_size, trainer.env.rank
    mbs = trainer.cfg.train.micro_batch_size
    mine = list(range(rank, n, world))
    rows = torch.zeros(2 * n, dtype=torch.float64, device=trainer.env.device)
    trainer.model.eval()
    for start in range(0, -(-n // world), mbs):  # the same number of forwards on every rank
        chunk = mine[start : start + mbs]
        batch = trainer._to_device(trainer.objective.collate([pairs[i] for i in chunk or [0]], trainer.pad_id))
        logps = trainer.objective.sequence_logps(trainer.model, batch)[0]
        if chunk:
            lengths = [(len(pairs[i].chosen.input_ids), len(pairs[i].rejected.input_ids)) for i in chunk]
            where = [2 * i for i, (c, _) in zip(chunk, lengths, strict=True) if c]
            where += [2 * i + 1 for i, (_, r) in zip(chunk, lengths, strict=True) if r]
            rows[torch.tensor(where, device=rows.device)] = logps.double()
    reshard_all(trainer.model)
    dist.all_reduce(rows)
    return rows.float().cpu().numpy()


def _any_rank(flag: bool, trainer) -> bool:
    t = torch.tensor([float(flag)], device=trainer.env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _read(path: Path, rows: int) -> np.ndarray | None:
    """The saved reference of a store of `rows` rows, or None (missing, or not a whole one)."""
    try:
        reference = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return reference if reference.dtype == np.float32 and reference.shape == (rows,) else None


def _write(path: Path, reference: np.ndarray) -> None:
    """Written under a temporary name and renamed into place; a cache this run may not write to keeps none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            np.save(f, reference)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("%s: the reference log-probs are not kept for later runs (%s)", path, e.strerror)
