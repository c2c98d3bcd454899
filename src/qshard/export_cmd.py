"""`qshard export adapter|merged`: rebuild a run's model from its base checkpoint, load the trained
weights from one of its checkpoints, and write a PEFT adapter or a merged Hugging Face model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qshard import checkpoint, export, outputs, rundir
from qshard import config as config_mod
from qshard.build import build_model, resolve_model, training_tokenizer
from qshard.checkpoint import base_fingerprint_all_ranks, base_model_name
from qshard.errors import QShardError
from qshard.export_tokenizer import export_tokenizer
from qshard.loading.hub import hub_model
from qshard.parallel.distributed import DistEnv, held_by_rank0, init_distributed, shutdown

log = logging.getLogger("qshard")


def find_checkpoint(run_dir: Path, explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit)
        checkpoint.read_state(path)
        return path
    latest = checkpoint.find_latest(run_dir / "checkpoints")
    if latest is None:
        raise QShardError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    return latest


def run_export(kind: str, run_dir: Path, ckpt_arg: str | None, out: Path | None, max_shard_gib: float,
               base_name: str | None = None) -> Path:
    """Write the adapter or merged model of `run_dir`'s checkpoint (its newest, or `ckpt_arg`) to `out`
    (default: the run's adapter/ or merged/), after refusing any `out` whose contents are not its own. The run
    is locked meanwhile, as a training run locks it: none writes into it, or prunes the checkpoint read.
    `base_name` (--base-name) replaces the base the export names (a Hub id, `id@revision`, or a directory)."""
    if not run_dir.is_dir():
        raise QShardError(f"--run: {run_dir} is not a directory")
    env = init_distributed()
    try:
        with held_by_rank0(lambda: rundir.run_lock(run_dir), env.is_main):
            return _export(kind, run_dir, ckpt_arg, out, max_shard_gib, env, base_name)
    finally:
        shutdown()


def reading_config(cfg: config_mod.Config) -> config_mod.Config:
    """A run's config, to build its model for reading the weights back: how the run was sharded, offloaded or
    compiled does not matter to that at this world size (a hybrid run's replica count need not divide it), and
    export runs no forward to compile."""
    cfg.parallel.sharding, cfg.parallel.replicate_degree, cfg.parallel.cpu_offload = "full", 0, False
    cfg.parallel.compile, cfg.parallel.cuda_graphs, cfg.parallel.ac_save_projections = False, False, False
    # Neither reading weights back nor generating holds training's state: the embedding fits on the GPU, where each
    # generated token's row needs no trip through the host.
    cfg.model.embedding_on_host = False
    return cfg


def _export(kind: str, run_dir: Path, ckpt_arg: str | None, out: Path | None, max_shard_gib: float,
            env: DistEnv, base_name: str | None) -> Path:
    ckpt = find_checkpoint(run_dir, ckpt_arg)
    state = checkpoint.read_state(ckpt)
    cfg = reading_config(config_mod.resolve(str(ckpt / "config.yaml"), []))
    out = out or run_dir / kind
    _check_out(out, run_dir, ckpt, cfg)
    if _resolved(out) in _run_exports(run_dir) and not _belongs_to(ckpt, run_dir):
        _check_same_run(ckpt, state, run_dir, out)
    outputs.check_target(out, "--out", kind)  # before the model is built; the writer checks again
    if kind == "merged" and cfg.model.path is None:
        raise QShardError(f"{ckpt}: a model.shape run has no model directory to take a merged model's config and "
                          "tokenizer from; export the adapter instead")
    if kind == "adapter" and cfg.train.train_type in config_mod.ADAPTERLESS_TRAIN_TYPES:
        raise QShardError(f"{ckpt}: a {cfg.train.train_type} run has no adapter; use `qshard export merged`")
    name, revision = _base_reference(cfg, state.get("base_commit"), base_name)
    # A Hub base is read at the commit the checkpoint was trained from (from the cache, where training put it).
    model_dir, _ = resolve_model(cfg, env, state.get("base_commit"))
    checkpoint.follow_saved_autos(cfg, state)
    checkpoint.check_compatible(ckpt, state, cfg, base_fingerprint_all_ranks(cfg, env, model_dir))
    tokenizer = export_tokenizer(cfg, training_tokenizer(cfg, model_dir), model_dir)  # its errors before the build
    vocab_size = state.get("vocab_size")  # the rows the run's embedding had (data.add_special_tokens may add some)
    model, report = build_model(cfg, env, model_dir, vocab_size)
    checkpoint.load(ckpt, model, optimizer=None)
    if kind == "adapter":
        tensors = export.gather_lora(model)
        if env.is_main:
            export.write_peft_adapter(out, tensors, cfg.lora, export.target_modules(model), name, tokenizer,
                                      revision, saved_modules=export.modules_to_save(model))
    else:
        weights = export.model_weights(model, torch.bfloat16, merge_adapters=True)
        export.write_merged(out, weights, model_dir, env.is_main, int(max_shard_gib * 2**30), torch.bfloat16,
                            tokenizer, base_name=name if base_name else None, vocab_size=vocab_size)
    if env.is_main:
        log.info("exported %s from %s to %s", kind, ckpt, out)
    return out


def _base_reference(cfg: config_mod.Config, commit: str | None, base_name: str | None) -> tuple[str, str | None]:
    """The base an export names, and its revision: --base-name (a Hub id, with `@revision` if given, else the
    commit trained from when it is the run's own Hub id; or any other name, as given), else the run's base."""
    if base_name is None:
        return base_model_name(cfg), commit
    if not base_name.strip():
        raise QShardError("--base-name: give the base model's Hub id or directory")
    hub = hub_model(base_name, None, option="--base-name")
    if hub is None:
        return base_name, None
    own = hub.repo_id == base_model_name(cfg)
    return hub.repo_id, hub.revision or (commit if own else None)


def _check_out(out: Path, run_dir: Path, ckpt: Path, cfg: config_mod.Config) -> None:
    """Refuse an --out that is, lies inside or contains the run (but for its own export places), the
    checkpoint read, or the base model's directory: replacing it would destroy them."""
    target = _resolved(out)
    if target in _run_exports(run_dir):
        places = [("the checkpoint", ckpt)]
    else:
        places = [("the run directory", run_dir), ("the checkpoint", ckpt)]
    if cfg.model.path is not None and hub_model(cfg.model.path, cfg.model.revision) is None:
        places.append(("the base model directory", Path(cfg.model.path)))
    for what, place in places:
        where = _resolved(place)
        relation = ("is" if target == where else "is inside" if where in target.parents
                    else "contains" if target in where.parents else None)
        if relation:
            raise QShardError(f"--out {out}: {relation} {what} {place}; choose a directory outside it")


def _check_same_run(ckpt: Path, state: dict, run_dir: Path, out: Path) -> None:
    """A checkpoint from elsewhere may replace the run's own export only if it was trained as the run was:
    from the same base model, with the same options (but for those a resumed run may change)."""
    reference = _run_reference(run_dir)
    if reference is None:  # not a run: it has no export of its own to lose
        return
    fingerprint, config = reference
    why = None
    if fingerprint is not None and state.get("base_fingerprint") != fingerprint:
        why = f"was trained from another base model ({state.get('base_model')})"
    else:
        key = _differing_key(state.get("config", {}), config)
        if key is not None:
            section, name = key.split(".")
            why = (f"was saved with {key}={_get(state.get('config', {}), section, name)!r}, the run with "
                   f"{_get(config, section, name)!r}")
    if why:
        raise QShardError(f"--checkpoint {ckpt}: {why}, so it is not {run_dir}'s to replace {out} with; "
                          "give --out a new directory")


# Options that may differ between the sessions of one run (a resume with more steps, more processes, another
# batch split or cache): a checkpoint differing from the run only in these is taken to be the run's.
_SESSION_SECTIONS = ("parallel", "checkpoint", "output")
_SESSION_KEYS = ("train.max_steps", "train.epochs", "train.eval_every", "train.log_every", "train.loss_chunk_tokens",
                 "train.micro_batch_size", "train.grad_accum", "data.cache_dir", "data.cache_max_gb",
                 "data.num_workers", "model.load_mode", "model.attn_implementation")


def _differing_key(saved: dict, reference: dict) -> str | None:
    """The first option, other than a session's, whose values in two saved configurations differ."""
    for section, keys in config_mod.Config().to_dict().items():
        if section in _SESSION_SECTIONS:
            continue
        for name in keys:
            key = f"{section}.{name}"
            if key not in _SESSION_KEYS and _get(saved, section, name) != _get(reference, section, name):
                return key
    return None


def _get(config: dict, section: str, name: str):
    """A saved option's value; one that an older qshard did not save had its default value then."""
    default = checkpoint.SAVED_AUTO_KEYS.get(f"{section}.{name}", config_mod.Config().to_dict()[section][name])
    values = config.get(section)
    return values.get(name, default) if isinstance(values, dict) else default


def _run_reference(run_dir: Path) -> tuple[str | None, dict] | None:
    """What the run was trained from: (base fingerprint, configuration) of its newest checkpoint, or
    (None, its config.yaml) before its first one; None for a directory that holds no run."""
    latest = checkpoint.find_latest(run_dir / "checkpoints")
    if latest is not None:
        state = checkpoint.read_state(latest)
        return state.get("base_fingerprint"), state.get("config", {})
    if (run_dir / "config.yaml").is_file():
        return None, config_mod.resolve(str(run_dir / "config.yaml"), []).to_dict()
    return None


def _run_exports(run_dir: Path) -> tuple[Path, Path]:
    """The places `qshard train` and `qshard export` write a run's own exports to."""
    return _resolved(run_dir / "adapter"), _resolved(run_dir / "merged")


def _belongs_to(ckpt: Path, run_dir: Path) -> bool:
    return _resolved(ckpt).parent == _resolved(run_dir / "checkpoints")


def _resolved(path: Path) -> Path:
    return Path(path).resolve()
