"""`qshard plan --fit`: the fastest settings predicted to fit, searched over the options that trade memory for
speed at the same global batch; each result is the command-line overrides that turn the given run into it."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from qshard.build import Skeleton
from qshard.config import QUANTIZED_TRAIN_TYPES, Config
from qshard.errors import QShardError
from qshard.host_embedding import embedding_on_host_choice
from qshard.parallel.compile import AUTO
from qshard.parallel.tiling import tileable
from qshard.planner.activations import probe_activations
from qshard.planner.estimate import Estimate, estimate
from qshard.planner.hardware import Machine

LOSS_CHUNKS = (512, 1024, 2048)
AC_EVERY = (1, 2, 4)
MLP_TILE = 8192  # the tile measured at 128k and 256k tokens (docs/benchmarks.md)
# From this sequence length, settings that keep attention through the checkpoint are searched too: there the
# recompute's attention is a large part of the step (measured 32k to 128k tokens, docs/benchmarks.md); below, the
# memory is better spent elsewhere, and the search stays half the size.
KEEP_ATTENTION_FROM = 16384


@dataclass
class Candidate:
    overrides: list[tuple[str, str]]
    estimate: Estimate

    def flags(self) -> str:
        return " ".join(f"--{key} {value}" for key, value in self.overrides) or "(the settings as given)"


def _settings(cfg: Config, world: int, seq: int, tiles_allowed: bool) -> list[dict[str, object]]:
    """Every combination searched, as {dotted key: value}: the run's own sharding and the plain ones; compile
    only where the run could compile (`cfg` holds what parallel.compile decided: off without Triton, or when
    the user said false); tiled MLPs only where the blocks take them and a sequence spans several tiles."""
    t, p = cfg.train, cfg.parallel
    batch = t.micro_batch_size * t.grad_accum
    micro = [m for m in (1, 2, 4, 8, 16) if batch % m == 0] or [t.micro_batch_size]
    checkpointing = [(False, 1)] + [(True, k) for k in AC_EVERY]
    shardings = list(dict.fromkeys([p.sharding, "full", "grad_op"])) if world > 1 else [p.sharding]
    compiles = (True, False) if p.compile else (False,)
    quantized = t.train_type in QUANTIZED_TRAIN_TYPES
    found = []
    tiles = (0, MLP_TILE) if tiles_allowed and seq >= 2 * MLP_TILE else (0,)
    keeps = (False, True) if seq >= KEEP_ATTENTION_FROM else (p.ac_keep_attention,)
    # Kept projections only where they could take effect; elsewhere the run's own value (`auto` reads as off there).
    projections = (False, True) if quantized and world == 1 else (p.ac_save_projections,)
    for m, (ac, every), proj, act_off, cpu_off, chunk, compiled, sharding, tile, keep in itertools.product(
            micro, checkpointing, projections, (False, True),
            (False, True), LOSS_CHUNKS, compiles, shardings, tiles, keeps):
        found.append({
            "train.micro_batch_size": m, "train.grad_accum": batch // m,
            "parallel.activation_checkpointing": ac, "parallel.ac_every": every,
            "parallel.ac_save_projections": proj, "parallel.activation_offload": act_off,
            # Resident blocks are blocks kept out of the offload, the overlapped host optimizer steps on the host and
            # deferred gradient sums keep its copies asynchronous: none without it (config.py refuses them).
            "parallel.cpu_offload": cpu_off, "parallel.resident_blocks": p.resident_blocks if cpu_off else 0,
            "parallel.overlap_host_optimizer": p.overlap_host_optimizer and cpu_off,
            "parallel.defer_grad_accumulation": p.defer_grad_accumulation and cpu_off,
            "train.loss_chunk_tokens": chunk, "parallel.compile": compiled,
            "parallel.sharding": sharding, "parallel.mlp_tile_tokens": tile,
            "parallel.ac_keep_attention": keep and ac,
        })
    return found


def _apply(cfg: Config, setting: dict[str, object]) -> Config | None:
    """`cfg` with `setting`, or None where the combination is refused (config.py's own rules)."""
    new = copy.deepcopy(cfg)
    for dotted, value in setting.items():
        section, key = dotted.split(".")
        setattr(getattr(new, section), key, value)
    try:
        return new.validate()
    except QShardError:
        return None


def _overrides(cfg: Config, setting: dict[str, object]) -> list[tuple[str, str]]:
    changed = []
    for dotted, value in setting.items():
        section, key = dotted.split(".")
        if getattr(getattr(cfg, section), key) != value:
            changed.append((dotted, str(value).lower() if isinstance(value, bool) else str(value)))
    return changed


def search(model: Skeleton, cfg: Config, machine: Machine, seq: int, top: int = 5) -> tuple[list[Candidate],
                                                                                              Candidate]:
    """The `top` fastest settings predicted to fit (fastest first), and the one of least peak GPU memory (what
    to report when none fits)."""
    acts = probe_activations(model, cfg)
    layouts: dict = {}
    seen, fitting = set(), []
    smallest: Candidate | None = None
    for setting in _settings(cfg, machine.world_size, seq, tileable(model.blocks)):
        new = _apply(cfg, setting)
        if new is None:
            continue
        if cfg.model.embedding_on_host == AUTO:  # as `qshard train` would settle it with these settings
            new.model.embedding_on_host = embedding_on_host_choice(new, True, machine.world_size,
                                                                   lambda: model.model)[0]
        overrides = _overrides(cfg, setting)
        key = tuple(overrides)
        if key in seen:
            continue
        seen.add(key)
        candidate = Candidate(overrides, estimate(model, new, machine, seq, acts, layouts))
        if smallest is None or candidate.estimate.peak_gpu_gib < smallest.estimate.peak_gpu_gib:
            smallest = candidate
        if candidate.estimate.fits:
            fitting.append(candidate)
    if smallest is None:
        raise QShardError("qshard plan --fit: none of the settings searched is valid with the options given "
                          "(run qshard plan without --fit to see why)")
    # Among settings equally fast, the fewest changes first; one that only adds changes to a listed one that is as
    # fast is left out.
    fitting.sort(key=lambda c: (-round(c.estimate.tok_s), len(c.overrides), c.estimate.peak_gpu_gib))
    shown: list[Candidate] = []
    for c in fitting:
        if not any(round(k.estimate.tok_s) == round(c.estimate.tok_s) and set(k.overrides) <= set(c.overrides)
                   for k in shown):
            shown.append(c)
    return shown[:top], smallest
